"""Global scale search: the factor that puts regularized tiles at the codebook's best operating point.

The sampled error curve is flat near its optimum but not unimodal, so ExLlamaV3 1.6.5 uses a coarse
grid, then a fine grid around the coarse minimum refined by a parabola; so do we. All tensors of a
batch are evaluated in one Viterbi call per round of a grid's walk (or per grid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

COARSE = [0.1 + 0.2 * i for i in range(10)]
FINE_STEP = 0.075
FINE_POINTS = 5  # the fine grid: the coarse minimum and two steps either side
# The coarse walk starts at 0.7, 0.9, 1.1: regularized tiles put the coarse minimum at 0.7-1.1 for every tensor
# measured (96 routed-expert linears of the CPU-trained proxy at K1-K4 MCG and K2 MUL1, each with the full grid's
# scale, bit for bit), so the walk usually stops after three to five points where the full grid quantizes ten.
WALK_START = 4  # COARSE[4] = 0.9
EXLLAMAV3_COARSE_STRIDE = 3


@dataclass(frozen=True)
class ScaleSearch:
    """How many sample tiles the search quantizes: the diagonal band's width (sample_tiles) and the strides of the
    subsamples the coarse and fine grids use."""

    band_width: int = 3
    coarse_stride: int = EXLLAMAV3_COARSE_STRIDE
    fine_stride: int = 1
    # Walk the coarse grid from WALK_START towards lower errors and stop at the first local minimum (the full grid's
    # minimum wherever the coarse curve has one minimum) instead of quantizing all ten points.
    coarse_walk: bool = False
    # The same on the fine grid, from its three middle points: the parabola needs the minimum's two neighbours only.
    fine_walk: bool = False
    # fine_stride applies where it leaves at least this many tiles per fine point; smaller samples use every tile.
    fine_min_tiles: int = 0
    # coarse_stride applies where it leaves at least this many tiles per coarse point; smaller samples use
    # ExLlamaV3's stride of 3.
    coarse_min_tiles: int = 0

    def __post_init__(self) -> None:
        for name in ("band_width", "coarse_stride", "fine_stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScaleSearch.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("coarse_min_tiles", "fine_min_tiles"):
            if getattr(self, name) < 0:
                raise ValueError(f"ScaleSearch.{name} must be 0 or more, got {getattr(self, name)}")

    def coarse_tiles(self, sample: torch.Tensor) -> torch.Tensor:
        """The tiles of one tensor's sample that each coarse point quantizes."""
        fallback = min(self.coarse_stride, EXLLAMAV3_COARSE_STRIDE)
        return _subsample(sample, self.coarse_stride, self.coarse_min_tiles, fallback)

    def fine_tiles(self, sample: torch.Tensor) -> torch.Tensor:
        """The tiles of one tensor's sample that each fine point quantizes."""
        return _subsample(sample, self.fine_stride, self.fine_min_tiles, 1)


def _subsample(sample: torch.Tensor, stride: int, min_tiles: int, fallback: int) -> torch.Tensor:
    """Every stride-th tile where that leaves min_tiles or more, else every fallback-th."""
    return sample[:: stride if sample.shape[0] // stride >= min_tiles else fallback]


EXLLAMAV3_SEARCH = ScaleSearch()  # ExLlamaV3 1.6.5's sampling
# Ours: a band one tile wide. For tr3 rank slices (4096 x 512) ExLlamaV3's band makes the search cost 88 % of the
# LDLQ's own Viterbi work; one tile wide cuts that to a third at the same proxy error (+0.002 % on an H200 run
# over 4 real-shape experts, bench/results/encode_layer_tr3_h200.json).
# The coarse walk quantizes 3-5 of the 10 coarse points (40 % of the search's tiles were the coarse grid's), the fine
# walk 3-4 of the 5 fine points, each of which quantizes every band tile: the search went from 12.8 to 8.5 s for
# 96 real-shape experts on an H200 (bench/results/encode_layer_tr3_h200_walk96_*.json; same scales on the proxy).
# The fine points quantize every second band tile where that leaves 128 or more: on an H200, 96 real-shape experts'
# mean proxy error 0.0120760 against 0.0120768 with every tile (noise), the search 5.2 s instead of 8.3 s
# (bench/results/encode_layer_tr3_h200_fine2_d15e410.json: 288 sample tiles per rank slice). On small tensors
# (ExLlamaV3's golden 256 x 128 linears: 32 sample tiles) half the tiles made the scale noisier (MUL1 K2 +2 %).
# Every sixth band tile per coarse point and every third per fine point where that leaves 48 / 96 or more (a real
# rank slice's 288 sample tiles): on an H200, 96 real-shape experts' mean proxy error 0.0120783 against 0.0120760
# with strides 3 and 2, and 59.0 s against 60.8 s (bench/results/encode_search_h200_7d6a2f8.json). Stride 6 meets
# only every second of a slice's 32 tile columns (or rows) on the band; a stride prime to 32 meets all, and chose
# scales as good (CPU, 24 real-shape slices: the whole sample's error at the chosen scale 1.00007x a full-sample
# search's at strides 6 and 5, 1.00014x at 7): after the Hadamard rotations the columns are alike.
DEFAULT_SEARCH = ScaleSearch(
    band_width=1,
    coarse_stride=6,
    coarse_min_tiles=48,
    fine_stride=3,
    fine_min_tiles=96,
    coarse_walk=True,
    fine_walk=True,
)


def _errors(
    pairs: list[tuple[int, float]], tiles: list[torch.Tensor], quantize: Callable[[torch.Tensor], torch.Tensor]
) -> list[float]:
    """MSE of each (tensor index, scale) pair, measured back at the tiles' own scale (one host sync in all).
    Each pair's tiles are averaged in a fixed order (not with atomics, whose float sums vary from run to run on a
    GPU), so the chosen scales, and the artifact, repeat bit for bit."""
    scales = [s for _, s in pairs]
    counts = [tiles[t].shape[0] for t, _ in pairs]
    batch = torch.cat([tiles[t] for t, _ in pairs])
    per_tile = torch.tensor(scales, dtype=batch.dtype, device=batch.device).repeat_interleave(
        torch.tensor(counts, device=batch.device)
    )
    q = quantize(batch * per_tile[:, None])
    tile_mse = (q / per_tile[:, None] - batch).square().mean(dim=1)
    if len(set(counts)) == 1:  # the usual round: every tensor's sample has the same size
        means = tile_mse.view(len(pairs), counts[0]).mean(dim=1)
    else:
        means = torch.stack([part.mean() for part in tile_mse.split(counts)])
    return means.tolist()


def _walk(
    start: list[int], size: int, count: int, evaluate: Callable[[list[tuple[int, int]]], list[float]]
) -> list[dict[int, float]]:
    """Per tensor (count of them), the errors at grid indices `start`, extended one point at a time towards lower
    errors until the lowest point seen has both neighbours seen or lies at the grid's end. evaluate maps
    (tensor, grid index) pairs to errors; one call per round for all tensors."""
    errors: list[dict[int, float]] = [{} for _ in range(count)]
    todo = [(t, i) for t in range(count) for i in start]
    while todo:
        for (t, i), value in zip(todo, evaluate(todo)):
            errors[t][i] = value
        todo = []
        for t, seen in enumerate(errors):
            best = _lowest(seen)
            if best == min(seen) and best > 0:
                todo.append((t, best - 1))
            elif best == max(seen) and best < size - 1:
                todo.append((t, best + 1))
    return errors


def _lowest(errors: dict[int, float]) -> int:
    """The grid index of the lowest error (ties: the lower index, as a scan of the grid finds it)."""
    return min(errors, key=lambda i: (errors[i], i))


def _parabola(fine: list[float], errors: dict[int, float]) -> float:
    """The fine grid's lowest point, moved to the vertex of the parabola through it and its neighbours."""
    best = _lowest(errors)
    offset = 0.0
    if best - 1 in errors and best + 1 in errors:
        y0, y1, y2 = errors[best - 1], errors[best], errors[best + 1]
        denom = y0 - 2.0 * y1 + y2
        offset = max(-0.5, min(0.5, 0.5 * (y0 - y2) / denom)) if denom > 0 else 0.0
    return max(fine[best] + offset * FINE_STEP, 0.01)


def search_scales(
    samples: list[torch.Tensor],
    quantize: Callable[[torch.Tensor], torch.Tensor],
    search: ScaleSearch = EXLLAMAV3_SEARCH,
) -> list[float]:
    """One global scale per tensor from its sample tiles; quantize maps tiles to quantized values."""
    count = len(samples)
    coarse_tiles = [search.coarse_tiles(s) for s in samples]
    coarse_start = [WALK_START - 1, WALK_START, WALK_START + 1] if search.coarse_walk else list(range(len(COARSE)))
    coarse = _walk(
        coarse_start,
        len(COARSE),
        count,
        lambda todo: _errors([(t, COARSE[i]) for t, i in todo], coarse_tiles, quantize),
    )
    fines = [[COARSE[_lowest(seen)] + FINE_STEP * (i - 2) for i in range(FINE_POINTS)] for seen in coarse]
    fine_tiles = [search.fine_tiles(s) for s in samples]
    fine_start = [1, 2, 3] if search.fine_walk else list(range(FINE_POINTS))
    fine = _walk(
        fine_start, FINE_POINTS, count, lambda todo: _errors([(t, fines[t][i]) for t, i in todo], fine_tiles, quantize)
    )
    return [_parabola(fines[t], fine[t]) for t in range(count)]
