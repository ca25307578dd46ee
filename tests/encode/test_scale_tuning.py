"""Scale tuning (`encode --tune-scales`): a unit's experts' stored scales fitted together on their share of the
sampled tokens' MoE output, codes fixed."""

from __future__ import annotations

import pytest
import torch

from glmquant.arch.table import PROJECTIONS
from glmquant.encode.scale_tuning import MIN_TOKENS, ExpertPart, UnitTuning, expert_output, tune_unit_scales
from glmquant.exl3 import decode_weight, encode_linears
from glmquant.observe.tuning_sample import RoutedSample

H, I = 128, 256  # noqa: E741  # hidden and intermediate width of the test experts
CPU = torch.device("cpu")
Weights = dict[str, torch.Tensor]


def _expert(seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_proj": torch.randn(I, H, generator=g) / H**0.5,
        "up_proj": torch.randn(I, H, generator=g) / H**0.5,
        "down_proj": torch.randn(H, I, generator=g) / I**0.5,
    }


def _sample(tokens: int, experts: int, seed: int = 0) -> RoutedSample:
    """Correlated inputs (a few strong directions, as real activations have), each routed to two of `experts`
    source experts with sigmoid-like weights."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(H, H, generator=g) * torch.logspace(0, -2, H)[None, :]
    x = torch.randn(tokens, H, generator=g) @ mix.T
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return RoutedSample(x, ids, torch.rand(tokens, 2, generator=g) * 0.5 + 0.05)


def _encoded(weights: Weights) -> list[ExpertPart]:
    """The expert at K2 without Hessians (tuning's usual case: Hessians that do not describe its routed tokens)."""
    return [
        ExpertPart(p, None, e.tensor)
        for p, e in zip(PROJECTIONS, encode_linears([(weights[p], None) for p in PROJECTIONS], 2))
    ]


def _unit_error(parts: dict[int, list[ExpertPart]], weights: dict[int, Weights], sample: RoutedSample) -> float:
    """|Σ_k g_k (f̂_k - f_k)|² / |Σ_k g_k f_k|² over the tokens, k over each token's experts in `parts`."""
    got = torch.zeros_like(sample.inputs)
    ref = torch.zeros_like(sample.inputs)
    for e, ps in parts.items():
        token, slot = (sample.expert_ids == e).nonzero(as_tuple=True)
        g = sample.expert_weights[token, slot][:, None]
        decoded = {p.proj: decode_weight(p.tensor, torch.float32) for p in ps}
        got.index_add_(0, token, g * expert_output(decoded, sample.inputs[token], None))
        ref.index_add_(0, token, g * expert_output(weights[e], sample.inputs[token], None))
    return float((got - ref).square().sum() / ref.square().sum())


@pytest.fixture(scope="module")
def unit() -> tuple[dict[int, Weights], dict[int, list[ExpertPart]]]:
    """Source experts 3 and 5 of a layer of 6 (a unit of two), BF16 weights and K2 encodes."""
    weights = {3: _expert(3), 5: _expert(5)}
    return weights, {e: _encoded(w) for e, w in weights.items()}


def test_tuned_scales_lower_the_units_output_error_on_unseen_tokens(unit) -> None:
    """Tuned on 1,024 sampled tokens, the stored (float16) scales give the unit's experts a lower share-of-output
    error on 1,024 other tokens than the encoder's own; the trellis codes are the encoder's, untouched; tokens and
    slots of experts outside the unit do not count."""
    weights, parts = unit
    sample = _sample(2048, 6)
    seen = RoutedSample(*(t[:1024] for t in (sample.inputs, sample.expert_ids, sample.expert_weights))).routed_to(
        [3, 5]
    )
    unseen = RoutedSample(*(t[1024:] for t in (sample.inputs, sample.expert_ids, sample.expert_weights)))
    assert 0 < seen.inputs.shape[0] < 1024 and (seen.expert_ids == -1).any()
    outcome = tune_unit_scales(parts, UnitTuning(60, None, weights, seen), CPU)
    assert set(outcome.tensors) == {3, 5} and outcome.heldout_after < outcome.heldout_before
    tuned = {e: [ExpertPart(p.proj, None, t) for p, t in zip(parts[e], outcome.tensors[e])] for e in parts}
    before, after = _unit_error(parts, weights, unseen), _unit_error(tuned, weights, unseen)
    assert after < 0.99 * before, (before, after)
    for e in parts:
        for p, t in zip(parts[e], outcome.tensors[e]):
            assert torch.equal(t.trellis, p.tensor.trellis) and t.suh.dtype == torch.float16
            assert not torch.equal(t.suh, p.tensor.suh)


def test_the_kept_step_is_never_worse_on_the_held_out_tokens(unit) -> None:
    """Whatever the tuning keeps is no worse on its held-out quarter than the encoder's own scales (the step-0
    score), and measured there from the stored float16 scales it agrees."""
    weights, parts = unit
    sample = _sample(256, 2, seed=2)
    sample = RoutedSample(sample.inputs, torch.tensor([[3, 5]]).expand(256, 2), sample.expert_weights)
    outcome = tune_unit_scales(parts, UnitTuning(20, None, weights, sample), CPU)
    assert outcome.heldout_after <= outcome.heldout_before
    curve = outcome.heldout_by_step  # every step's score, the encoded scales' first; the kept one the lowest
    assert len(curve) == 21 and curve[0] == outcome.heldout_before
    assert curve[outcome.best_step] == outcome.heldout_after == min(curve)
    held = torch.arange(256) % 4 == 3
    quarter = RoutedSample(sample.inputs[held], sample.expert_ids[held], sample.expert_weights[held])
    assert _unit_error(parts, weights, quarter) == pytest.approx(outcome.heldout_before, rel=1e-4)
    if outcome.tensors:
        tuned = {e: [ExpertPart(p.proj, None, t) for p, t in zip(parts[e], outcome.tensors[e])] for e in parts}
        assert _unit_error(tuned, weights, quarter) <= outcome.heldout_before * 1.001  # float16 rounding


def test_tuning_is_deterministic_and_an_expert_with_too_few_tokens_keeps_its_scales(unit) -> None:
    weights, parts = unit
    sample = _sample(200, 2, seed=1)
    ids = torch.where(sample.expert_ids == 0, 3, 5)
    ids[MIN_TOKENS - 1 :, :] = 5  # expert 3 keeps MIN_TOKENS - 1 of its slots at most
    ids[MIN_TOKENS - 1 :, 1] = -1
    sample = RoutedSample(sample.inputs, ids, sample.expert_weights)
    assert 0 < int((ids == 3).sum()) < MIN_TOKENS
    a = tune_unit_scales(parts, UnitTuning(10, None, weights, sample), CPU)
    b = tune_unit_scales(parts, UnitTuning(10, None, weights, sample), CPU)
    assert set(a.tensors) == {5} and set(b.tensors) == {5}
    assert all(torch.equal(s.suh, t.suh) and torch.equal(s.svh, t.svh) for s, t in zip(a.tensors[5], b.tensors[5]))
    few = RoutedSample(sample.inputs[: MIN_TOKENS - 1], ids[: MIN_TOKENS - 1], sample.expert_weights[: MIN_TOKENS - 1])
    assert tune_unit_scales(parts, UnitTuning(10, None, weights, few), CPU).tensors == {}
    assert tune_unit_scales(parts, UnitTuning(0, None, weights, sample), CPU).tensors == {}


def test_experts_of_one_unit_share_a_layout(unit) -> None:
    weights, parts = unit
    with pytest.raises(ValueError, match="differ in layout"):
        tune_unit_scales({3: parts[3], 5: parts[5][:2]}, UnitTuning(2, None, weights, _sample(64, 6)), CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tuning_on_cuda_repeats_its_bytes_and_lowers_the_error(unit) -> None:
    """On the encode device: two runs store the same scales (the fixed-order sum has no atomics), and the unit's
    held-out error falls as on the CPU."""
    weights, parts = unit
    sample = _sample(1024, 6, seed=3).routed_to([3, 5])
    cuda = torch.device("cuda")
    a = tune_unit_scales(parts, UnitTuning(30, None, weights, sample), cuda)
    b = tune_unit_scales(parts, UnitTuning(30, None, weights, sample), cuda)
    assert set(a.tensors) == {3, 5} and a.heldout_after < a.heldout_before
    for e in a.tensors:
        for s, t in zip(a.tensors[e], b.tensors[e]):
            assert s.suh.device.type == "cpu" and torch.equal(s.suh, t.suh) and torch.equal(s.svh, t.svh)


def test_scaled_parts_compute_the_expert_of_their_assembled_weights() -> None:
    """Tuning scales activations, part by part; with rank slices (rows of gate/up, columns of down, listed out of
    order) that equals the expert whose HF weights are the parts' diag(suh) B diag(svh), put back in rank order."""
    from glmquant.encode.scale_tuning import _scaled_expert_output

    g = torch.Generator().manual_seed(4)
    experts, ranks, width = 3, 2, I // 2
    layout: list[tuple[str, int | None, int, int]] = []
    cores: list[torch.Tensor] = []
    suh: list[torch.Tensor] = []
    svh: list[torch.Tensor] = []
    full: dict[str, list[torch.Tensor]] = {p: [] for p in PROJECTIONS}
    for rank in reversed(range(ranks)):
        for proj in PROJECTIONS:
            n_in, n_out = (width, H) if proj == "down_proj" else (H, width)
            core = torch.randn(experts, n_in, n_out, generator=g) / n_in**0.5
            su, sv = 1 + 0.2 * torch.rand(experts, n_in, generator=g), 1 + 0.2 * torch.rand(experts, n_out, generator=g)
            layout.append((proj, rank, n_in, n_out))
            cores.append(core)
            suh.append(su)
            svh.append(sv)
            full[proj].insert(0, (su[..., :, None] * core * sv[..., None, :]).mT)  # HF [E, out, in], rank order
    weights = {p: torch.cat(full[p], dim=-1 if p == "down_proj" else -2) for p in PROJECTIONS}
    x = torch.randn(experts, 5, H, generator=g)
    got = _scaled_expert_output(layout, cores, suh, svh, x, 10.0)
    assert torch.allclose(got, expert_output(weights, x, 10.0), rtol=1e-4, atol=1e-5)
