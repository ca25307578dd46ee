"""The global scale search: the coarse and fine walks find the full grids' scale with fewer quantized tiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from glmquant.exl3.backends import quantize_tiles, select_backend
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.scale_search import (
    COARSE,
    DEFAULT_SEARCH,
    EXLLAMAV3_SEARCH,
    FINE_POINTS,
    ScaleSearch,
    _errors,
    search_scales,
)

FULL_GRID = dataclasses.replace(DEFAULT_SEARCH, coarse_walk=False, fine_walk=False)


def _counting_quantizer(bits: int) -> tuple[list[int], Callable[[torch.Tensor], torch.Tensor]]:
    search, seen = select_backend("cpu", None), [0]

    def quantize(tiles: torch.Tensor) -> torch.Tensor:
        seen[0] += tiles.shape[0]
        return quantize_tiles(search, tiles, bits, Codebook.MCG)[0]

    return seen, quantize


@pytest.mark.parametrize("spread", [1.3, 4.0, 0.6])
def test_the_walks_find_the_full_grids_scale(spread: float) -> None:
    """Gaussian tiles (what regularized weights look like; K2 MCG's best scale for them is ~1.235 / spread) at the
    spread of a real model's regularized tiles put the coarse minimum at 0.9, where the walk starts; three times
    wider put it near 0.3, and narrower near the grid's top: the walk goes there too, and the search ends on the
    same scale as with the whole grids, bit for bit."""
    g = torch.Generator().manual_seed(int(spread * 10))
    samples = [torch.randn(48, 256, generator=g) * spread for _ in range(3)]
    full_seen, full_q = _counting_quantizer(2)
    walk_seen, walk_q = _counting_quantizer(2)
    full = search_scales(samples, full_q, FULL_GRID)
    walk = search_scales(samples, walk_q, DEFAULT_SEARCH)
    assert walk == full
    assert walk_seen[0] < full_seen[0]
    coarse, fine = (DEFAULT_SEARCH.coarse_tiles(samples[0]).shape[0], DEFAULT_SEARCH.fine_tiles(samples[0]).shape[0])
    assert full_seen[0] == 3 * (len(COARSE) * coarse + FINE_POINTS * fine)  # 3 tensors
    if spread == 1.3:  # the usual case: three coarse points of ten, three or four fine points of five
        assert walk_seen[0] <= 3 * (3 * coarse + 4 * fine)
    else:
        assert abs(full[0] - 1.235 / spread) < 0.1 * (1.235 / spread)


def test_the_fine_grid_subsamples_large_samples_only() -> None:
    """A real rank slice's 288 sample tiles: every third one per fine point; a small tensor's 32: all of them."""
    large, small = torch.randn(288, 256), torch.randn(32, 256)
    assert torch.equal(DEFAULT_SEARCH.fine_tiles(large), large[::3])
    assert torch.equal(DEFAULT_SEARCH.fine_tiles(small), small)


def test_the_coarse_grid_subsamples_large_samples_more() -> None:
    """coarse_min_tiles: every sixth of a real slice's 288 tiles (48 per point); a small tensor keeps ExLlamaV3's
    stride of 3, and so does a search without the threshold."""
    large, small = torch.randn(288, 256), torch.randn(32, 256)
    assert torch.equal(DEFAULT_SEARCH.coarse_tiles(large), large[::6])
    assert torch.equal(DEFAULT_SEARCH.coarse_tiles(small), small[::3])
    assert torch.equal(EXLLAMAV3_SEARCH.coarse_tiles(large), large[::3])
    denser = dataclasses.replace(DEFAULT_SEARCH, coarse_stride=2)  # a stride below ExLlamaV3's stays on small samples
    assert torch.equal(denser.coarse_tiles(small), small[::2])
    bad_searches: dict[str, Callable[[], ScaleSearch]] = {
        "coarse_stride": lambda: ScaleSearch(coarse_stride=0),
        "fine_stride": lambda: ScaleSearch(fine_stride=-1),
        "band_width": lambda: ScaleSearch(band_width=0),
        "fine_min_tiles": lambda: ScaleSearch(fine_min_tiles=-1),
    }
    for field, make in bad_searches.items():
        with pytest.raises(ValueError, match=f"ScaleSearch.{field}"):
            make()


def test_errors_are_each_pairs_own_mean_whatever_the_sizes() -> None:
    """_errors averages each (tensor, scale) pair's tiles in a fixed order: equal sizes (one reshape) and unequal
    sizes (one mean per pair) give each pair's own mean squared error."""
    g = torch.Generator().manual_seed(3)
    tiles = [torch.randn(n, 256, generator=g) for n in (6, 6, 9)]

    def quantize(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4  # a stand-in quantizer: the grid of quarters

    for pairs in ([(0, 0.7), (1, 1.1)], [(0, 0.7), (2, 0.9), (1, 1.3)]):
        expected = [((quantize(tiles[t] * s) / s - tiles[t]) ** 2).mean().item() for t, s in pairs]
        assert _errors(pairs, tiles, quantize) == pytest.approx(expected, rel=1e-6)
