"""The DSA indexer's token selection (`arch.glm5_next_math.select_tokens`): every pool kept without a ranking while
the context holds at most index_topk tokens, the top pools by score past it."""

from __future__ import annotations

import pytest
import torch

from glmquant.arch.glm5_next_math import INVALID, select_tokens

KPOOL, TOPK = 4, 16  # four pools kept


def _kept(tokens: torch.Tensor) -> list[int]:
    return sorted(int(t) for t in tokens.flatten() if t != INVALID)


# pools: the engine's window while the context holds at most TOPK tokens (`Engine.pools_for`), or a cache of
# fewer tokens than TOPK (its max_len); pools past the query's position are invalid
@pytest.mark.parametrize(("position", "pools"), [(0, 4), (2, 4), (3, 4), (9, 4), (15, 4), (9, 3), (11, 3)])
def test_a_short_context_keeps_every_token_up_to_the_query_without_scores(position: int, pools: int) -> None:
    tokens = select_tokens(None, torch.tensor([[position]]), pools, KPOOL, TOPK, with_tail=True)
    assert _kept(tokens) == list(range(position + 1))  # complete pools, then the query's tail
    no_tail = select_tokens(None, torch.tensor([[position]]), pools, KPOOL, TOPK, with_tail=False)
    assert _kept(no_tail) == list(range((position + 1) // KPOOL * KPOOL))  # complete pools only


def test_a_long_context_keeps_the_top_pools_by_score_and_the_tail() -> None:
    position, pools = 25, 7  # pools 0-5 complete, tokens 24-25 the tail
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.7, 0.2, 5.0]]])  # pool 6 is incomplete: never ranked in
    tokens = select_tokens(scores, torch.tensor([[position]]), pools, KPOOL, TOPK, with_tail=True)
    chosen = [1, 3, 4, 2]  # the four best complete pools
    assert _kept(tokens) == sorted([p * KPOOL + i for p in chosen for i in range(KPOOL)] + [24, 25])
    with pytest.raises(ValueError, match="need their scores"):
        select_tokens(None, torch.tensor([[position]]), pools, KPOOL, TOPK, with_tail=True)
