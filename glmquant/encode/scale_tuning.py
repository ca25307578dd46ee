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
    """The expert's EXL3 tensors `parts` with scales tuned on `tokens`, computed on `device`."""
    inputs, gates, weights = tokens.inputs.to(device), tokens.gates.to(device), tokens.weights
    n = inputs.shape[0]
    if n < MIN_TOKENS or steps < 1:
        return TuningOutcome(None, float("nan"), float("nan"))
    held = torch.arange(n, device=device) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    x = inputs.float()
    w2 = gates.float().square()
    with torch.no_grad():
        reference = expert_output({p: weights[p].to(device).float() for p in PROJECTIONS}, x, swiglu_limit)
        norm = (w2[:, None] * reference.square()).sum(1)
    fit_norm, held_norm = norm[~held].sum().clamp_min(1e-30), norm[held].sum().clamp_min(1e-30)

    cores = [_core(p.tensor).to(device) for p in parts]
    suh0 = [p.tensor.suh[: p.tensor.in_features].to(device).float() for p in parts]
    svh0 = [p.tensor.svh[: p.tensor.out_features].to(device).float() for p in parts]
    du = [torch.zeros_like(s, requires_grad=True) for s in suh0]
    dv = [torch.zeros_like(s, requires_grad=True) for s in svh0]

    def errors() -> torch.Tensor:
        dense = _assemble(
            parts, cores, [s * (1 + d) for s, d in zip(suh0, du)], [s * (1 + d) for s, d in zip(svh0, dv)]
        )
        return (w2[:, None] * (expert_output(dense, x, swiglu_limit) - reference).square()).sum(1)

    optimizer = torch.optim.Adam([*du, *dv], lr=LEARNING_RATE, foreach=False)
    before = best = float("inf")
    best_state = None
    for step in range(steps + 1):  # one forward per step: it scores the last step's scales and fits the next ones
        optimizer.zero_grad(set_to_none=True)
        err = errors()
        score = float(err[held].detach().sum() / held_norm)
        if step == 0:
            before = best = score
        elif score < best:
            best, best_state = score, ([d.detach().clone() for d in du], [d.detach().clone() for d in dv])
        if step == steps:
            break
        (err[~held].sum() / fit_norm).backward()
        optimizer.step()
    if best_state is None:
        return TuningOutcome(None, before, before)
    tuned = []
    for part, su, sv, a, b in zip(parts, suh0, svh0, *best_state):
        t = part.tensor
        su_full, sv_full = t.suh.to(device).float().clone(), t.svh.to(device).float().clone()
        su_full[: t.in_features], sv_full[: t.out_features] = su * (1 + a), sv * (1 + b)
        su_full, sv_full = balance_scales(su_full, sv_full)
        su_half, sv_half = su_full.half().cpu(), sv_full.half().cpu()
        if not (torch.isfinite(su_half).all() and torch.isfinite(sv_half).all()):
            return TuningOutcome(None, before, before)  # a correction past float16's range: keep the encoded scales
        tuned.append(EXL3Tensor(t.trellis, su_half, sv_half, t.codebook, t.in_features, t.out_features))
    return TuningOutcome(tuned, before, best)


def _core(t: EXL3Tensor) -> torch.Tensor:
    """B = had(Q) had, the fixed factor of W = diag(suh) B diag(svh) (EXL3 orientation [in, out], padding cut)."""
    b = had_right(had_left(decode_inner(t.trellis, t.codebook)).float())
    return b[: t.in_features, : t.out_features]


def _assemble(
    parts: list[ExpertPart], cores: list[torch.Tensor], suh: list[torch.Tensor], svh: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each projection's HF (out, in) weight from its parts at the given scales (rank slices in rank order)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for part, core, su, sv in zip(parts, cores, suh, svh):
        pieces.setdefault(part.proj, []).append((part.rank or 0, (su[:, None] * core * sv[None, :]).T))
    dense = {}
    for proj, found in pieces.items():
        ordered = [w for _, w in sorted(found, key=lambda item: item[0])]
        dense[proj] = torch.cat(ordered, dim=1 if proj == "down_proj" else 0)
    return dense


def expert_output(w: dict[str, torch.Tensor], x: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """The expert's output [n, H]: down(swiglu(gate x, up x)), GLM's clamped SwiGLU."""
    gate_up = torch.cat((x @ w["gate_proj"].T, x @ w["up_proj"].T), dim=-1)
    return swiglu(gate_up, swiglu_limit) @ w["down_proj"].T
