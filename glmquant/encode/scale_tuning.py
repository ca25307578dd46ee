"""Tune the stored EXL3 scales of a unit's routed experts on their calibration tokens, the trellis codes held fixed.

EXL3 decodes a linear as W = diag(suh) · B · diag(svh), B = had(Q) fixed by the codes, so the scales are free at
inference. The per-linear refit (exl3/refit.py) fits them in each linear's own Hessian metric, one linear at a
time; this fits all the scales of a unit's experts together on what the layer computes: the unit's share of the
MoE output, Σ_k g_k f_k(x) over each sampled token's routed experts k in the unit (g the routing weights, f the
clamped-SwiGLU expert), against the BF16 experts'. The experts' errors meet in that sum, so they are fitted to
cancel where they can, which fitting each expert alone cannot (on a trained proxy: 0.71x the seed's KL where each
expert alone gives 0.76x; docs/fidelity.md). With `--experts-per-unit` at the layer's expert count the sum is the
layer's whole routed output. Adam on multiplicative corrections; every fourth token is held out, the step with the
lowest held-out error is kept, and the encoded scales stay when no step beats them. The same inputs give the same
bits on a device type (a fixed step count, sums in a fixed order, no data-dependent branching but the held-out
choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmquant.arch.glm5_next_math import swiglu
from glmquant.arch.table import PROJECTIONS
from glmquant.exl3.decode import decode_inner
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.regularize import balance_scales
from glmquant.exl3.tensor import EXL3Tensor
from glmquant.observe.tuning_sample import RoutedSample

LEARNING_RATE = 5e-3  # Adam step on the relative scale corrections (2e-3 until the twenty-sixth session: 2x the steps)
MIN_TOKENS = 8  # an expert routed fewer sampled tokens keeps its encoded scales (its output still counts)
HELD_OUT_EVERY = 4  # every fourth sampled token measures the steps, the rest fit them


@dataclass(frozen=True)
class ExpertPart:
    """One EXL3 tensor of an expert: a whole projection, or a rank slice of it (rows of gate/up, columns of down)."""

    proj: str  # gate_proj | up_proj | down_proj
    rank: int | None
    tensor: EXL3Tensor


@dataclass(frozen=True)
class UnitTuning:
    """`encode --tune-scales` for one work unit: Adam steps, the model's SwiGLU clamp, each source expert's BF16
    weights by projection (HF (out, in)), and the layer's sampled tokens routed to the unit's experts
    (`RoutedSample.routed_to`)."""

    steps: int
    swiglu_limit: float | None
    weights: dict[int, dict[str, torch.Tensor]]
    sample: RoutedSample
    learning_rate: float = LEARNING_RATE


@dataclass(frozen=True)
class TuningOutcome:
    """The tuned experts' tensors by source expert (an expert left out keeps its encoded ones), the unit's held-out
    error (relative to the BF16 output's energy) before and after, the step kept (0: the encoded scales) and the
    held-out error of every step, step 0 first: what says whether the steps were enough."""

    heldout_before: float
    heldout_after: float
    tensors: dict[int, list[EXL3Tensor]] = field(default_factory=dict)
    best_step: int = 0
    heldout_by_step: tuple[float, ...] = ()


def tune_unit_scales(experts: dict[int, list[ExpertPart]], tuning: UnitTuning, device: torch.device) -> TuningOutcome:
    """The scales of `experts` (source expert -> its EXL3 parts, all in one layout) tuned together on their share of
    the sampled tokens' MoE output, computed on `device`."""
    order = list(experts)
    layout = _layout(experts[order[0]])
    for e in order:
        if _layout(experts[e]) != layout:
            raise ValueError("tune_unit_scales: the experts' EXL3 parts differ in layout")
    sample = tuning.sample
    routed = [(sample.expert_ids == e).nonzero(as_tuple=True) for e in order]  # (token, slot) of each expert
    counts = torch.tensor([len(token) for token, _ in routed])
    tunable = counts >= MIN_TOKENS
    if tuning.steps < 1 or not bool(tunable.any()):
        return TuningOutcome(float("nan"), float("nan"))

    # expert-major slots [E, width] (padding: weight 0), and each token's slots as rows of their flattening, the
    # row past the end a zero one: a token's output is a fixed-order sum of its slots (no scatter-add)
    n, width = sample.inputs.shape[0], max(1, int(counts.max()))
    slot_row = torch.full(sample.expert_ids.shape, len(order) * width, dtype=torch.long)
    token_of = torch.zeros(len(order), width, dtype=torch.long)
    gates = torch.zeros(len(order), width)
    for j, (token, slot) in enumerate(routed):
        slot_row[token, slot] = j * width + torch.arange(len(token))
        token_of[j, : len(token)] = token
        gates[j, : len(token)] = sample.expert_weights[token, slot].float()
    x = sample.inputs.to(device).float()[token_of.to(device)]  # [E, width, H]
    gates, slot_row = gates.to(device)[..., None], slot_row.to(device)

    def unit_output(outputs: torch.Tensor) -> torch.Tensor:  # the experts' outputs [E, width, H] -> [n, H]
        slots = (gates * outputs).flatten(0, 1)
        return torch.cat((slots, slots.new_zeros(1, slots.shape[-1])))[slot_row].sum(1)

    with torch.no_grad():
        bf16 = {p: torch.stack([tuning.weights[e][p].to(device).float() for e in order]) for p in PROJECTIONS}
        reference = unit_output(expert_output(bf16, x, tuning.swiglu_limit))
        del bf16
        norm = reference.square().sum(-1)
    held = torch.arange(n, device=device) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    fit_norm, held_norm = norm[~held].sum().clamp_min(1e-30), norm[held].sum().clamp_min(1e-30)

    cores = [torch.stack([_core(experts[e][k].tensor, device) for e in order]) for k in range(len(layout))]
    suh0 = [
        torch.stack([experts[e][k].tensor.suh[:n_in].to(device).float() for e in order])
        for k, (*_, n_in, _) in enumerate(layout)
    ]
    svh0 = [
        torch.stack([experts[e][k].tensor.svh[:n_out].to(device).float() for e in order])
        for k, (*_, n_out) in enumerate(layout)
    ]
    free = tunable.to(device).float()[:, None]  # an expert with too few tokens keeps its scales
    du = [torch.zeros_like(s, requires_grad=True) for s in suh0]
    dv = [torch.zeros_like(s, requires_grad=True) for s in svh0]
    best_du, best_dv = [d.detach().clone() for d in du], [d.detach().clone() for d in dv]

    def errors() -> torch.Tensor:
        su = [s * (1 + free * d) for s, d in zip(suh0, du)]
        sv = [s * (1 + free * d) for s, d in zip(svh0, dv)]
        outputs = _scaled_expert_output(layout, cores, su, sv, x, tuning.swiglu_limit)
        return (unit_output(outputs) - reference).square().sum(-1)  # [n]

    optimizer = torch.optim.Adam([*du, *dv], lr=tuning.learning_rate, foreach=False)
    scores: list[float] = []
    best_step = 0
    for step in range(tuning.steps + 1):  # one forward per step: it scores the last step's scales, fits the next
        optimizer.zero_grad(set_to_none=True)
        err = errors()
        scores.append(float(err.detach()[held].sum() / held_norm))
        if scores[-1] < scores[best_step]:
            best_step = step
            for kept, now in zip([*best_du, *best_dv], [*du, *dv]):
                kept.copy_(now.detach())
        if step == tuning.steps:
            break
        (err[~held].sum() / fit_norm).backward()
        optimizer.step()
    before, best = scores[0], scores[best_step]
    if best_step == 0:
        return TuningOutcome(before, before, heldout_by_step=tuple(scores))
    tensors = {}
    for j, e in enumerate(order):
        if bool(tunable[j]):
            stored = _stored(experts[e], j, suh0, svh0, best_du, best_dv)
            if stored is not None:
                tensors[e] = stored
    return TuningOutcome(before, best, tensors, best_step, tuple(scores))


def _layout(parts: list[ExpertPart]) -> list[tuple[str, int | None, int, int]]:
    """(projection, rank, in, out) of each part: what a unit's experts must share to be stacked."""
    return [(p.proj, p.rank, p.tensor.in_features, p.tensor.out_features) for p in parts]


def _stored(
    parts: list[ExpertPart],
    j: int,
    suh0: list[torch.Tensor],
    svh0: list[torch.Tensor],
    du: list[torch.Tensor],
    dv: list[torch.Tensor],
) -> list[EXL3Tensor] | None:
    """Expert `j`'s tensors with its tuned scales stored as float16; None when a corrected scale leaves float16's
    range (the expert keeps its encoded ones)."""
    tuned = []
    for k, part in enumerate(parts):
        t = part.tensor
        su, sv = t.suh.float().clone(), t.svh.float().clone()
        su[: t.in_features] = (suh0[k][j] * (1 + du[k][j])).cpu()
        sv[: t.out_features] = (svh0[k][j] * (1 + dv[k][j])).cpu()
        su, sv = balance_scales(su, sv)
        su_half, sv_half = su.half(), sv.half()
        if not (torch.isfinite(su_half).all() and torch.isfinite(sv_half).all()):
            return None
        tuned.append(EXL3Tensor(t.trellis, su_half, sv_half, t.codebook, t.in_features, t.out_features))
    return tuned


def _core(t: EXL3Tensor, device: torch.device) -> torch.Tensor:
    """B = had(Q) had, the fixed factor of W = diag(suh) B diag(svh) (EXL3 orientation [in, out], padding cut)."""
    b = had_right(had_left(decode_inner(t.trellis.to(device), t.codebook)).float())
    return b[: t.in_features, : t.out_features]


def _scaled_expert_output(
    layout: list[tuple[str, int | None, int, int]],
    cores: list[torch.Tensor],
    suh: list[torch.Tensor],
    svh: list[torch.Tensor],
    x: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """expert_output [E, width, H] of the experts at scales (suh, svh), from their parts: each part computes
    ((x * suh) @ B) * svh, so a step scales activations instead of re-assembling weight-sized tensors (the cores
    [E, in, out] stay fixed). Rank slices of gate/up are output columns, concatenated in rank order; those of down are
    input columns, summed in rank order."""
    parts = sorted(zip(layout, cores, suh, svh), key=lambda part: (PROJECTIONS.index(part[0][0]), part[0][1] or 0))

    def project(proj: str, inputs: torch.Tensor) -> torch.Tensor:
        mine = [(core, su[:, None, :], sv[:, None, :]) for (name, *_), core, su, sv in parts if name == proj]
        if proj != "down_proj":
            return torch.cat([((inputs * su) @ core) * sv for core, su, sv in mine], dim=-1)
        out, start = None, 0
        for core, su, sv in mine:
            y = ((inputs[..., start : start + core.shape[-2]] * su) @ core) * sv
            out, start = y if out is None else out + y, start + core.shape[-2]
        assert out is not None, "an expert has down_proj parts"
        return out

    gate_up = torch.cat((project("gate_proj", x), project("up_proj", x)), dim=-1)
    return project("down_proj", swiglu(gate_up, swiglu_limit))


def expert_output(w: dict[str, torch.Tensor], x: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """The expert's output [.., n, H]: down(swiglu(gate x, up x)), GLM's clamped SwiGLU; weights HF [.., out, in]
    (a leading expert dimension batches experts)."""
    gate_up = torch.cat((x @ w["gate_proj"].mT, x @ w["up_proj"].mT), dim=-1)
    return swiglu(gate_up, swiglu_limit) @ w["down_proj"].mT
