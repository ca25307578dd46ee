"""The engine's projections: a dense weight applied with `F.linear`, or, for the speed tier (`encode --retained-bits`)
on the Triton backends, an `Exl3Proj`: the row blocks of one fused projection (q/k/v, gate/up, ...), each a stack of
adjacent EXL3 retained linears of one shape run through `exl3_linear` (the trellis decoded inside the matrix product,
one set of launches per stack) or a dense block (exact, or an EXL3 linear small enough to run faster decoded:
`RuntimeOptions.dense_linear_max_weights`), each writing its columns of the one output. With the torch backend an EXL3
retained linear is decoded once at load instead and the projection stays one dense tensor (`weights.py`).
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
    widths: tuple[int, ...]  # each block's output columns
    nbytes: int  # what a step reads: the EXL3 tensors' storage plus the dense blocks

    @classmethod
    def build(cls, blocks: list[EXL3Tensor | torch.Tensor], device: torch.device) -> Exl3Proj:
        """Adjacent dense blocks become one weight (one matrix product), adjacent EXL3 linears of one shape, bit width
        and codebook one stack (one set of `exl3_linear` launches: KDA's q, k, v; gate with up)."""
        from glmquant.runtime.kernels.exl3_jobs import WeightStack  # imports triton: only on this path

        nbytes, prepared, widths = 0, list[Any](), list[int]()
        for kind, run in groupby(blocks, key=_block_kind):
            if kind is None:
                weights = cast(list[torch.Tensor], list(run))
                prepared.append(weights[0] if len(weights) == 1 else torch.cat(weights))
                nbytes += prepared[-1].nbytes
                widths.append(prepared[-1].shape[0])
                continue
            linears = cast(list[EXL3Tensor], list(run))
            one = len(linears) == 1  # a view of the artifact's tensors; a stack is a copy
            prepared.append(
                WeightStack.single(linears[0], device)
                if one
                else WeightStack.from_tensors([[t] for t in linears], device)
            )
            nbytes += sum(EXL3Tensor.storage_bytes(t.in_features, t.out_features, t.bits, t.codebook) for t in linears)
            widths.append(sum(t.out_features for t in linears))
        return cls(tuple(prepared), tuple(widths), nbytes)


def _block_kind(block: EXL3Tensor | torch.Tensor) -> tuple[object, ...] | None:
    """None for a dense block; for an EXL3 linear what one stack's linears share."""
    if isinstance(block, torch.Tensor):
        return None
    return (tuple(block.trellis.shape), block.codebook, block.in_features, block.out_features)


Proj = torch.Tensor | Exl3Proj


def project(x: torch.Tensor, w: Proj) -> torch.Tensor:
    """x [..., in] @ wᵀ -> [..., out].

    An `Exl3Proj`'s blocks write their columns of one output (strided `out=`), not outputs of their own
    concatenated afterwards: one launch fewer per projection."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    from glmquant.runtime.kernels.exl3_gemm import exl3_linear

    flat = x.reshape(-1, x.shape[-1])
    out = flat.new_empty((flat.shape[0], sum(w.widths)))
    start = 0
    for block, width in zip(w.blocks, w.widths):
        cols = out[:, start : start + width]
        if isinstance(block, torch.Tensor):
            torch.mm(flat, block.t(), out=cols)
        else:
            exl3_linear(flat, block, out=cols)
        start += width
    return out.view(*x.shape[:-1], start)
