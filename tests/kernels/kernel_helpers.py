"""Shared helpers of the kernel tests (random EXL3 tensors, exact references, error measure)."""

from __future__ import annotations

import pytest
import torch

from glmquant.exl3 import Codebook, EXL3Tensor, decode_inner


def kernel_device() -> str:
    """Where the kernels run in this session; skips the test when they cannot run at all."""
    from glmquant.runtime.kernels.availability import TRITON_AVAILABLE, interpreted

    if not TRITON_AVAILABLE:
        pytest.skip("triton is not installed (pip install triton)")
    if torch.cuda.is_available() and not interpreted():
        return "cuda"
    if interpreted():
        return "cpu"
    pytest.skip("no CUDA device and the kernels were imported without TRITON_INTERPRET=1")


def random_exl3(
    gen: torch.Generator, in_features: int, out_features: int, bits: int, codebook: str, scale: float = 1.0
) -> EXL3Tensor:
    """A valid EXL3 tensor: random trellis, random-sign scales of magnitude ~scale (suh) and ~1 (svh)."""
    kp, np_ = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    trellis = torch.randint(-32768, 32768, (kp // 16, np_ // 16, 16 * bits), generator=gen, dtype=torch.int32)

    def signed(n):
        return (torch.randint(0, 2, (n,), generator=gen) * 2 - 1) * (0.5 + torch.rand(n, generator=gen))

    return EXL3Tensor(
        trellis.to(torch.int16),
        (signed(kp) * scale).half(),
        signed(np_).half(),
        Codebook(codebook),
        in_features,
        out_features,
    )


def _block_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return torch.block_diag(*[h / 128**0.5] * (n // 128))


def exact_weight(t: EXL3Tensor) -> torch.Tensor:
    """(out, in) float64 W = diag(suh) P Q P diag(svh) from the bit-exact inner Q, without fp16 rounding steps."""
    q = decode_inner(t.trellis, t.codebook).double()
    w = t.suh.double()[:, None] * (_block_hadamard(q.shape[0]) @ q @ _block_hadamard(q.shape[1])) * t.svh.double()
    return w[: t.in_features, : t.out_features].T


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64; NaN anywhere fails."""
    got, want = got.double().cpu(), want.double().cpu()
    return float("inf") if not torch.isfinite(got).all() else ((got - want).norm() / want.norm()).item()
