"""Weight regularization before LDLQ: channel scales, Hadamard rotations, and the tiles for the scale search."""

from __future__ import annotations

import torch

from glmquant.exl3.codebooks import CODEBOOK_SCALE
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.trellis import ring_order

# LDLQ feedback inflates the tiles the quantizer sees; the scale search anticipates it (ExLlamaV3 1.6.5).
LDLQ_DRIFT = {1: 1.08, 2: 1.018, 3: 1.004}


# Stored scales whose RMS leaves [2^-10, 2^10] are rebalanced (ordinary weights keep ExLlamaV3's exact scales).
BALANCED_SCALE_RANGE = (2.0**-10, 2.0**10)


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.square().mean(dim=dim).sqrt()


def regularize(
    w: torch.Tensor, su_signs: torch.Tensor, sv_signs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, n) padded weight -> (P diag(1/su) W diag(1/sv) P, su, sv) with unit-RMS-ish rows and columns.

    sv: signs x column RMS (mean 1; zero columns get scale 0), su: signs x row RMS of the
    column-scaled, rotated weight over -codebook RMS. The global scale is applied later.
    """
    col = _rms(w, 0)
    mean = col.mean()
    col = torch.where(mean > 1e-30, col / mean, col)  # on the device: no host sync
    zero_cols = col.abs() < 1e-30
    sv = sv_signs * torch.where(zero_cols, torch.full_like(col, 0.1), col) + 1e-10
    w = had_right(w / sv[None, :])
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)
    row = _rms(w, 1)
    row = torch.where(row.abs() < 1e-30, torch.full_like(row, 0.1), row)
    su = su_signs * row / (-CODEBOOK_SCALE) + 1e-10
    return had_left(w / su[:, None]), su, sv


def balance_scales(su: torch.Tensor, sv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move a power of two between su and sv so both sit near the same magnitude before they are stored in fp16.

    su carries the whole weight scale, so a weight of RMS 1e4 (or 1e-5) puts su, and the decoder's intermediate
    had(Q) * su, past fp16's range (or into its subnormals). A power of two leaves every product su_i * sv_j, and so
    the decoded weight, exactly as it was. Computed on the scales' device without a host sync.
    """
    rms_u, rms_v = _rms(su, 0).double(), _rms(sv, 0).double()
    low, high = BALANCED_SCALE_RANGE
    keep = (rms_u == 0) | (rms_v == 0) | ((rms_u >= low) & (rms_u <= high))
    shift = torch.where(keep, 0.0, torch.round(torch.log2(rms_u / rms_v) / 2))  # round half to even, as round()
    return su * torch.exp2(-shift).to(su.dtype), sv * torch.exp2(shift).to(sv.dtype)


def sample_tiles(w: torch.Tensor, width: int = 3) -> torch.Tensor:
    """Ring-ordered tiles for the global scale search: a wrapped diagonal band (every tile row and
    column at least once) plus the highest- and lowest-RMS tiles, as in ExLlamaV3."""
    tk, tn = w.shape[0] // 16, w.shape[1] // 16
    w4 = w.view(tk, 16, tn, 16)
    diag = max(tk, tn)
    ii = torch.arange(diag, device=w.device).repeat_interleave(width)
    ww = torch.arange(width, device=w.device).repeat(diag)
    rows, cols = ii % tk, (ii + ww) % tn
    tile_ms = w4.square().mean(dim=(1, 3)).flatten()
    extremes = min(max(8, diag * width // 16), (tile_ms.shape[0] + 1) // 2)
    flat = torch.cat((torch.topk(tile_ms, extremes).indices, torch.topk(tile_ms, extremes, largest=False).indices))
    rows, cols = torch.cat((rows, flat // tn)), torch.cat((cols, flat % tn))
    return w4[rows, :, cols, :].reshape(-1, 256)[:, ring_order(w.device)].contiguous()
