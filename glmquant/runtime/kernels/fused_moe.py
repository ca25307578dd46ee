"""One MoE step for a batch of tokens on EXL3 experts: gate/up, clamped SwiGLU, down, router-weighted sum.

Five launches, none of which writes a dequantized weight: rotate the inputs of every route for gate and up,
the gate+up core (one launch, P = 2), SwiGLU between the two Hadamards (gate/up output side, down input
side), the down core, and the weighted output rotation. Routes are sorted by (virtual) expert so tokens
that share an expert share its decode (jobs of up to 2 rows in the GEMV core or 16, one tensor-core tile, in the
other; `choose_moe_config` sizes them from the routes per expert); rank-stacked tr3 layers are plain
layers of R x more, R x narrower virtual experts (virtual_id = expert * R + rank) whose routes carry the
same router weight. Every shape is static and nothing syncs with the host, so a step can be graph-captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glmquant.runtime.kernels.exl3_gemm import (
    activation_buffer,
    exl3_rows,
    had128_rows,
    rotate_in,
    rotate_out,
    store_activations,
)
from glmquant.runtime.kernels.exl3_gemv import GEMV_JOB_ROWS, takes_fp16_pairs, uses_gemv
from glmquant.runtime.kernels.exl3_gemv_kbit import ONE_ROW_KBIT
from glmquant.runtime.kernels.exl3_jobs import (
    JOB_ROWS,
    LARGE_JOB_ROWS,
    LARGE_JOBS,
    GemmConfig,
    Jobs,
    WeightStack,
    job_rows,
    one_row_gemv,
)


@dataclass(frozen=True)
class MoEWeights:
    """The routed experts of one MoE layer on the device: gate and up stacked (P = 2), down (P = 1)."""

    gate_up: WeightStack
    down: WeightStack
    swiglu_limit: float | None

    def __post_init__(self) -> None:
        gu, d = self.gate_up, self.down
        if gu.trellis.shape[0] != 2 or d.trellis.shape[0] != 1 or gu.trellis.shape[1] != d.trellis.shape[1]:
            raise ValueError(
                f"gate_up must stack 2 and down 1 projection of the same experts, got "
                f"{tuple(gu.trellis.shape[:2])} and {tuple(d.trellis.shape[:2])}"
            )
        if (gu.out_features, gu.in_features) != (d.in_features, d.out_features):
            raise ValueError(
                f"gate/up {gu.in_features}->{gu.out_features} does not chain with down "
                f"{d.in_features}->{d.out_features}"
            )

    @property
    def experts(self) -> int:
        return self.gate_up.trellis.shape[1]


@dataclass(frozen=True)
class RoutePlan:
    """Routes in job order: row i is flat route order[i]; `pos` maps each flat route back to its row."""

    experts: torch.Tensor  # [R] virtual expert of each row (int32; one-row plans: the router's integer type)
    tokens: torch.Tensor  # int32 [R] token of each row
    pos: torch.Tensor  # int32 [T * n] row of each flat route
    jobs: Jobs | None  # rows sharing an expert; None: one row per job


_FLAT_ROUTE_INDICES: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def flat_route_indices(routes: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, flat position) of each of `routes` routes, n per token, as int32. Constant per shape, so kept
    (unless made inside a graph capture, whose tensors only fill on replay): a decode step then launches nothing
    to plan one-row jobs."""
    key = (routes, n, device)
    if key in _FLAT_ROUTE_INDICES:
        return _FLAT_ROUTE_INDICES[key]
    idx = torch.arange(routes, dtype=torch.int32, device=device)
    made = (idx // n, idx)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _FLAT_ROUTE_INDICES[key] = made
    return made


def plan_routes(expert_ids: torch.Tensor, max_rows: int) -> RoutePlan:
    """Sort routes by expert and cut each expert's run into jobs of <= max_rows rows (static shapes, no host sync).

    max_rows = 1 keeps one row per route, unsorted: cheapest when tokens rarely share an expert (the kernels read
    expert ids of any integer type, so the router's ids are used as they are).
    """
    n = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).contiguous()  # the kernels index ids as contiguous (a copy only for strided ids)
    if max_rows == 1:
        return RoutePlan(flat, *flat_route_indices(flat.numel(), n, flat.device), None)
    idx = torch.arange(flat.numel(), device=flat.device)
    experts, order = torch.sort(flat, stable=True)
    pos = torch.empty_like(order).scatter_(0, order, idx)
    first = torch.ones_like(experts, dtype=torch.bool)
    first[1:] = experts[1:] != experts[:-1]
    run_start = torch.cummax(torch.where(first, idx, 0), 0).values
    offset = idx - run_start
    run_len = torch.zeros_like(idx).scatter_add_(0, run_start, torch.ones_like(idx))[run_start]
    rows = torch.where(offset % max_rows == 0, (run_len - offset).clamp(max=max_rows), 0)
    return RoutePlan(experts.int(), (order // n).int(), pos.int(), Jobs(idx.int(), rows.int(), max_rows))


@triton.jit
def _swiglu_kernel(
    part_ptr,
    R,
    expert_ptr,
    svh_ptr,
    suh_d_ptr,
    out_ptr,
    V,
    Ip,
    n_inter,
    limit,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """out[i, blk] = had(silu(min(g, L)) * clamp(u, -L, L) ∘ suh_down) in the down core's format.

    g and u are had(partials) ∘ svh of the gate and up projections.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)[None, :]
    live = rows < R
    g = tl.zeros([ROWS, 128], dtype=tl.float32)
    u = tl.zeros([ROWS, 128], dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: the partial loads overlap instead of queueing
        base = part_ptr + ((2 * s) * R + rows.to(tl.int64)) * Ip + cols
        g += tl.load(base, mask=live, other=0.0)
        u += tl.load(base + R * Ip, mask=live, other=0.0)
    expert = tl.load(expert_ptr + rows, mask=live, other=0).to(tl.int64)
    g = had128_rows(g) * tl.load(svh_ptr + expert * Ip + cols, mask=live, other=0.0).to(tl.float32)
    u = had128_rows(u) * tl.load(svh_ptr + (V + expert) * Ip + cols, mask=live, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = tl.where(cols < n_inter, g / (1.0 + tl.exp(-g)) * u, 0.0)
    sd = tl.load(suh_d_ptr + expert * Ip + cols, mask=live, other=0.0).to(tl.float32)
    store_activations(out_ptr, rows.to(tl.int64), cols, Ip, had128_rows(act * sd), live, PAIRS)


def swiglu(part: torch.Tensor, plan: RoutePlan, w: MoEWeights) -> torch.Tensor:
    """Rotated down inputs (`activation_buffer` layout, P = 1) from the gate/up partials [splits, 2, R, inter_pad]."""
    splits, _, R, ip = part.shape
    pairs = takes_fp16_pairs(job_rows(plan.jobs))
    out = activation_buffer(1, R, ip, pairs, part.device)
    limit = float("inf") if w.swiglu_limit is None else float(w.swiglu_limit)
    _swiglu_kernel[(triton.cdiv(R, 16), ip // 128)](
        part,
        R,
        plan.experts,
        w.gate_up.svh,
        w.down.suh,
        out,
        w.experts,
        ip,
        w.gate_up.out_features,
        limit,
        SPLITS=splits,
        ROWS=16,
        PAIRS=pairs,
    )
    return out


LARGE_JOBS_FROM = 32  # routes per expert from which jobs hold 64 rows (most experts then fill a large job)


@dataclass(frozen=True)
class MoEConfig:
    """Launch shapes of one step: the most rows a job may hold and the cores' configs.

    One row per job means one row per route, unsorted.
    """

    job_rows: int
    gate_up: GemmConfig = GemmConfig()
    down: GemmConfig = GemmConfig()


def choose_moe_config(tokens: int, routes: int, w: MoEWeights) -> MoEConfig:
    """Jobs sized to how many routes an expert gets on average. With the GEMV core (K2 or K4, both stacks): one row
    per route under 1/2 and for one token, whose routes never share an expert (at `one_row_gemv`), GEMV jobs of
    two rows (one decode, an FMA per row) under 4, tensor-core jobs of 16 rows beyond (prefill): the measurements
    behind these thresholds (K2) are in docs/kernels.md (the switch at 4 is an estimate). Other K: one token's routes
    take the one-row core (`exl3_gemv_kbit`), two tokens or more 16-row tensor-core jobs. Any K: from
    LARGE_JOBS_FROM routes per expert (a prefill chunk: 4,096 tokens give 114 at 288 experts) 64-row jobs, each
    weight block decoded once for four tiles (an estimate, not measured)."""
    per_expert = routes / w.experts
    if per_expert >= LARGE_JOBS_FROM:
        return MoEConfig(LARGE_JOB_ROWS, LARGE_JOBS, LARGE_JOBS)
    if not (uses_gemv(w.gate_up, GEMV_JOB_ROWS) and uses_gemv(w.down, GEMV_JOB_ROWS)):
        return MoEConfig(1, ONE_ROW_KBIT, ONE_ROW_KBIT) if tokens == 1 else MoEConfig(JOB_ROWS.value)
    if tokens == 1 or per_expert < 0.5:
        return MoEConfig(1, one_row_gemv(w.gate_up.bits), one_row_gemv(w.down.bits))
    return MoEConfig(GEMV_JOB_ROWS if per_expert < 4 else JOB_ROWS.value)


def fused_moe(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    w: MoEWeights,
    cfg: MoEConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_v(silu(clamp(gate_v x_t)) * clamp(up_v x_t)), v = expert_ids[t, j].

    hidden [T, H] any float dtype; expert_ids [T, n] virtual expert ids; weights [T, n] router weights.
    Returns [T, H] in hidden's dtype (or fills `out`).
    """
    T = expert_ids.shape[0]
    cfg = cfg or choose_moe_config(T, expert_ids.numel(), w)
    plan = plan_routes(expert_ids, cfg.job_rows)
    x_gu = rotate_in(hidden, plan.tokens, w.gate_up, plan.experts, takes_fp16_pairs(job_rows(plan.jobs)))
    x_d = swiglu(exl3_rows(x_gu, w.gate_up, plan.experts, plan.jobs, cfg.gate_up), plan, w)
    part = exl3_rows(x_d, w.down, plan.experts, plan.jobs, cfg.down)
    if out is None:
        out = torch.empty((T, w.down.out_features), dtype=hidden.dtype, device=hidden.device)
    return rotate_out(part, plan.pos, weights.float().contiguous(), plan.experts, w.down, out)
