"""EXL3 tensor groups as they appear in checkpoint headers: `<key>.trellis/.suh/.svh` plus a codebook marker.

Recognising groups from names alone lets the verifier, the manifest and the ExLlamaV3 storage map work
from safetensors headers, without reading tensor data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from glmquant.checkpoint.safetensors_format import TensorSpec

PARTS = ("trellis", "suh", "svh")
MARKERS = ("mcg", "mul1")
# uint32 multipliers of the markers, as ExLlamaV3 reports them in quantization_config.json
MARKER_MULTIPLIERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}


def split_part(name: str) -> tuple[str, str] | None:
    """(key, part) when `name` is a candidate EXL3 part, else None."""
    key, _, part = name.rpartition(".")
    return (key, part) if key and part in PARTS + MARKERS else None


@dataclass(frozen=True)
class Exl3Group:
    """The stored tensors of one quantized linear, by part name."""

    key: str
    parts: Mapping[str, TensorSpec]

    @property
    def bits(self) -> int | None:
        trellis = self.parts.get("trellis")
        return trellis.shape[-1] // 16 if trellis is not None and len(trellis.shape) == 3 else None

    def problems(self, codebook: str = "mcg") -> list[str]:
        """Defects of the group on its own: missing parts, dtypes, shapes inconsistent with K, markers
        (exactly one for the mcg/mul1 codebooks, none for 3inst)."""
        missing = [p for p in PARTS if p not in self.parts]
        if missing:
            return [f"{self.key}: missing .{', .'.join(missing)}"]
        t, suh, svh = (self.parts[p] for p in PARTS)
        out = []
        if t.dtype != "I16" or len(t.shape) != 3 or t.shape[-1] % 16 or not 16 <= t.shape[-1] <= 128:
            out.append(f"{self.key}.trellis: {t.dtype} {list(t.shape)} is not int16 (in/16, out/16, 16*K), K 1..8")
        elif t.nbytes != t.shape[0] * t.shape[1] * 256 * (t.shape[-1] // 16) // 8:  # K = shape[-1] / 16
            out.append(f"{self.key}.trellis: {t.nbytes} bytes, expected in*out*K/8")
        else:
            for vec, size in ((suh, t.shape[0] * 16), (svh, t.shape[1] * 16)):
                if vec.dtype != "F16" or vec.shape != (size,):
                    out.append(f"{vec.name}: {vec.dtype} {list(vec.shape)}, expected F16 [{size}] for the trellis")
        markers = [self.parts[m] for m in MARKERS if m in self.parts]
        if len(markers) != (codebook != "3inst"):
            out.append(
                f"{self.key}: {len(markers)} codebook markers (.mcg/.mul1), expected "
                + ("none for 3inst" if codebook == "3inst" else "exactly one")
            )
        out += [
            f"{m.name}: {m.dtype} {list(m.shape)}, expected a 0-dim I32 marker"
            for m in markers
            if m.dtype != "I32" or m.shape != ()
        ]
        return out


def exl3_groups(specs: Iterable[TensorSpec]) -> dict[str, Exl3Group]:
    """Group EXL3 parts by key. Only keys with a `.trellis` (or orphan parts without one) form groups."""
    by_key: dict[str, dict[str, TensorSpec]] = {}
    for spec in specs:
        split = split_part(spec.name)
        if split is not None:
            by_key.setdefault(split[0], {})[split[1]] = spec
    return {key: Exl3Group(key, parts) for key, parts in sorted(by_key.items())}


def is_exl3_tensor(name: str, groups: Mapping[str, Exl3Group]) -> bool:
    split = split_part(name)
    return split is not None and split[0] in groups
