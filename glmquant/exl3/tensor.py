"""EXL3Tensor: exactly the tensors one quantized linear stores in a checkpoint, with validation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from glmquant.exl3.codebooks import MARKER_VALUES, Codebook


def padded(size: int) -> int:
    """Both dims of an EXL3 weight are zero-padded to a multiple of 128."""
    return -(-size // 128) * 128


@dataclass(frozen=True)
class EXL3Tensor:
    """One quantized linear in EXL3 orientation (in, out), padded; HF shape is (out_features, in_features)."""

    trellis: torch.Tensor  # int16 [in_pad/16, out_pad/16, 16*K]
    suh: torch.Tensor  # float16 [in_pad]
    svh: torch.Tensor  # float16 [out_pad]
    codebook: Codebook
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        # Values of device tensors are not read back here (that would synchronize the host with the GPU per tensor):
        # from_tensors checks what a checkpoint holds wherever it is loaded, and the encoder decodes what it builds.
        _validate(self.trellis, self.suh, self.svh, self.in_features, self.out_features, "", values=False)

    @property
    def bits(self) -> int:
        return self.trellis.shape[-1] // 16

    def to(self, device: torch.device | str) -> EXL3Tensor:
        """The same tensor with its parts on `device`."""
        return EXL3Tensor(
            self.trellis.to(device),
            self.suh.to(device),
            self.svh.to(device),
            self.codebook,
            self.in_features,
            self.out_features,
        )

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under `prefix` (e.g. 'model.layers.0.mlp.down_proj')."""
        out = {f"{prefix}.trellis": self.trellis, f"{prefix}.suh": self.suh, f"{prefix}.svh": self.svh}
        if self.codebook in MARKER_VALUES:
            marker = torch.tensor(MARKER_VALUES[self.codebook], dtype=torch.int32)
            out[f"{prefix}.{self.codebook.value}"] = marker
        return out

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], prefix: str, in_features: int, out_features: int
    ) -> EXL3Tensor:
        """Read back what tensors() wrote; the codebook is whichever marker is present (none: 3INST)."""
        names = {k: f"{prefix}.{k}" for k in ("trellis", "suh", "svh")}
        for name in names.values():
            if name not in tensors:
                raise ValueError(f"missing tensor {name}")
        found = [cb for cb in MARKER_VALUES if f"{prefix}.{cb.value}" in tensors]
        if len(found) > 1:
            raise ValueError(f"{prefix}: both .mcg and .mul1 markers present")
        codebook = found[0] if found else Codebook.THREE_INST
        if found:
            marker = tensors[f"{prefix}.{codebook.value}"]
            if marker.dtype != torch.int32 or marker.dim() != 0:
                raise ValueError(
                    f"{prefix}.{codebook.value} must be a 0-dim int32 marker, got {marker.dtype} {tuple(marker.shape)}"
                )
        trellis, suh, svh = (tensors[names[k]] for k in ("trellis", "suh", "svh"))
        _validate(trellis, suh, svh, in_features, out_features, prefix)
        return cls(trellis, suh, svh, codebook, in_features, out_features)

    @staticmethod
    def storage_bytes(in_features: int, out_features: int, bits: int, codebook: Codebook | str) -> int:
        """Exact bytes of tensors(): trellis + fp16 scales (padded dims) + 4-byte marker if any."""
        kp, np_ = padded(in_features), padded(out_features)
        marker = 4 if Codebook(codebook) in MARKER_VALUES else 0
        return kp * np_ * bits // 8 + 2 * (kp + np_) + marker


def _validate(
    trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, k: int, n: int, prefix: str, values: bool = True
) -> None:
    """Raise ValueError naming the first tensor whose dtype or shape breaks the storage contract, or (values; always
    on the CPU) whose scales are not finite."""
    if k <= 0 or n <= 0:
        raise ValueError(f"{prefix}: in_features and out_features must be positive, got {k}, {n}")
    kp, np_ = padded(k), padded(n)
    name = f"{prefix}.trellis" if prefix else "trellis"
    if trellis.dtype != torch.int16:
        raise ValueError(f"{name} must be int16, got {trellis.dtype}")
    last = trellis.shape[-1] if trellis.dim() == 3 else 0
    if trellis.dim() != 3 or tuple(trellis.shape[:2]) != (kp // 16, np_ // 16) or last % 16 or not 16 <= last <= 128:
        raise ValueError(
            f"{name} has shape {tuple(trellis.shape)}, expected ({kp // 16}, {np_ // 16}, 16*K) with K in 1..8"
        )
    for vec, size, key in ((suh, kp, "suh"), (svh, np_, "svh")):
        name = f"{prefix}.{key}" if prefix else key
        if vec.dtype != torch.float16:
            raise ValueError(f"{name} must be float16, got {vec.dtype}")
        if tuple(vec.shape) != (size,):
            raise ValueError(f"{name} has shape {tuple(vec.shape)}, expected ({size},)")
        if (values or vec.device.type == "cpu") and not torch.isfinite(vec).all():
            raise ValueError(f"{name} contains NaN or Inf values")
