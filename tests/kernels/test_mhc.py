"""The fused mHC kernel equals the PyTorch math of `arch.glm5_next_math.hyper_weights` (fp32 rounding)."""

from __future__ import annotations

import torch
from kernel_helpers import kernel_device

from glmquant.arch.glm5_next_math import hyper_weights


def test_fused_hyper_weights_equal_the_reference() -> None:
    device = kernel_device()
    from glmquant.runtime.kernels.mhc import hyper_weights as fused

    gen = torch.Generator().manual_seed(0)
    n, tokens = 4, 37  # more than one program of rows, a partial last one
    mix = (torch.randn(3, tokens, (2 + n) * n, generator=gen) * 2).to(device)
    base = (torch.randn((2 + n) * n, generator=gen) * 0.5).to(device)
    scale = (torch.rand(3, generator=gen) + 0.5).to(device)
    expected = hyper_weights(mix, base, scale, n, 1e-6, 20)
    got = fused(mix, base, scale, n, 1e-6, 20)
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    columns = got[2].sum(-2)  # the last Sinkhorn step normalizes columns
    torch.testing.assert_close(columns, torch.ones_like(columns), rtol=0, atol=1e-4)
