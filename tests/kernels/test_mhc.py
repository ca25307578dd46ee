"""The fused mHC kernels equal the PyTorch math of `arch.glm5_next_math.hyper_enter` and `hyper_expand`: the same
roundings to the streams' dtype, fp32 sums in another order."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import torch
import triton
import triton.language as tl
from kernel_helpers import kernel_device

from glmquant.arch import glm5_next_math as math
from glmquant.runtime.kernels import mhc
from glmquant.runtime.kernels.mhc import _rounded

N, ITERS, EPS, HC_EPS = 4, 20, 1e-6, 1e-6


@triton.jit
def _rounded_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, _rounded(tl.load(x_ptr + i, mask=i < n), tl.bfloat16), mask=i < n)


def _site(tokens: int, hidden: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(hidden + tokens)
    w = (2 + N) * N
    return {
        "streams": (torch.randn(tokens, N, hidden, generator=gen) * 3).to(dtype).to(device),
        "fn": (torch.randn(w, N * hidden, generator=gen) / (N * hidden) ** 0.5 * 4).to(dtype).to(device),
        "base": (torch.randn(w, generator=gen) * 0.5).to(device),
        "scale": (torch.rand(3, generator=gen) + 0.5).to(device),
        "norm": (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device),
        "out": torch.randn(tokens, hidden, generator=gen).to(dtype).to(device),
    }


# 96, 320: partial blocks; 1100: the expand's blocks (EXPAND_BLOCK); 4096: GLM-5.3-Flash's width (64 partial
# programs, 16 warps); 70 tokens: the mix as one matrix product (PARTIALS_MAX_TOKENS)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (3, 96), (2, 320), (2, 1100), (1, 4096), (70, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_hyper_enter_and_expand_equal_the_math(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    device = kernel_device()
    s = _site(tokens, hidden, dtype, device)
    args = (s["streams"], s["fn"], s["base"], s["scale"], s["norm"], EPS, HC_EPS, ITERS)
    x, post, comb = mhc.hyper_enter(*args)
    ref_x, ref_post, ref_comb = math.hyper_enter(*args)
    assert (x.shape, x.dtype, post.shape, comb.shape) == (ref_x.shape, dtype, (tokens, N), (tokens, N, N))
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    columns = comb.sum(-2)  # the last Sinkhorn step normalizes columns
    torch.testing.assert_close(columns, torch.ones_like(columns), rtol=0, atol=1e-4)
    _assert_rounded_alike(x, ref_x)

    nxt = mhc.hyper_expand(post, comb, s["out"], s["streams"])
    ref_next = math.hyper_expand(ref_post, ref_comb, s["out"], s["streams"])
    assert (nxt.shape, nxt.dtype) == (ref_next.shape, dtype)
    _assert_rounded_alike(nxt, ref_next)


def _assert_rounded_alike(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal but where a sum in another fp32 order lands on the other side of a rounding step: then by at most
    three steps of the dtype (the collapse, the normalization and the weight each round once), on a few elements."""
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        return
    a, b = ours.float(), theirs.float()
    ulp = torch.finfo(ours.dtype).eps * torch.maximum(a.abs(), b.abs()).clamp_min(1e-3)
    assert bool(((a - b).abs() <= 3 * ulp).all())
    assert float((a != b).float().mean()) < 0.01


def test_fused_hyper_enter_batches_leading_dimensions() -> None:
    """[B, S, N, H] streams (a verify step's shape) give the rows of their flattening."""
    device = kernel_device()
    s = _site(6, 64, torch.float32, device)
    rest = (s["fn"], s["base"], s["scale"], s["norm"], EPS, HC_EPS, ITERS)
    x, post, comb = mhc.hyper_enter(s["streams"].view(2, 3, N, 64), *rest)
    flat = mhc.hyper_enter(s["streams"], *rest)
    assert (x.shape, post.shape, comb.shape) == ((2, 3, 64), (2, 3, N), (2, 3, N, N))
    for batched, rows in zip((x, post, comb), flat, strict=True):
        torch.testing.assert_close(batched.flatten(0, 1), rows, rtol=0, atol=0)
    nxt = mhc.hyper_expand(post, comb, s["out"].view(2, 3, 64), s["streams"].view(2, 3, N, 64))
    torch.testing.assert_close(nxt.flatten(0, 1), mhc.hyper_expand(*flat[1:], s["out"], s["streams"]), rtol=0, atol=0)


def test_a_nan_in_the_streams_stays_nan() -> None:
    """A diverged stream must show as NaN downstream, as in PyTorch, not be rounded into a number."""
    device = kernel_device()
    s = _site(1, 64, torch.bfloat16, device)
    streams = s["streams"].clone()
    streams[0, 1, 5] = float("nan")
    x, post, comb = mhc.hyper_enter(streams, s["fn"], s["base"], s["scale"], s["norm"], EPS, HC_EPS, ITERS)
    assert bool(x.isnan().all())  # the mix and the RMS see every column
    nxt = mhc.hyper_expand(post, comb, s["out"], streams)
    assert bool(nxt.isnan().all())


def test_bf16_rounding_by_bits_matches_torch_and_keeps_nans() -> None:
    """`_rounded` against torch's BF16 cast: ties to even, both signs, subnormals, overflow to inf, and NaN bit
    patterns whose low bits would carry into the exponent (CUDA's canonical 0x7FFFFFFF among them)."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(0)
    finite = torch.cat([torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-40, 39, (4000,), generator=gen)])
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895e38, 1e-40])  # ties, overflow, subnormal
    nan_bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32)  # -1: 0xFFFFFFFF
    x = torch.cat([finite, ties, nan_bits.view(torch.float32)]).to(device)
    y = torch.empty_like(x)
    _rounded_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(torch.bfloat16).float()
    assert bool(y[-4:].isnan().all())
    torch.testing.assert_close(y[:-4], expected[:-4], rtol=0, atol=0)
