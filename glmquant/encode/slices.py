"""Cut a routed expert's weight and input Hessian into the pieces the layout encodes (rank slices or whole)."""

from __future__ import annotations

import torch

from glmquant.checkpoint.layouts import ExpertSlice


def slice_weight(weight: torch.Tensor, s: ExpertSlice) -> torch.Tensor:
    """HF-orientation (out, in) weight of one slice: gate/up keep output rows, down keeps input columns."""
    if s.rank is None:
        return weight
    if s.proj == "down_proj":
        return weight[:, s.rank * s.in_features : (s.rank + 1) * s.in_features]
    return weight[s.rank * s.out_features : (s.rank + 1) * s.out_features]


def slice_hessian(hessian: torch.Tensor | None, s: ExpertSlice) -> torch.Tensor | None:
    """The slice's input Hessian: gate/up slices see the whole hidden state; a down slice sees its block."""
    if hessian is None or s.rank is None or s.proj != "down_proj":
        return hessian
    lo, hi = s.rank * s.in_features, (s.rank + 1) * s.in_features
    return hessian[lo:hi, lo:hi]
