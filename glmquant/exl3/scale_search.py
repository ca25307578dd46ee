"""Global scale search: the factor that puts regularized tiles at the codebook's best operating point.

The sampled error curve is flat near its optimum but not unimodal, so ExLlamaV3 1.6.5 uses a coarse
grid, then a fine grid around the coarse minimum refined by a parabola; so do we. All tensors of a
batch are evaluated in one Viterbi call per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

COARSE = [0.1 + 0.2 * i for i in range(10)]
FINE_STEP = 0.075


@dataclass(frozen=True)
class ScaleSearch:
    """How many sample tiles the search quantizes: the diagonal band's width (sample_tiles) and the strides of the
    subsamples the coarse and fine grids use."""

    band_width: int = 3
    coarse_stride: int = 3
    fine_stride: int = 1


EXLLAMAV3_SEARCH = ScaleSearch()  # ExLlamaV3 1.6.5's sampling
# Ours: a band one tile wide. For tr3 rank slices (4096 x 512) ExLlamaV3's band makes the search cost 88 % of the
# LDLQ's own Viterbi work; one tile wide cuts that to a third at the same proxy error (+0.002 % on an H200 run
# over 4 real-shape experts, bench/results/encode_layer_tr3_h200.json).
DEFAULT_SEARCH = ScaleSearch(band_width=1)


def _errors(
    pairs: list[tuple[int, float]], tiles: list[torch.Tensor], quantize: Callable[[torch.Tensor], torch.Tensor]
) -> list[float]:
    """MSE of each (tensor index, scale) pair, measured back at the tiles' own scale (one host sync in all)."""
    scales = [s for _, s in pairs]
    counts = [tiles[t].shape[0] for t, _ in pairs]
    batch = torch.cat([tiles[t] for t, _ in pairs])
    per_tile = torch.tensor(scales, dtype=batch.dtype, device=batch.device).repeat_interleave(
        torch.tensor(counts, device=batch.device)
    )
    q = quantize(batch * per_tile[:, None])
    tile_mse = (q / per_tile[:, None] - batch).square().mean(dim=1)
    owner = torch.arange(len(pairs), device=batch.device).repeat_interleave(torch.tensor(counts, device=batch.device))
    sums = torch.zeros(len(pairs), dtype=tile_mse.dtype, device=batch.device).index_add_(0, owner, tile_mse)
    return (sums / torch.tensor(counts, dtype=sums.dtype, device=sums.device)).tolist()


def _parabola(fine: list[float], err: list[float]) -> float:
    best = min(range(len(fine)), key=err.__getitem__)
    offset = 0.0
    if 0 < best < len(fine) - 1:
        y0, y1, y2 = err[best - 1], err[best], err[best + 1]
        denom = y0 - 2.0 * y1 + y2
        offset = max(-0.5, min(0.5, 0.5 * (y0 - y2) / denom)) if denom > 0 else 0.0
    return max(fine[best] + offset * FINE_STEP, 0.01)


def search_scales(
    samples: list[torch.Tensor],
    quantize: Callable[[torch.Tensor], torch.Tensor],
    search: ScaleSearch = EXLLAMAV3_SEARCH,
) -> list[float]:
    """One global scale per tensor from its sample tiles; quantize maps tiles to quantized values."""
    subs = [s[:: search.coarse_stride] for s in samples]
    coarse = _errors([(t, s) for t in range(len(samples)) for s in COARSE], subs, quantize)
    centers = [COARSE[min(range(len(COARSE)), key=lambda i: coarse[t * len(COARSE) + i])] for t in range(len(samples))]
    fines = [[c + FINE_STEP * (i - 2) for i in range(5)] for c in centers]
    err = _errors(
        [(t, s) for t in range(len(samples)) for s in fines[t]], [s[:: search.fine_stride] for s in samples], quantize
    )
    return [_parabola(fines[t], err[5 * t : 5 * t + 5]) for t in range(len(samples))]
