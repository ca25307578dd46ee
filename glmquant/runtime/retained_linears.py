"""Retained linears stored as EXL3 (the speed tier, `encode --retained-bits K`) inside transformers' model.

Each such linear (attention projections, shared experts, dense MLPs) replaces its `nn.Linear` with an
`Exl3Linear` before the layer's other tensors are assigned. Two ways to run one, chosen by the expert backend:
- "decode" (the torch backend, the CPU reference): the weight is decoded once at load (`decode_weight`, the same
  decode the torch expert backend uses) and applied with `F.linear`;
- "kernel" (the Triton backends, a CUDA device or the CPU under TRITON_INTERPRET=1): `exl3_linear` decodes the
  trellis inside the matrix product on every call (the GEMV core for one or two rows at K2 and K4, the small-job
  core for other K and up to four rows, the tensor-core GEMM else), so only the packed codes stay in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmquant.exl3.decode import decode_weight
from glmquant.exl3.tensor import EXL3Tensor

MODES = ("decode", "kernel")


class Exl3Linear(nn.Module):
    """y = x Wᵀ for an EXL3-stored linear without bias. Its tensors are non-persistent buffers: they move with the
    module but are not part of its state dict (the checkpoint has no `.weight` for it)."""

    weight: torch.Tensor  # decode: the decoded weight (out, in); kernel: empty, only its dtype
    trellis: torch.Tensor  # kernel mode: the stored EXL3 tensors
    suh: torch.Tensor
    svh: torch.Tensor

    def __init__(self, tensor: EXL3Tensor, mode: str, dtype: torch.dtype, source: str = "") -> None:
        super().__init__()
        self.source = source  # the checkpoint weight it stands for (`...q_proj.weight`)
        if mode not in MODES:
            raise ValueError(f"Exl3Linear mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.in_features, self.out_features = tensor.in_features, tensor.out_features
        self.bits = tensor.bits
        self.codebook = tensor.codebook
        if mode == "decode":
            self.register_buffer("weight", decode_weight(tensor, dtype), persistent=False)
        else:
            for part in ("trellis", "suh", "svh"):
                self.register_buffer(part, getattr(tensor, part), persistent=False)
            # no dense weight; an empty one carries the dtype for modeling code that reads `linear.weight.dtype`
            # (transformers' DSA indexer casts its input to `weights_proj.weight.dtype`)
            self.register_buffer("weight", torch.empty(0, dtype=dtype, device=tensor.trellis.device), persistent=False)

    def exl3(self) -> EXL3Tensor:
        """The stored tensor (kernel mode)."""
        return EXL3Tensor(self.trellis, self.suh, self.svh, self.codebook, self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "decode":
            return F.linear(x, self.weight)
        from glmquant.runtime.kernels.exl3_gemm import exl3_linear  # imports triton: only on this path

        return exl3_linear(x, self.exl3())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, K={self.bits}, mode={self.mode}"
