"""The streamed observation against brute force on transformers' full model (hooks on the same rows).

Tolerances: token counts and router sums are exact up to float64 summation order; norm-based REAP
statistics compare the model's BF16 expert arithmetic with a float64 recomputation, so they agree to
~1e-3 relative (bound 1e-2); Hessians are f32 accumulations of the very inputs the full model saw
(bound 1e-5 of the largest entry), the down-projection inputs recomputed in BF16 as the model does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from observe_helpers import BATCH

from glmquant.calibration import TokenRows
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.observe.hessian_reader import load_dense_hessian, load_layer_hessians
from glmquant.observe.stats import LayerStats, stats_path
from glmquant.observe.summary import ObservationSummary


def _expert_out_f64(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """f_j(x) in float64 from the expert's weights: down(silu(min(gate, 10)) * clamp(up, ±10))."""
    gate, up = (x.double() @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)) @ down.T


def _act_bf16(experts, j: int, x: torch.Tensor) -> torch.Tensor:
    """The down projection's input, computed in BF16 as the model computes it."""
    gate, up = F.linear(x, experts.gate_up_proj[j]).chunk(2, dim=-1)
    return F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    scale = want.abs().max().item() or 1.0
    assert (got.double() - want.double()).abs().max().item() <= rel * scale, (got, want)


def test_reap_statistics_equal_brute_force(observed: Path, reference) -> None:
    assert reference.layers, "the tiny model has MoE layers"
    for layer, cap in reference.layers.items():
        experts = reference.model.model.language_model.layers[layer].mlp.experts
        x, weights, indices = torch.cat(cap.x), torch.cat(cap.weights).double(), torch.cat(cap.indices)
        n_experts, (n_tokens, top_k) = experts.num_experts, indices.shape
        # every expert on every token, then pick the routed (token, expert) pairs one by one
        norms = torch.stack(
            [
                _expert_out_f64(experts.gate_up_proj[j].double(), experts.down_proj[j].double(), x).norm(dim=-1)
                for j in range(n_experts)
            ]
        ).tolist()  # [E][N]
        counts, totals, gates, gate_norms, peaks = ([0.0] * n_experts for _ in range(5))
        for t in range(n_tokens):
            for slot in range(top_k):
                j, g = int(indices[t, slot]), float(weights[t, slot])
                norm = norms[j][t]
                counts[j] += 1
                totals[j] += norm
                gates[j] += g
                gate_norms[j] += g * norm
                peaks[j] = max(peaks[j], norm)
        count, total, gate, gate_norm, peak = (
            torch.tensor(v, dtype=torch.float64) for v in (counts, totals, gates, gate_norms, peaks)
        )
        got = LayerStats.load(stats_path(observed, layer))
        assert got.tokens == n_tokens
        assert torch.equal(got.count, count.long())
        torch.testing.assert_close(got.sums["sum_gate"], gate, rtol=1e-12, atol=1e-12)
        _close(got.sums["sum_norm"], total, 1e-2)
        _close(got.sums["sum_gate_norm"], gate_norm, 1e-2)
        _close(got.max_norm, peak, 1e-2)
        _close(got.reap, gate_norm / count, 1e-2)
        _close(got.ean, total / count, 1e-2)
        torch.testing.assert_close(got.selection_share, count / (n_tokens * top_k))


def test_routed_share_is_the_routed_output_against_the_residual_stream(observed: Path, reference) -> None:
    """The layer's routed-output energy Σ‖y_routed‖² and residual energy Σ‖r + y‖² equal those of the full model's
    own MoE blocks (float64 sums of the same BF16 tensors, in another order), and routed_share is their ratio."""
    for layer, cap in reference.layers.items():
        got = LayerStats.load(stats_path(observed, layer))
        assert got.energies is not None
        routed = sum(float(y.double().square().sum()) for y in cap.routed_out)
        residual = sum(float((r + y).double().square().sum()) for r, y in zip(cap.block_in, cap.block_out))
        assert routed > 0 and residual > 0
        assert float(got.energies["routed_energy"]) == pytest.approx(routed, rel=1e-9)
        assert float(got.energies["residual_energy"]) == pytest.approx(residual, rel=1e-9)
        assert got.routed_share == pytest.approx(routed / residual, rel=1e-9)


def test_routing_weights_are_the_models(observed: Path, reference) -> None:
    """Σg per expert must be the model's normalized, scaled, unbiased weights: top-k weights sum to 2.5."""
    for layer in reference.layers:
        got = LayerStats.load(stats_path(observed, layer))
        torch.testing.assert_close(got.sums["sum_gate"].sum(), torch.tensor(2.5 * got.tokens, dtype=torch.float64))


def test_natural_hessians_equal_direct_sums(observed: Path, reference) -> None:
    for layer, cap in reference.layers.items():
        experts = reference.model.model.language_model.layers[layer].mlp.experts
        x, indices = torch.cat(cap.x), torch.cat(cap.indices)
        hessians = load_layer_hessians(observed, layer, "natural")
        for j in range(experts.num_experts):
            xj = x[(indices == j).any(dim=-1)]
            gate_up, down = hessians.gate_up(j), hessians.down(j)
            assert gate_up.count == down.count == xj.shape[0]
            _close(gate_up.sum, xj.double().T @ xj.double(), 1e-5)
            act = _act_bf16(experts, j, xj).double()
            _close(down.sum, act.T @ act, 1e-3)


def test_all_token_hessians_equal_direct_sums(observed: Path, reference) -> None:
    for layer, cap in reference.layers.items():
        experts = reference.model.model.language_model.layers[layer].mlp.experts
        x = torch.cat(cap.x)
        hessians = load_layer_hessians(observed, layer, "all")
        shared = hessians.gate_up(0)
        assert shared.count == x.shape[0] and torch.equal(shared.sum, hessians.gate_up(3).sum)
        _close(shared.sum, x.double().T @ x.double(), 1e-5)
        for j in range(experts.num_experts):
            act = _act_bf16(experts, j, x).double()
            assert hessians.down(j).count == x.shape[0]
            _close(hessians.down(j).sum, act.T @ act, 1e-3)


def test_dense_hessians(observed: Path, reference) -> None:
    q_in = torch.cat(reference.layers[1].q_proj_in).double()
    prefix = "model.language_model.layers.1."
    q = load_dense_hessian(observed, 1, prefix + "self_attn.q_proj.weight")
    assert q.count == q_in.shape[0]
    _close(q.sum, q_in.T @ q_in, 1e-5)
    shared = load_dense_hessian(observed, 1, prefix + "mlp.shared_experts.gate_proj.weight")
    assert torch.equal(shared.sum, load_layer_hessians(observed, 1, "all").gate_up(0).sum)
    dense_mlp = load_dense_hessian(observed, 0, "model.language_model.layers.0.mlp.down_proj.weight")
    assert dense_mlp.sum.shape == (256, 256) and dense_mlp.count == q.count


def test_mtp_hessians_equal_direct_sums(tiny_source: Path, observed: Path, reference) -> None:
    """The MTP layer's Hessians (`--dense-hessians`): eh_proj's input at position i is [enorm(embed(t_{i+1}));
    hnorm(h_i)], h_i the full model's last hidden state, over every token of each row but its last; the routed
    experts' counts are those tokens' routes."""
    summary = ObservationSummary.load(observed)
    assert summary.mtp is not None and summary.mtp.hessians_file == "layer-03.hessians.safetensors"
    assert summary.fingerprint["mtp_hessians"] is True
    prefix = "model.language_model."
    with SourceCheckpoint.open(tiny_source) as ckpt:
        embed, enorm, hnorm = (
            ckpt.read_tensor(prefix + name)
            for name in ("embed_tokens.weight", "layers.3.enorm.weight", "layers.3.hnorm.weight")
        )
    config = reference.model.config.get_text_config()

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # transformers' Glm5NextTextRMSNorm
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        return weight * y.to(x.dtype)

    ids = TokenRows.load(observed).lanes[0].ids.long()
    inputs = []
    with torch.no_grad():
        for batch in ids.split(BATCH):
            h = reference.model.model(input_ids=batch).last_hidden_state
            x = torch.cat([rms_norm(F.embedding(batch[:, 1:], embed), enorm), rms_norm(h[:, :-1], hnorm)], dim=-1)
            inputs.append(x.reshape(-1, x.shape[-1]))
    x = torch.cat(inputs).double()
    eh_proj = load_dense_hessian(observed, 3, prefix + "layers.3.eh_proj.weight")
    assert eh_proj.count == ids.shape[0] * (ids.shape[1] - 1)
    _close(eh_proj.sum, x.T @ x, 1e-3)
    natural, everything = load_layer_hessians(observed, 3, "natural"), load_layer_hessians(observed, 3, "all")
    assert int(natural.gate_up_counts.sum()) == eh_proj.count * config.num_experts_per_tok
    assert int(everything.gate_up_counts[0]) == eh_proj.count
    shared = load_dense_hessian(observed, 3, prefix + "layers.3.mlp.shared_experts.gate_proj.weight")
    assert torch.equal(shared.sum, everything.gate_up(0).sum)  # both the MoE block's input over every token
