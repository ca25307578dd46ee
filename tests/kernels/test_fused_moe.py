"""The fused MoE step against a float64 reference: routing, shared decodes, clamped SwiGLU, tr3 rank stacking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import exact_weight, kernel_device, random_exl3, rel_err

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from glmquant.runtime.kernels.exl3_gemv import GEMV_ERROR_BOUND, takes_fp16_pairs
from glmquant.runtime.kernels.exl3_gemv_kbit import ONE_ROW_KBIT
from glmquant.runtime.kernels.exl3_jobs import GemmConfig, WeightStack, one_row_gemv
from glmquant.runtime.kernels.fused_moe import MoEConfig, MoEWeights, choose_moe_config, fused_moe, plan_routes
from glmquant.runtime.quantized_experts import expand_routes

BOUND = 1e-4  # tensor-core jobs (16 rows); GEMV jobs (1, 2 rows at K2, K4) take fp16 activations: GEMV_ERROR_BOUND


def _experts(gen, n, hidden, inter, bits=2, codebook="mcg"):
    def make(i, o):
        return [random_exl3(gen, i, o, bits, codebook, scale=0.08) for _ in range(n)]

    return make(hidden, inter), make(hidden, inter), make(inter, hidden)


def _reference(x, ids, weights, gates, ups, downs, limit):
    """sum_j w * down(silu(min(g, L)) * clamp(u, -L, L)) in float64 with exact weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, v in enumerate(ids[t].tolist()):
            g = x[t].double() @ exact_weight(gates[v]).T
            u = x[t].double() @ exact_weight(ups[v]).T
            out[t] += weights[t, j] * (F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ exact_weight(downs[v]).T
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("job_rows", "bits"), [(1, 2), (2, 2), (16, 2), (1, 3), (64, 2), (1, 4), (2, 4)]
)  # GEMV one-row and two-row jobs (K2, K4), tensor-core jobs (16- and 64-row tiles), the one-row core at K3
def test_moe_step_matches_reference(job_rows, bits):
    device = kernel_device()
    gen = torch.Generator().manual_seed(0)
    # hidden 136 and intermediate 112 both pad (to 256 and 128): gate_up has 2 K splits, down 2 column blocks of tj=8
    # and padded K rows; 112 rather than 160 (2 column blocks in gate_up too) runs the interpreted GEMV cases in half
    # the time. rel_err measured at 112 (at 160): GEMV K2 4.97e-4 (3.88e-4), tensor-core and K3 jobs 6.5e-7 to
    # 7.8e-7 (7.3e-7 to 7.5e-7)
    gates, ups, downs = _experts(gen, 5, 136, 112, bits=bits)
    w = MoEWeights(WeightStack.from_tensors([gates, ups], device), WeightStack.from_tensors([downs], device), 1.5)
    x = torch.randn(4, 136, generator=gen)
    ids = torch.tensor([[0, 3], [3, 1], [4, 3], [1, 0]])  # expert 3 shared by three tokens
    weights = torch.rand(4, 2, generator=gen) * 2.5
    want = _reference(x, ids, weights, gates, ups, downs, 1.5)
    cfg = MoEConfig(job_rows, GemmConfig(ti=2, tj=8, split_tiles=8), GemmConfig(ti=4, tj=8))  # 2 and 1 K splits
    got = fused_moe(x.to(device), ids.to(device), weights.to(device), w, cfg)
    assert want.abs().max() > 0.1
    assert rel_err(got, want) < (GEMV_ERROR_BOUND if takes_fp16_pairs(job_rows) else BOUND)


@pytest.mark.slow
def test_rank_stacked_slices_sum_to_the_whole_expert():
    """tr3: 4 rank slices as virtual experts (same router weight) = the un-sliced expert, limit None."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(1)
    gates, ups, downs = _experts(gen, 4, 128, 128)  # slices of one expert: inter 4 x 128
    w = MoEWeights(WeightStack.from_tensors([gates, ups], device), WeightStack.from_tensors([downs], device), None)
    x = torch.randn(2, 128, generator=gen)
    ids, weights = expand_routes(torch.tensor([[0], [0]]), torch.tensor([[0.7], [1.9]]), ranks=4)
    g, u = (torch.cat([exact_weight(t) for t in ws]) for ws in (gates, ups))
    d = torch.cat([exact_weight(t) for t in downs], dim=1)
    want = torch.tensor([[0.7], [1.9]], dtype=torch.float64) * ((F.silu(x.double() @ g.T) * (x.double() @ u.T)) @ d.T)
    got = fused_moe(x.to(device), ids.to(device), weights.to(device), w)  # 2 routes per expert: two-row GEMV jobs
    assert rel_err(got, want) < GEMV_ERROR_BOUND


def test_plan_groups_rows_by_expert_in_jobs_of_at_most_16():
    ids = torch.tensor([[2, 0]] * 20 + [[1, 2]])  # expert 2: 21 rows -> jobs of 16 + 5
    plan = plan_routes(ids, 16)
    starts, rows = plan.jobs.starts, plan.jobs.counts
    jobs = {(int(s), int(r)) for s, r in zip(starts, rows, strict=True) if r > 0}
    e = plan.experts.tolist()
    assert sorted(e) == e and sum(r for _, r in jobs) == ids.numel()
    assert all(r <= 16 and len(set(e[s : s + r])) == 1 for s, r in jobs)
    assert sorted(r for s, r in jobs if e[s] == 2) == [5, 16]
    assert torch.equal(plan.experts[plan.pos.long()].view(21, 2), ids.int())  # pos maps routes to rows
    assert torch.equal(plan.tokens[plan.pos.long()].view(21, 2), torch.arange(21).int()[:, None].expand(21, 2))


def test_one_row_plan_keeps_router_ids_and_reuses_its_index_tensors():
    ids = torch.tensor([[5, 1, 3], [0, 5, 2]])  # int64, as a router returns them
    plan = plan_routes(ids, 1)
    assert plan.jobs is None and plan.experts.data_ptr() == ids.data_ptr()
    assert plan.tokens.tolist() == [0, 0, 0, 1, 1, 1] and plan.pos.tolist() == list(range(6))
    again = plan_routes(ids + 1, 1)
    assert again.tokens is plan.tokens and again.pos is plan.pos  # nothing rebuilt for the same shape
    strided = torch.arange(12).view(2, 6)[:, ::2]  # flattens to a strided view: the kernels need it contiguous
    assert plan_routes(strided, 1).experts.tolist() == [0, 2, 4, 6, 8, 10]
    assert plan_routes(strided, 1).experts.is_contiguous()


def _empty_layer(experts: int, bits: int) -> MoEWeights:
    """Zero EXL3 stacks of 128 x 128 experts: enough for choosing launch shapes."""

    def stack(p: int) -> WeightStack:
        return WeightStack(
            torch.zeros(p, experts, 8, 8, 16 * bits, dtype=torch.int16),
            torch.ones(p, experts, 128, dtype=torch.float16),
            torch.ones(p, experts, 128, dtype=torch.float16),
            1,
            128,
            128,
        )

    return MoEWeights(stack(2), stack(1), None)


def test_job_size_follows_routes_per_expert():
    """Decode (288 experts, top-8): one row per route at batch 1-16, GEMV pairs at 64, tensor-core jobs for prefill
    (K2 and K4, each at its one-row GEMV steps); without the GEMV core (K3) one-row jobs for one token and
    tensor-core jobs from two."""
    k2, k3, k4 = _empty_layer(288, 2), _empty_layer(288, 3), _empty_layer(288, 4)
    for k in (k2, k4):
        assert [choose_moe_config(t, t * 8, k).job_rows for t in (1, 16, 64, 512, 4096)] == [1, 1, 2, 16, 64]
    assert choose_moe_config(1, 8, k4).gate_up == choose_moe_config(1, 8, k4).down == one_row_gemv(4)
    assert choose_moe_config(4096, 4096 * 8, k3).job_rows == 64  # a prefill chunk: one decode for four tiles
    assert [choose_moe_config(t, t * 8, k2).down.ti for t in (1, 16, 64)] == [8, 8, 4]  # one-row jobs: 8 x 4-tile steps
    assert [choose_moe_config(t, t * 8, k3).job_rows for t in (1, 2, 64)] == [1, 16, 16]
    assert choose_moe_config(1, 8, k3).down == ONE_ROW_KBIT  # one token: the one-row core's steps


@pytest.mark.slow
@pytest.mark.parametrize("job_rows", [1, 16])
def test_tiered_layer_runs_each_expert_at_its_k(job_rows):
    """Per-expert K (tiers): one stack per K, each route computed by its expert's stack, summed = the reference."""
    from functools import partial

    from glmquant.runtime.kernels.backend import TierGroup, tiered_step

    device = kernel_device()
    gen = torch.Generator().manual_seed(2)
    widths = [3, 2, 1, 4, 3]
    made = [_experts(gen, 1, 128, 128, bits=k) for k in widths]
    gates, ups, downs = ([m[i][0] for m in made] for i in range(3))
    groups = []
    for k in sorted(set(widths)):
        members = [v for v, w in enumerate(widths) if w == k]
        local = torch.full((len(widths),), -1, dtype=torch.int64)
        local[members] = torch.arange(len(members))
        gate, up, down = ([ts[v] for v in members] for ts in (gates, ups, downs))
        w = MoEWeights(
            WeightStack.from_tensors([gate, up], device),
            WeightStack.from_tensors([down], device),
            1.5,
        )
        groups.append(TierGroup(w, local.to(device)))
    x = torch.randn(3, 128, generator=gen)
    ids = torch.tensor([[0, 2], [1, 4], [2, 3]])
    weights = torch.rand(3, 2, generator=gen) * 2.5
    cfg = MoEConfig(job_rows)
    step = tiered_step(groups, lambda w: partial(fused_moe, w=w, cfg=cfg))
    got = step(x.to(device), ids.to(device), weights.to(device))
    want = _reference(x, ids, weights, gates, ups, downs, 1.5)
    assert rel_err(got, want) < (GEMV_ERROR_BOUND if job_rows == 1 else BOUND)  # one-row K2, K4 jobs: the GEMV core
