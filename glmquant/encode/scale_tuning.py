"""Tune a routed expert's stored EXL3 scales on its calibration tokens, the trellis codes held fixed.

EXL3 decodes a linear as W = diag(suh) · B · diag(svh), B = had(Q) fixed by the codes, so the scales are free at
inference. The per-linear refit (exl3/refit.py) fits them in each linear's own Hessian metric, one linear at a
time; this fits all of an expert's scales together on what the layer computes: the expert's SwiGLU output on the
tokens routed to it, each token weighted by its routing weight squared (its share of the MoE output), against the
BF16 expert. Adam on multiplicative corrections; every fourth token is held out, the step with the lowest held-out
error is kept, and the encoded scales stay as they were when no step beats them. The same inputs give the same
bits on a device type (a fixed step count, no data-dependent branching but the held-out choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmquant.arch.glm5_next_math import swiglu
from glmquant.arch.table import PROJECTIONS
from glmquant.exl3.decode import decode_inner
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.regularize import balance_scales
from glmquant.exl3.tensor import EXL3Tensor

LEARNING_RATE = 2e-3  # Adam step on the relative scale corrections
MIN_TOKENS = 8  # an expert routed fewer calibration tokens keeps its encoded scales
HELD_OUT_EVERY = 4  # every fourth of an expert's tokens measures the steps, the rest fit them


@dataclass(frozen=True)
class ExpertPart:
    """One EXL3 tensor of an expert: a whole projection, or a rank slice of it (rows of gate/up, columns of down)."""

    proj: str  # gate_proj | up_proj | down_proj
    rank: int | None
    tensor: EXL3Tensor


@dataclass(frozen=True)
class ExpertTokens:
    """What tuning one expert needs besides its EXL3 tensors: its BF16 weights by projection (HF (out, in)), the
    sampled MoE inputs routed to it [n, H] and their routing weights [n]."""

    weights: dict[str, torch.Tensor]
    inputs: torch.Tensor
    gates: torch.Tensor


@dataclass(frozen=True)
class UnitTuning:
    """`encode --tune-scales` for one work unit: Adam steps, the model's SwiGLU clamp, and each source expert's
    tokens."""

    steps: int
    swiglu_limit: float | None
    experts: dict[int, ExpertTokens]


@dataclass(frozen=True)
class TuningOutcome:
    """The tuned tensors (None: the encoded ones were kept) and the held-out error before and after."""

    tensors: list[EXL3Tensor] | None
    heldout_before: float
    heldout_after: float


def tune_expert_scales(
    parts: list[ExpertPart], tokens: ExpertTokens, swiglu_limit: float | None, steps: int, device: torch.device
) -> TuningOutcome:
    """One expert's EXL3 tensors `parts` with scales tuned on `tokens`, computed on `device`."""
    return tune_experts_scales([(parts, tokens)], swiglu_limit, steps, device)[0]


def tune_experts_scales(
    experts: list[tuple[list[ExpertPart], ExpertTokens]], swiglu_limit: float | None, steps: int, device: torch.device
) -> list[TuningOutcome]:
    """Several experts' tensors tuned at once, one batched computation (the experts share their parts' layout, as a
    unit's do); each expert's result is what tuning it alone gives (Adam is elementwise, the losses are separate),
    up to the rounding of batched matmuls."""
    skipped = TuningOutcome(None, float("nan"), float("nan"))
    todo = [i for i, (_, t) in enumerate(experts) if t.inputs.shape[0] >= MIN_TOKENS and steps >= 1]
    outcomes = [skipped] * len(experts)
    if not todo:
        return outcomes
    layout = [(p.proj, p.rank, p.tensor.in_features, p.tensor.out_features) for p in experts[todo[0]][0]]
    for i in todo:
        if [(p.proj, p.rank, p.tensor.in_features, p.tensor.out_features) for p in experts[i][0]] != layout:
            raise ValueError("tune_experts_scales: the experts' EXL3 parts differ in layout")
    parts = [experts[i][0] for i in todo]
    tokens = [experts[i][1] for i in todo]
    counts = torch.tensor([t.inputs.shape[0] for t in tokens], device=device)
    width = int(counts.max())
    x = torch.stack([_pad(t.inputs.to(device).float(), width) for t in tokens])  # [E, n, H]
    w2 = torch.stack([_pad(t.gates.to(device).float().square(), width) for t in tokens])  # [E, n], 0 past the tokens
    position = torch.arange(width, device=device)[None, :]
    valid = position < counts[:, None]
    held = valid & (position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    fit = valid & ~held
    with torch.no_grad():
        weights = {p: torch.stack([t.weights[p].to(device).float() for t in tokens]) for p in PROJECTIONS}
        reference = expert_output(weights, x, swiglu_limit)
        norm = (w2[..., None] * reference.square()).sum(-1)  # [E, n]
        del weights
    fit_norm = (norm * fit).sum(1).clamp_min(1e-30)
    held_norm = (norm * held).sum(1).clamp_min(1e-30)

    cores = [torch.stack([_core(ps[k].tensor, device) for ps in parts]) for k in range(len(layout))]
    suh0 = [
        torch.stack([ps[k].tensor.suh[:n_in].to(device).float() for ps in parts])
        for k, (*_, n_in, _) in enumerate(layout)
    ]
    svh0 = [
        torch.stack([ps[k].tensor.svh[:n_out].to(device).float() for ps in parts])
        for k, (*_, n_out) in enumerate(layout)
    ]
    du = [torch.zeros_like(s, requires_grad=True) for s in suh0]
    dv = [torch.zeros_like(s, requires_grad=True) for s in svh0]
    best_du, best_dv = [d.detach().clone() for d in du], [d.detach().clone() for d in dv]

    def errors() -> torch.Tensor:
        su = [s * (1 + d) for s, d in zip(suh0, du)]
        sv = [s * (1 + d) for s, d in zip(svh0, dv)]
        dense = _assemble(layout, cores, su, sv)
        return (w2[..., None] * (expert_output(dense, x, swiglu_limit) - reference).square()).sum(-1)  # [E, n]

    optimizer = torch.optim.Adam([*du, *dv], lr=LEARNING_RATE, foreach=False)
    before = best = torch.full((len(parts),), float("inf"), device=device)
    for step in range(steps + 1):  # one forward per step: it scores the last step's scales and fits the next ones
        optimizer.zero_grad(set_to_none=True)
        err = errors()
        with torch.no_grad():
            score = (err * held).sum(1) / held_norm
            if step == 0:
                before, best = score.clone(), score.clone()
            else:
                better = score < best
                best = torch.where(better, score, best)
                for kept, now in zip([*best_du, *best_dv], [*du, *dv]):
                    kept.copy_(torch.where(better[:, None], now, kept))
        if step == steps:
            break
        ((err * fit).sum(1) / fit_norm).sum().backward()
        optimizer.step()
    for e, i in enumerate(todo):
        outcomes[i] = _stored(parts[e], e, suh0, svh0, best_du, best_dv, float(before[e]), float(best[e]))
    return outcomes


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` with zero rows appended up to `width` rows."""
    return torch.cat((t, t.new_zeros((width - t.shape[0], *t.shape[1:]))))


def _stored(
    parts: list[ExpertPart],
    e: int,
    suh0: list[torch.Tensor],
    svh0: list[torch.Tensor],
    du: list[torch.Tensor],
    dv: list[torch.Tensor],
    before: float,
    after: float,
) -> TuningOutcome:
    """Expert `e`'s tensors with its best scales stored as float16; the encoded ones when no step beat them or a
    corrected scale leaves float16's range."""
    if not after < before:
        return TuningOutcome(None, before, before)
    tuned = []
    for k, part in enumerate(parts):
        t = part.tensor
        su, sv = t.suh.float().clone(), t.svh.float().clone()
        su[: t.in_features] = (suh0[k][e] * (1 + du[k][e])).cpu()
        sv[: t.out_features] = (svh0[k][e] * (1 + dv[k][e])).cpu()
        su, sv = balance_scales(su, sv)
        su_half, sv_half = su.half(), sv.half()
        if not (torch.isfinite(su_half).all() and torch.isfinite(sv_half).all()):
            return TuningOutcome(None, before, before)
        tuned.append(EXL3Tensor(t.trellis, su_half, sv_half, t.codebook, t.in_features, t.out_features))
    return TuningOutcome(tuned, before, after)


def _core(t: EXL3Tensor, device: torch.device) -> torch.Tensor:
    """B = had(Q) had, the fixed factor of W = diag(suh) B diag(svh) (EXL3 orientation [in, out], padding cut)."""
    b = had_right(had_left(decode_inner(t.trellis.to(device), t.codebook)).float())
    return b[: t.in_features, : t.out_features]


def _assemble(
    layout: list[tuple[str, int | None, int, int]],
    cores: list[torch.Tensor],
    suh: list[torch.Tensor],
    svh: list[torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Each projection's HF [E, out, in] weights from its parts at the given scales (rank slices in rank order)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for (proj, rank, _, _), core, su, sv in zip(layout, cores, suh, svh):
        pieces.setdefault(proj, []).append((rank or 0, (su[..., :, None] * core * sv[..., None, :]).mT))
    return {
        proj: torch.cat([w for _, w in sorted(found, key=lambda item: item[0])], dim=-1 if proj == "down_proj" else -2)
        for proj, found in pieces.items()
    }


def expert_output(w: dict[str, torch.Tensor], x: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """The expert's output [.., n, H]: down(swiglu(gate x, up x)), GLM's clamped SwiGLU; weights HF [.., out, in]
    (a leading expert dimension batches experts)."""
    gate_up = torch.cat((x @ w["gate_proj"].mT, x @ w["up_proj"].mT), dim=-1)
    return swiglu(gate_up, swiglu_limit) @ w["down_proj"].mT
