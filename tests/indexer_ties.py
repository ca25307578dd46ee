"""transformers' DSA indexer with the runtime's tie rule, for tests that compare the two forwards token for token.

The indexer scores pools with sums of ReLU'd products, so on the random test models pools tie at exactly 0.
`torch.topk` returns tied entries in an unspecified order; the runtime takes the earlier pool on every device
(`glm5_next_math.top_indices`). Within `indexer_ties_to_earlier_pool()`, every 3-D floating-point `topk` over the
last dim (the indexer's [B, S, pools] selection; the routers' group scores, whose tied values are the same either
way) orders ties the runtime's way, so a comparison measures the forwards and not the tie order."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from glmquant.arch.glm5_next_math import top_indices


@contextmanager
def indexer_ties_to_earlier_pool() -> Iterator[None]:
    topk = torch.Tensor.topk

    def earlier_first(scores: torch.Tensor, k: int, dim: int = -1, *args: Any, **kwargs: Any) -> Any:
        if scores.dim() == 3 and scores.is_floating_point() and dim in (-1, 2) and not args and not kwargs:
            indices = top_indices(scores, k)
            return torch.return_types.topk((scores.gather(-1, indices), indices))
        return topk(scores, k, dim, *args, **kwargs)

    torch.Tensor.topk = earlier_first  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.topk = topk  # type: ignore[method-assign]
