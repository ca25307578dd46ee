"""Scale tuning (`encode --tune-scales`): an expert's stored scales fitted on its routed tokens, codes fixed."""

from __future__ import annotations

import pytest
import torch

from glmquant.arch.table import PROJECTIONS
from glmquant.encode.scale_tuning import (
    MIN_TOKENS,
    ExpertPart,
    ExpertTokens,
    expert_output,
    tune_expert_scales,
    tune_experts_scales,
)
from glmquant.exl3 import decode_weight, encode_linears

H, I = 128, 256  # noqa: E741  # hidden and intermediate width of the test expert


def _expert_case(tokens: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A random expert, correlated inputs (a few strong directions, as real activations have) and routing weights."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        "gate_proj": torch.randn(I, H, generator=g) / H**0.5,
        "up_proj": torch.randn(I, H, generator=g) / H**0.5,
        "down_proj": torch.randn(H, I, generator=g) / I**0.5,
    }
    mix = torch.randn(H, H, generator=g) * torch.logspace(0, -2, H)[None, :]
    x = torch.randn(tokens, H, generator=g) @ mix.T
    gates = torch.rand(tokens, generator=g) * 0.5 + 0.05
    return weights, x, gates


def _encoded(weights: dict[str, torch.Tensor], x: torch.Tensor | None) -> list[ExpertPart]:
    """The expert at K2 with the Hessians of inputs `x` (None: uncalibrated), the encoder's own refit included."""
    items: list[tuple[torch.Tensor, torch.Tensor | None]] = [(weights[p], None) for p in PROJECTIONS]
    if x is not None:
        h_in = x.T @ x / x.shape[0]
        act = torch.nn.functional.silu(x @ weights["gate_proj"].T) * (x @ weights["up_proj"].T)
        items = [(weights["gate_proj"], h_in), (weights["up_proj"], h_in), (weights["down_proj"], act.T @ act / len(x))]
    return [ExpertPart(p, None, e.tensor) for p, e in zip(PROJECTIONS, encode_linears(items, 2))]


def _output_error(parts: list[ExpertPart], weights: dict[str, torch.Tensor], x: torch.Tensor, g: torch.Tensor) -> float:
    decoded = {p.proj: decode_weight(p.tensor, torch.float32) for p in parts}
    ref, got = expert_output(weights, x, None), expert_output(decoded, x, None)
    return float((g[:, None] ** 2 * (got - ref).square()).sum() / (g[:, None] ** 2 * ref.square()).sum())


def test_tuned_scales_lower_the_expert_output_error_on_unseen_tokens() -> None:
    """An expert encoded with Hessians that do not describe its routed tokens (here none; all-token ones are the
    usual case): tuned on 512 of its tokens, the stored (float16) scales give a lower routing-weighted output error on
    512 other tokens than the encoder's own; the trellis codes are the encoder's, untouched."""
    weights, x, gates = _expert_case(1024)
    parts = _encoded(weights, None)
    outcome = tune_expert_scales(parts, ExpertTokens(weights, x[:512], gates[:512]), None, 60, torch.device("cpu"))
    assert outcome.tensors is not None and outcome.heldout_after < outcome.heldout_before
    tuned = [ExpertPart(p.proj, None, t) for p, t in zip(parts, outcome.tensors)]
    before, after = (
        _output_error(parts, weights, x[512:], gates[512:]),
        _output_error(tuned, weights, x[512:], gates[512:]),
    )
    assert after < 0.98 * before, (before, after)
    for p, t in zip(parts, outcome.tensors):
        assert torch.equal(t.trellis, p.tensor.trellis) and t.suh.dtype == torch.float16
        assert not torch.equal(t.suh, p.tensor.suh)


def test_tuning_keeps_scales_no_step_improves() -> None:
    """Encoded with the Hessians of the very tokens it is tuned on, an expert's refit scales are already near the best
    its held-out tokens allow: whatever the tuning keeps is never worse there than the encoder's own."""
    weights, x, gates = _expert_case(512, seed=2)
    parts = _encoded(weights, x)
    outcome = tune_expert_scales(parts, ExpertTokens(weights, x, gates), None, 20, torch.device("cpu"))
    assert outcome.heldout_after <= outcome.heldout_before
    if outcome.tensors is None:
        assert outcome.heldout_after == outcome.heldout_before
    else:
        held = torch.arange(512) % 4 == 3
        tuned = [ExpertPart(p.proj, None, t) for p, t in zip(parts, outcome.tensors)]
        before = _output_error(parts, weights, x[held], gates[held])
        assert _output_error(tuned, weights, x[held], gates[held]) <= before * 1.001  # float16 rounding of the scales


def test_tuning_is_deterministic_and_skips_experts_with_too_few_tokens() -> None:
    weights, x, gates = _expert_case(256, seed=1)
    parts = _encoded(weights, None)
    cpu = torch.device("cpu")
    a = tune_expert_scales(parts, ExpertTokens(weights, x, gates), None, 10, cpu)
    b = tune_expert_scales(parts, ExpertTokens(weights, x, gates), None, 10, cpu)
    assert a.tensors is not None and b.tensors is not None
    assert all(torch.equal(s.suh, t.suh) and torch.equal(s.svh, t.svh) for s, t in zip(a.tensors, b.tensors))
    few = tune_expert_scales(parts, ExpertTokens(weights, x[: MIN_TOKENS - 1], gates[: MIN_TOKENS - 1]), None, 10, cpu)
    assert few.tensors is None


def test_experts_tuned_together_match_each_tuned_alone() -> None:
    """A unit's experts are tuned in one batched computation (padded to the most tokens): each comes out as tuned
    alone, up to the rounding of batched matmuls; an expert with too few tokens in the batch keeps its scales."""
    cpu = torch.device("cpu")
    cases = []
    for seed, n in ((3, 200), (4, 120), (5, MIN_TOKENS - 1)):
        weights, x, gates = _expert_case(n, seed=seed)
        cases.append((_encoded(weights, None), ExpertTokens(weights, x, gates)))
    together = tune_experts_scales(cases, None, 12, cpu)
    assert together[2].tensors is None
    for (parts, tokens), joint in zip(cases[:2], together):
        alone = tune_expert_scales(parts, tokens, None, 12, cpu)
        assert alone.tensors is not None and joint.tensors is not None
        assert abs(joint.heldout_after - alone.heldout_after) <= 1e-4 * alone.heldout_before
        for a, b in zip(alone.tensors, joint.tensors):
            torch.testing.assert_close(a.suh.float(), b.suh.float(), rtol=2e-3, atol=0)
            torch.testing.assert_close(a.svh.float(), b.svh.float(), rtol=2e-3, atol=0)
    with pytest.raises(ValueError, match="differ in layout"):
        tune_experts_scales([cases[0], (cases[1][0][:2], cases[1][1])], None, 2, cpu)
