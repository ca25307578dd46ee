"""The engine's projections: a dense weight applied with `F.linear`, or, for the speed tier (`encode --retained-bits`)
on the Triton backends, an `Exl3Proj`: the row blocks of one fused projection (q/k/v, gate/up, ...), each an EXL3
retained linear run through `exl3_linear` (the trellis decoded inside the matrix product) or a dense block (exact, or
an EXL3 linear small enough to run faster decoded: `RuntimeOptions.dense_linear_max_weights`), their outputs
concatenated in order. With the torch backend an EXL3 retained linear is decoded once at load instead and
the projection stays one dense tensor (`weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any, cast

import torch
import torch.nn.functional as F

from glmquant.exl3.tensor import EXL3Tensor


@dataclass(frozen=True)
class Exl3Proj:
    """Row blocks of one projection [sum of out, in], in order: an EXL3 linear's prepared `WeightStack` or a dense
    weight [out, in]."""

    blocks: tuple[Any, ...]  # WeightStack (imports triton, so not named here) | torch.Tensor
    nbytes: int  # what a step reads: the EXL3 tensors' storage plus the dense blocks

    @classmethod
    def build(cls, blocks: list[EXL3Tensor | torch.Tensor], device: torch.device) -> Exl3Proj:
        """Adjacent dense blocks become one weight (one matrix product)."""
        from glmquant.runtime.kernels.exl3_jobs import WeightStack  # imports triton: only on this path

        nbytes, prepared = 0, list[Any]()
        for dense, run in groupby(blocks, key=lambda b: isinstance(b, torch.Tensor)):
            if dense:
                weights = cast(list[torch.Tensor], list(run))
                prepared.append(weights[0] if len(weights) == 1 else torch.cat(weights))
                nbytes += prepared[-1].nbytes
                continue
            for b in cast(list[EXL3Tensor], list(run)):
                prepared.append(WeightStack.single(b, device))
                nbytes += EXL3Tensor.storage_bytes(b.in_features, b.out_features, b.bits, b.codebook)
        return cls(tuple(prepared), nbytes)


Proj = torch.Tensor | Exl3Proj


def project(x: torch.Tensor, w: Proj) -> torch.Tensor:
    """x [..., in] @ wᵀ -> [..., out]."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    from glmquant.runtime.kernels.exl3_gemm import exl3_linear

    return torch.cat([F.linear(x, b) if isinstance(b, torch.Tensor) else exl3_linear(x, b) for b in w.blocks], dim=-1)
