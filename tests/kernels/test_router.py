"""The router's scores from weights in their stored dtype (`kernels/router.py`) equal fp32 arithmetic on the upcast
weights, and routing through them picks the PyTorch math's experts with its weights."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import torch
from kernel_helpers import kernel_device

from glmquant.arch import glm5_next_math as math
from glmquant.runtime.kernels import router

EXPERTS, HIDDEN = 36, 1100  # a partial last program of experts and block of hidden columns


@pytest.mark.parametrize("tokens", [1, 5, router.KERNEL_MAX_TOKENS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_scores_equal_fp32_arithmetic_on_the_upcast_weights(tokens: int, dtype: torch.dtype) -> None:
    device = kernel_device()
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype).to(device)
    weight = (torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5).to(dtype).to(device)
    scores = router.router_scores(hidden, weight)
    expected = torch.nn.functional.linear(hidden.float(), weight.float()).sigmoid()
    assert scores.dtype == torch.float32 and scores.shape == (tokens, EXPERTS)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-6)
    if tokens == router.KERNEL_MAX_TOKENS:  # one token more takes the matrix product: the same scores
        more = torch.cat([hidden, hidden[:1]])
        torch.testing.assert_close(router.router_scores(more, weight)[:tokens], scores, rtol=1e-6, atol=1e-6)


def test_route_through_the_kernel_picks_the_maths_experts() -> None:
    device = kernel_device()
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    weight = (torch.randn(EXPERTS, HIDDEN, generator=gen) / HIDDEN**0.5).to(torch.bfloat16).to(device)
    bias = (torch.randn(EXPERTS, generator=gen) * 0.1).to(device)
    args = (hidden, weight, bias, 4, 2.5, True)
    ids, weights = router.route(*args, select=math.select_experts)
    expected_ids, expected_weights = math.route(*args)
    order, expected_order = ids.sort(-1), expected_ids.sort(-1)  # topk(sorted=False) leaves the order open
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), expected_weights.gather(1, expected_order.indices), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(weights.sum(-1), torch.full((3,), 2.5, device=device), rtol=1e-6, atol=1e-6)
