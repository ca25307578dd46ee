"""routing.route is GLM's router: bit-identical to transformers' TopkRouter, and right on a hand example."""

from __future__ import annotations

import math

import pytest
import torch

from glmquant.errors import NumericalError
from glmquant.observe.capture import check_same_routing
from glmquant.observe.routing import RoutingParams, route


def _router(n_experts: int, top_k: int, n_group: int, topk_group: int):
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

    cfg = Glm5NextTextConfig(
        hidden_size=64,
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        num_hidden_layers=1,
    )
    router = Glm5NextTextTopkRouter(cfg)
    gen = torch.Generator().manual_seed(n_experts + n_group)
    router.weight.data = torch.randn(n_experts, 64, generator=gen)
    router.e_score_correction_bias.data = torch.randn(n_experts, generator=gen) * 0.1
    return router


@pytest.mark.parametrize("n_experts,top_k,n_group,topk_group", [(16, 4, 1, 1), (16, 3, 4, 2), (288, 8, 1, 1)])
def test_route_is_the_models_router(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    router = _router(n_experts, top_k, n_group, topk_group)
    hidden = torch.randn(200, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with torch.no_grad():
        logits, weights, indices = router(hidden)
    got = route(logits, router.e_score_correction_bias, RoutingParams(n_experts, top_k, n_group, topk_group, True, 2.5))
    assert torch.equal(got.indices, indices) and torch.equal(got.weights, weights)
    torch.testing.assert_close(got.dense_weights().sum(dim=-1), torch.full((200,), 2.5))


def test_bias_selects_but_does_not_weight() -> None:
    """Scores 0.9, 0.8, 0.7, 0.6; a +0.5 bias on expert 3 puts it in the top 2 but its weight stays 0.6."""
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6]])
    logits = torch.log(scores / (1 - scores))
    got = route(logits, torch.tensor([0.0, 0.0, 0.0, 0.5]), RoutingParams(4, 2, routed_scaling_factor=2.5))
    chosen = sorted(zip(got.indices[0].tolist(), got.weights[0].tolist()))
    assert [e for e, _ in chosen] == [0, 3]
    assert [w for _, w in chosen] == pytest.approx([2.5 * 0.9 / 1.5, 2.5 * 0.6 / 1.5], rel=1e-6)
    unnormalized = route(logits, torch.zeros(4), RoutingParams(4, 2, norm_topk_prob=False))
    assert sorted(unnormalized.weights[0].tolist()) == pytest.approx([0.8, 0.9], rel=1e-6)
    assert math.isclose(got.scores[0, 3].item(), 0.6, rel_tol=1e-6)


def test_disagreement_with_the_model_is_an_error() -> None:
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    routing = route(logits, torch.zeros(6), RoutingParams(6, 2))
    check_same_routing(routing, routing.indices.flip(-1), routing.weights.flip(-1), 3)  # order does not matter
    with pytest.raises(NumericalError, match="layer 3"):
        check_same_routing(routing, routing.indices, routing.weights * 1.01, 3)
