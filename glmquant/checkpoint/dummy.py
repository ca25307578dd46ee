"""A checkpoint without files (vLLM's `--load-format dummy`): exactly the tensors an artifact plan predicts,
filled with deterministic, well-scaled values computed directly on the target device.

Every element is a hash of (seed, tensor name, element index), so a tensor read alone (`read_tensor`) equals the
same tensor read as part of a stack (`read_stack`, one pass over many experts' parts), on any device. Values:
random trellis codes with sign-flip input scales of 0.6/sqrt(in) and output scales in [0.75, 1.25] (a decoded
expert then has rms ~0.6/sqrt(in), as `fixtures.random_artifact` makes them; the retained linears of a
`--retained-bits` plan are made the same way); retained tensors uniform with unit
gain (std 1/sqrt(fan_in)), norms 1, biases 0, and the KDA / mHC / router parameters in the ranges their model
initializes them to, so activations stay finite through all layers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import torch

from glmquant.checkpoint.layouts import ArtifactPlan, OutputTensor
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import TORCH_DTYPES
from glmquant.errors import CheckpointFormatError
from glmquant.exl3.codebooks import MARKER_VALUES, Codebook

_M31 = 0x7FFFFFFF
_BLOCK = 1 << 24  # elements hashed at once: bounds the int64 temporaries to a few hundred MB
Convert = Callable[[torch.Tensor], torch.Tensor]  # 31-bit hashes (int64) -> values


@dataclass
class DummyCheckpoint:
    """`SourceCheckpoint`'s reading interface over a plan: names, specs, and generated tensors on `device`."""

    plan: ArtifactPlan
    seed: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reads: set[str] = field(default_factory=set, repr=False)  # every name read so far (tests check the load)
    tensors: dict[str, OutputTensor] = field(init=False, repr=False)
    _files: dict[str, str] = field(init=False, repr=False)  # tensor name -> its planned file
    directory: Path = field(init=False)  # names the dummy in messages, as a checkpoint's directory does

    def __post_init__(self) -> None:
        self.tensors = {t.name: t for f in self.plan.files for t in f.tensors}
        self._files = {t.name: f.path for f in self.plan.files for t in f.tensors}
        self.directory = Path(f"<dummy {self.plan.spec.architecture} {self.plan.layout} K{self.plan.bits}>")

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> TensorSpec:
        return self._known(name).spec

    def shard_of(self, name: str) -> str:
        """The planned file the tensor belongs to (it names the tensor's place in messages, as a shard does)."""
        self._known(name)
        return self._files[name]

    def read_tensor(self, name: str) -> torch.Tensor:
        """The tensor in its planned dtype and shape, on `device`."""
        return self.read_stack([name])[0]

    def read_stack(self, names: Sequence[str]) -> torch.Tensor:
        """[len(names), *shape]: tensors that share one planned dtype, shape and value rule, made in one pass."""
        infos = [self._known(n) for n in names]
        first = infos[0]
        rule = _rule(first)
        if any((t.dtype, t.shape) != (first.dtype, first.shape) or _rule(t) != rule for t in infos):
            raise ValueError(f"{self.directory}: {names[0]} and the other names do not share one dtype, shape and rule")
        self.reads.update(names)
        out = torch.empty((len(names), *first.shape), dtype=TORCH_DTYPES[first.dtype], device=self.device)
        keys = torch.tensor([_key(self.seed, n) for n in names], dtype=torch.int64, device=self.device)
        _fill(out.view(len(names), -1), keys, _converter(rule))
        return out

    def close(self) -> None:
        """Nothing is open; present for `SourceCheckpoint`'s interface."""

    def _known(self, name: str) -> OutputTensor:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointFormatError(f"{self.directory}: no tensor {name} in the planned artifact")
        return info


def _key(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & _M31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (xor-shift-multiply) on int64 values < 2^31: products stay below 2^58."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M31
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def _fill(out: torch.Tensor, keys: torch.Tensor, convert: Convert) -> None:
    """out[r, i] = convert(hash(key_r, i)) for out [R, E], in blocks of at most _BLOCK elements."""
    rows, cols = out.shape
    seeds = _mix(keys)
    col_step = min(cols, _BLOCK) or 1
    row_step = max(1, _BLOCK // col_step)
    for r0 in range(0, rows, row_step):
        r1 = min(rows, r0 + row_step)
        for c0 in range(0, cols, col_step):
            c1 = min(cols, c0 + col_step)
            idx = torch.arange(c0, c1, dtype=torch.int64, device=out.device)
            out[r0:r1, c0:c1] = convert(_mix((seeds[r0:r1, None] + idx[None, :]) & _M31)).to(out.dtype)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """[0, 1) from the hash's low 24 bits."""
    return (h & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def _sign(h: torch.Tensor) -> torch.Tensor:
    return ((h >> 24) & 1).to(torch.float32) * 2 - 1


@dataclass(frozen=True)
class _Rule:
    kind: str  # trellis | suh | svh | marker | const | uniform | range
    a: float = 0.0  # const: the value; uniform: the std; range: the low end
    b: float = 0.0  # range: the high end


def _rule(t: OutputTensor) -> _Rule:
    """How a planned tensor is filled (see the module docstring)."""
    exl3 = t.expert or t.linear  # a routed expert's or a retained linear's (`--retained-bits`) EXL3 part
    if exl3 is not None:
        if t.part in ("trellis", "svh"):
            return _Rule(t.part)
        if t.part == "suh":
            return _Rule("suh", 0.6 / exl3.in_features**0.5)
        assert t.part is not None
        return _Rule("marker", float(MARKER_VALUES[Codebook(t.part)]))
    name = t.name
    if name.endswith(("A_log", "_base", ".bias")) and not name.endswith("e_score_correction_bias"):
        return _Rule("const", 0.0)
    if name.endswith("dt_bias"):  # FLA's init: inverse softplus of dt in [1e-3, 1e-1]
        return _Rule("range", -6.9, -2.3)
    if name.endswith("_scale") or (len(t.shape) == 1 and "norm" in name):
        return _Rule("const", 1.0)
    if name.endswith(("_fn", "e_score_correction_bias", "compress_ape")):  # the model's own init std
        return _Rule("uniform", 0.02)
    if name.endswith("embed_tokens.weight"):
        return _Rule("uniform", 1.0)
    return _Rule("uniform", 1.0 / max(1, prod(t.shape[1:])) ** 0.5)


def _converter(rule: _Rule) -> Convert:
    if rule.kind == "trellis":
        return lambda h: (h & 0xFFFF) - 32768
    if rule.kind == "suh":
        return lambda h: _sign(h) * rule.a
    if rule.kind == "svh":
        return lambda h: _sign(h) * (0.75 + 0.5 * _uniform(h))
    if rule.kind in ("marker", "const"):
        return lambda h: torch.full_like(h, rule.a, dtype=torch.float64 if rule.kind == "marker" else torch.float32)
    if rule.kind == "range":
        return lambda h: rule.a + (rule.b - rule.a) * _uniform(h)
    return lambda h: (2 * _uniform(h) - 1) * (rule.a * 3**0.5)  # uniform with std rule.a
