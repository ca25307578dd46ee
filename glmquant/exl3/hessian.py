"""Hessian preparation for LDLQ: damping, fallbacks, sign flips + Hadamard rotation, block LDL."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmquant.exl3.hadamard import had_left, had_right

SIGMA_REG = 0.025  # ExLlamaV3's damping: this share of the mean diagonal is added to the diagonal
CHOLESKY_RETRIES = 10


@dataclass(frozen=True)
class PreparedHessian:
    """What the encoder needs from H; hessian and ldl are None on the uncalibrated fallback."""

    hessian: torch.Tensor | None  # damped H in the original basis, padded [k, k]
    ldl: torch.Tensor | None  # strictly block-lower feedback factor of the rotated H [k, k]
    fallback: str | None


def pad_hessian(hessian: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """Zero-pad to the padded input size: padded inputs are zero, so they add nothing to E[x x^T]."""
    h = torch.zeros((size, size), dtype=torch.float32, device=device)
    k = hessian.shape[0]
    h[:k, :k] = hessian.to(device=device, dtype=torch.float32)
    return h


def block_ldl(h: torch.Tensor, block: int = 16) -> torch.Tensor:
    """L with H = L D L^T for 16x16 blocks, unit diagonal blocks removed (strictly block-lower)."""
    k = h.shape[0]
    m = k // block
    chol = torch.linalg.cholesky(h)
    diag = torch.diagonal(chol.reshape(m, block, m, block), dim1=0, dim2=2).permute(2, 0, 1)  # [m, b, b]
    ldl = torch.einsum("kmb,mbc->kmc", chol.reshape(k, m, block), torch.linalg.inv(diag)).reshape(k, k)
    blocks = ldl.view(m, block, m, block)
    idx = torch.arange(m, device=h.device)
    blocks[idx, :, idx, :] = 0.0
    return ldl


def prepare_hessian(hessian: torch.Tensor | None, su_signs: torch.Tensor) -> PreparedHessian:
    """Damp H, rotate it like the weight (P S H S P) and factor it, retrying with more damping.

    hessian is already padded; su_signs are the random input signs (padded size).
    """
    if hessian is None:
        return PreparedHessian(None, None, "no_hessian")
    finite, diag_mean = torch.stack((torch.isfinite(hessian).all().float(), hessian.diagonal().mean())).tolist()
    if not finite:
        return PreparedHessian(None, None, "nonfinite_hessian")
    if diag_mean < 0:  # E[x x^T] has a nonnegative diagonal: this is no input Hessian (a sign or data error)
        return PreparedHessian(None, None, "negative_hessian")
    if diag_mean < 1e-20:
        return PreparedHessian(None, None, "zero_hessian")
    h = hessian.clone()
    h.diagonal().add_(SIGMA_REG * diag_mean)
    rot = had_left(had_right(h * su_signs[None, :]) * su_signs[:, None])
    for attempt in range(CHOLESKY_RETRIES + 1):
        try:
            ldl = block_ldl(rot)
        except torch.linalg.LinAlgError:
            extra = 2.0 * SIGMA_REG * rot.diagonal().mean()
            rot.diagonal().add_(extra)
            h.diagonal().add_(extra)  # c*I is rotation-invariant, so H in the original basis gets the same
            continue
        return PreparedHessian(h, ldl, f"cholesky_retry:{attempt}" if attempt else None)
    return PreparedHessian(None, None, "cholesky_failed")
