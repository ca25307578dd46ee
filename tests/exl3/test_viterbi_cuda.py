"""The CUDA Viterbi kernel: its arithmetic (a torch model of it, checked on any machine), its build, and on a GPU
the kernel itself, bit for bit against that model and in quality against the exact CPU search."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from glmquant.exl3 import Codebook
from glmquant.exl3.backends import select_backend
from glmquant.exl3.codebooks import codebook_values
from glmquant.exl3.cuda_viterbi import (
    build,
    codebook_pairs,
    codebook_peak,
    cuda_viterbi_available,
    fixed_values,
    viterbi_cuda,
)

sys.path.insert(0, str(Path(__file__).parent))
from cuda_viterbi_reference import viterbi_cuda_reference

gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not cuda_viterbi_available(), reason="needs a CUDA GPU and nvcc"
)


def tiles(count: int, seed: int, std: float = 1.2) -> torch.Tensor:
    return torch.randn(count, 256, generator=torch.Generator().manual_seed(seed)) * std


def closed(states: torch.Tensor, bits: int) -> bool:
    return torch.equal(states >> bits, torch.roll(states, 1, dims=1) & ((1 << (16 - bits)) - 1))


def test_codebook_pairs_put_state_pairs_in_one_word() -> None:
    values = codebook_values("mcg").view(torch.int16)
    for bits in (1, 2, 5, 8):
        pairs = codebook_pairs(Codebook.MCG, bits, torch.device("cpu"))
        kr = 16 - bits
        assert pairs.shape == (1 << (bits - 1), 1 << kr) and pairs.dtype == torch.int32
        cp, e = 1 if bits > 1 else 0, 5
        lo, hi = pairs[cp, e : e + 1].view(torch.int16)
        assert lo == values[((2 * cp) << kr) | e] and hi == values[((2 * cp + 1) << kr) | e]


def test_fixed_values_are_the_codebook_scaled_by_16() -> None:
    values = codebook_values("mul1")
    table = fixed_values(Codebook.MUL1, torch.device("cpu"))
    assert table.shape == (65536,) and table.dtype == torch.float16
    assert table[8643] == values[8643] * 16 and torch.equal(table.float() / 16, values.float())
    assert codebook_peak(Codebook.MUL1) == values.float().abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bits", "std", "tails"),
    [(2, 1.2, False), (2, 2.0, False), (2, 0.6, False), (2, 1.2, True), (1, 1.2, False), (3, 1.2, False)],
)
def test_kernel_arithmetic_closes_rings_at_exact_search_quality(
    one_torch_thread: None, bits: int, std: float, tails: bool
) -> None:
    """The fixed-point search (K <= 2) keeps the exact search's quality whatever the tiles' scale, and with targets
    far beyond the codebook's range (heavy tails); so does the float search packing its argmin (K = 3)."""
    x = tiles(2, seed=11, std=std)
    if tails:
        chi2 = torch.randn(2, 256, 5, generator=torch.Generator().manual_seed(5)).square().sum(-1)
        x = x * (chi2 / 5).rsqrt()  # Student-t with 5 degrees of freedom
    states = viterbi_cuda_reference(x, codebook_values("mcg"), bits)
    assert closed(states, bits)
    lut = codebook_values("mcg").float()
    exact = select_backend("cpu", "native")(x, bits, Codebook.MCG)
    mse, mse_exact = ((lut[states.long()] - x) ** 2).mean(), ((lut[exact.long()] - x) ** 2).mean()
    assert mse <= mse_exact * 1.003


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_builds_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLMQUANT_CACHE_DIR", str(tmp_path))
    library = build("90")
    assert library.is_file() and library.parent.parent == tmp_path
    assert build("90") == library  # cached by source, flags and compiler


@gpu
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("codebook", ["mcg", "3inst", "mul1"])
def test_kernel_equals_its_arithmetic_bit_for_bit(bits: int, codebook: str) -> None:
    x = tiles(3, seed=bits)
    x[1] *= 4  # many targets beyond the codebook's range (the fixed-point search's error floor)
    x[2] *= 30  # the fixed-point search scales this tile by 2 instead of 16
    x = x.cuda()
    got = viterbi_cuda(x, bits, Codebook(codebook))
    assert torch.equal(got.cpu(), viterbi_cuda_reference(x, codebook_values(codebook), bits).cpu())
    assert closed(got, bits)


@gpu
def test_kernel_quality_deterministic_and_batch_independent() -> None:
    x = tiles(300, seed=3)
    got = viterbi_cuda(x.cuda(), 2, Codebook.MCG).cpu()
    lut = codebook_values("mcg").float()
    exact = select_backend("cpu", "native")(x, 2, Codebook.MCG)
    mse, mse_exact = ((lut[got.long()] - x) ** 2).mean().item(), ((lut[exact.long()] - x) ** 2).mean().item()
    assert mse / 1.44 < 0.070 and mse <= mse_exact * 1.002
    assert torch.equal(got, viterbi_cuda(x.cuda(), 2, Codebook.MCG).cpu())
    assert torch.equal(got[17:141], viterbi_cuda(x[17:141].cuda(), 2, Codebook.MCG).cpu())


@gpu
def test_kernel_refuses_targets_beyond_fp16() -> None:
    x = tiles(2, seed=1).cuda()
    x[1, 7] = 1e5
    with pytest.raises(ValueError, match="below"):
        viterbi_cuda(x, 2, Codebook.MCG)
    x[1, 7] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        viterbi_cuda(x, 2, Codebook.MCG)


@gpu
def test_threads_on_one_stream_keep_their_own_history() -> None:
    """An encode's write-behind thread may search (retained linears) while the main thread does: interleaved
    launches on the one stream must not share the history scratch between a forward pass and its trace."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(tiles(5000, seed=11).cuda(), 2), (tiles(3000, seed=12).cuda(), 1)]  # 5000: several launches
    alone = [viterbi_cuda(x, bits, Codebook.MCG).cpu() for x, bits in jobs]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(3):
            together = [pool.submit(viterbi_cuda, x, bits, Codebook.MCG) for x, bits in jobs]
            for want, got in zip(alone, together):
                assert torch.equal(got.result().cpu(), want)
