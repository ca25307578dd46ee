"""The post-LDLQ refit of suh/svh: it lowers the Hessian-weighted error and keeps scales it cannot fit."""

from __future__ import annotations

import pytest
import torch

from glmquant.exl3 import encode_linears
from glmquant.exl3.encode import EncodedLinear
from glmquant.exl3.refit import refit_scales


def _problem(k: int = 256, n: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, k, generator=g) * torch.rand(k, generator=g).pow(2)
    h = x.T @ x / x.shape[0]
    h.diagonal().add_(0.01 * h.diagonal().mean())
    w = torch.randn(k, n, generator=g)
    return w, h, g


def _error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    e = w - wq
    return (e * (h @ e)).sum().item()


def test_refit_lowers_the_hessian_weighted_error() -> None:
    w, h, g = _problem()
    # a "quantized" weight off by per-row and per-column scale errors and noise, as the trellis leaves it
    row, col = 1 + 0.1 * torch.randn(w.shape[0], 1, generator=g), 1 + 0.1 * torch.randn(1, w.shape[1], generator=g)
    wq = (w + 0.2 * torch.randn(tuple(w.shape), generator=g)) * row * col
    su, sv = torch.ones(w.shape[0]), torch.ones(w.shape[1])
    su2, sv2 = refit_scales(w, wq, h, su, sv)
    refitted = wq * su2[:, None] * sv2[None, :]
    assert _error(w, refitted, h) < 0.8 * _error(w, wq, h)
    assert torch.isfinite(su2).all() and torch.isfinite(sv2).all()


def test_refit_keeps_the_scale_of_an_all_zero_row() -> None:
    w, h, g = _problem(seed=1)
    wq = w + 0.1 * torch.randn(tuple(w.shape), generator=g)
    wq[7] = 0.0  # the trellis decoded a whole input row to zero: no scale can fit it
    su, sv = torch.full((w.shape[0],), 0.5), torch.ones(w.shape[1])
    su2, _ = refit_scales(w, wq, h, su, sv)
    assert su2[7].item() == 0.5
    assert not torch.equal(su2, su)  # the other rows were refitted


def test_refit_of_an_all_zero_weight_keeps_every_scale() -> None:
    w, h, _ = _problem(seed=2)
    su, sv = torch.full((w.shape[0],), 0.5), torch.full((w.shape[1],), 2.0)
    su2, sv2 = refit_scales(w, torch.zeros_like(w), h, su, sv)
    assert torch.equal(su2, su) and torch.equal(sv2, sv)


def test_the_second_round_adds_little_to_the_first() -> None:
    """Why one round is the default: the second lowers the error by a small fraction of what the first did."""
    w, h, g = _problem(seed=3)
    row, col = 1 + 0.1 * torch.randn(w.shape[0], 1, generator=g), 1 + 0.1 * torch.randn(1, w.shape[1], generator=g)
    wq = (w + 0.2 * torch.randn(tuple(w.shape), generator=g)) * row * col
    su, sv = torch.ones(w.shape[0]), torch.ones(w.shape[1])
    errors = []
    for rounds in (0, 1, 2):
        su2, sv2 = refit_scales(w, wq, h, su, sv, rounds)
        errors.append(_error(w, wq * su2[:, None] * sv2[None, :], h))
    assert errors[1] < 0.8 * errors[0]
    assert 0 <= errors[1] - errors[2] < 0.02 * (errors[0] - errors[1])


def test_encoder_refit_rounds_are_checked_and_zero_skips_the_refit() -> None:
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 128, generator=g)
    x = torch.randn(512, 128, generator=g)
    hessian = x.T @ x / 512
    none, one = (encode_linear_rounds(weight, hessian, r) for r in (0, 1))
    assert one.proxy_error < none.proxy_error
    with pytest.raises(ValueError, match="refit_rounds"):
        encode_linear_rounds(weight, hessian, -1)


def encode_linear_rounds(weight: torch.Tensor, hessian: torch.Tensor, rounds: int) -> EncodedLinear:
    return encode_linears([(weight, hessian)], 2, "mcg", 0, refit_rounds=rounds)[0]
