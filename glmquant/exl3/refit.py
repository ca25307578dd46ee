"""Post-LDLQ refit of the stored per-channel scales in the Hessian metric, the trellis held fixed.

Per output column the best scale is closed-form; the input scales solve ((Q Q^T) o H) r = rowsum(Q o H W).
Alternating rounds (ExLlamaV3 1.6.5 runs two; we run one, see REFIT_ROUNDS); free at inference since suh/svh are
stored anyway. The system is
symmetric positive definite (a Schur product of the PSD Q Q^T, whose diagonal the damping keeps positive, and the
damped H), so it is solved by Cholesky: half the flops of the LU solve ExLlamaV3 uses, the same solution to float32
rounding.
"""

from __future__ import annotations

import torch

# The second round buys 0.007 % of the refit's objective (bench/results/refit_rounds_cpu.json: 12 real-shape rank
# slices) for half the refit's time, about 9 s of an H200's 200 s per MoE layer; one round is the default.
REFIT_ROUNDS = 1


def refit_scales(
    w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, rounds: int = REFIT_ROUNDS
) -> tuple[torch.Tensor, torch.Tensor]:
    """w, wq: original and quantized weight [k, n] (original basis, wq built with su, sv); h: damped H [k, k].

    Returns refitted (su [k], sv [n]).
    """
    hw = h @ w
    q = wq
    for _ in range(rounds):
        num = (q * hw).sum(0)
        den = (q * (h @ q)).sum(0)
        c = torch.where(den > 1e-30, num / den.clamp(min=1e-30), torch.ones_like(num))
        q = q * c[None, :]
        sv = sv * c
        a = (q @ q.T) * h
        a.diagonal().add_(1e-6 * a.diagonal().mean())
        factor, info = torch.linalg.cholesky_ex(a)
        r = torch.cholesky_solve((q * hw).sum(1)[:, None], factor)[:, 0]
        ok = torch.isfinite(r) & (r > 0) & (info == 0)  # a system not positive definite in float32 keeps the scales
        r = torch.where(ok, r, torch.ones_like(r))
        q = q * r[:, None]
        su = su * r
    return su, sv
