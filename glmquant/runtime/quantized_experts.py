"""Drop-in replacement for transformers' `Glm5NextTextExperts` that runs quantized experts through a backend.

transformers' MoE block calls `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])` after its
router; this module keeps that call and hands the routes to an `ExpertBackend`. Rank-sliced (tr3)
artifacts run *rank-stacked*: each logical expert e is R virtual experts `e * R + r` of width
moe_intermediate / R, and each route expands to R virtual routes carrying the same router weight. SwiGLU
(with its clamps) is elementwise in the intermediate dim and down_proj is sliced along it, so the sum of
the R slice outputs is exactly the un-sliced expert's output (the TP-R all-reduce), up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from glmquant.runtime.expert_cache import CacheStats

if TYPE_CHECKING:
    from glmquant.runtime.artifact import Artifact
    from glmquant.runtime.options import RuntimeOptions


@runtime_checkable
class ExpertBackend(Protocol):
    """Computes the routed-expert part of every quantized MoE layer of one artifact.

    One object serves all layers, so it can share memory (a decode cache, packed weights) between them.
    Implementations: `TorchExpertBackend` (CPU or any torch device, decodes with `glmquant.exl3`) and the
    GPU Triton backend in `glmquant.runtime.kernels`, each registered by name with `register_backend`
    (the loader imports `glmquant.runtime.kernels` when asked for a name it does not know yet).
    """

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of virtual experts for each token.

        hidden [T, H] in the model dtype; expert_ids [T, n] int64 virtual expert ids (n = top_k * ranks);
        weights [T, n] float32 router weights (already normalized and scaled). Returns [T, H] in hidden's
        dtype: out[t] = sum_j weights[t, j] * down_v(silu(clamp(gate_v x)) * clamp(up_v x)), v = expert_ids[t, j].
        """
        ...

    def stats(self) -> CacheStats:
        """Decode-cache counters (a backend that keeps every expert resident reports hits only)."""
        ...


BackendFactory = Callable[["Artifact", "RuntimeOptions"], ExpertBackend]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make a backend selectable by name (`RuntimeOptions.backend`, `glmquant serve --backend`)."""
    BACKENDS[name] = factory


def expand_routes(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] logical routes -> [T, k * ranks] virtual routes (expert * ranks + rank), weights repeated."""
    if ranks == 1:
        return top_k_index.long(), top_k_weights.float()
    offsets = torch.arange(ranks, device=top_k_index.device)
    ids = (top_k_index.long().unsqueeze(-1) * ranks + offsets).flatten(1)
    weights = top_k_weights.float().unsqueeze(-1).expand(-1, -1, ranks).flatten(1)
    return ids, weights


class QuantizedExperts(nn.Module):
    """The routed experts of one MoE layer, stored quantized and applied by a shared backend."""

    def __init__(self, layer: int, ranks: int, backend: ExpertBackend) -> None:
        super().__init__()
        self.layer = layer
        self.ranks = ranks
        self.backend = backend

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        ids, weights = expand_routes(top_k_index, top_k_weights, self.ranks)
        return self.backend.forward(self.layer, hidden_states, ids, weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, ranks={self.ranks}, backend={type(self.backend).__name__}"
