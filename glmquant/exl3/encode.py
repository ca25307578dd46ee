"""encode_linear(s): ExLlamaV3 1.6.5's EXL3 encoder (regularize, scale search, LDLQ + Viterbi, refit, pack)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glmquant.exl3.backends import TileSearch, quantize_tiles, select_backend
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.decode import decode_weight
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.hessian import PreparedHessian, pad_hessian, prepare_hessian
from glmquant.exl3.ldlq import ldlq
from glmquant.exl3.refit import refit_scales
from glmquant.errors import NumericalError
from glmquant.exl3.regularize import LDLQ_DRIFT, balance_scales, regularize, sample_tiles
from glmquant.exl3.scale_search import search_scales
from glmquant.exl3.tensor import EXL3Tensor, padded
from glmquant.exl3.trellis import pack_trellis


FP16_MAX = 65504.0
FP16_SMALLEST_RMS = 2.0**-17  # a weight this small keeps ~1 % precision in float16's subnormals; smaller, less


@dataclass(frozen=True)
class EncodedLinear:
    """An encoded linear with its proxy error tr(E H E^T)/tr(W H W^T) (H = identity on a fallback)."""

    tensor: EXL3Tensor
    proxy_error: float
    # None, "no_hessian", "nonfinite_hessian", "negative_hessian", "zero_hessian", "cholesky_retry:N", "cholesky_failed"
    fallback: str | None


@dataclass
class _Job:
    """One tensor's state between the encoder's stages (EXL3 orientation, padded)."""

    weight: torch.Tensor  # HF (out, in) as given, for the proxy error
    hessian: torch.Tensor | None  # as given
    w: torch.Tensor  # [k, n] fp32 original
    prep: PreparedHessian
    w_reg: torch.Tensor  # [k, n] regularized
    su: torch.Tensor  # [k]
    sv: torch.Tensor  # [n]


def proxy_error(weight_hf: torch.Tensor, decoded_hf: torch.Tensor, hessian: torch.Tensor | None) -> float:
    """tr(E H E^T) / tr(W H W^T) for HF-orientation weights; the relative squared error without H."""
    w = weight_hf.float()
    e = w - decoded_hf.to(w.device).float()
    if hessian is None:
        return (e.double().square().sum() / w.double().square().sum().clamp(min=1e-30)).item()
    h = hessian.to(w.device).float()
    num = ((e @ h) * e).double().sum()
    den = ((w @ h) * w).double().sum()
    return (num / den.clamp(min=1e-30)).item()


def _signs(count: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(count, generator=generator).sign() + 1e-5).sign()


def _prepare(
    weight: torch.Tensor, hessian: torch.Tensor | None, seed: int, device: torch.device, shared: dict[int, PreparedHessian]
) -> _Job:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor (out_features, in_features), got {weight.dtype} {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"weight {tuple(weight.shape)} has no elements; EXL3 encodes a non-empty matrix")
    if not torch.isfinite(weight).all():
        raise ValueError(f"weight {tuple(weight.shape)} contains NaN or Inf values; EXL3 cannot encode it")
    _check_fp16_range(weight)
    out_f, in_f = weight.shape
    if hessian is not None and tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(f"hessian must have shape ({in_f}, {in_f}) for a weight of shape {tuple(weight.shape)}, got {tuple(hessian.shape)}")
    k, n = padded(in_f), padded(out_f)
    w = torch.zeros((k, n), dtype=torch.float32, device=device)
    w[:in_f, :out_f] = weight.to(device=device, dtype=torch.float32).T
    gen = torch.Generator().manual_seed(seed)  # CPU draws: identical signs on every device
    su_signs, sv_signs = _signs(k, gen).to(device), _signs(n, gen).to(device)
    # Tensors passing the same Hessian object (gate/up of all experts) share its factorization:
    # the seed fixes the signs, so it would come out identical anyway.
    if hessian is None:
        prep = prepare_hessian(None, su_signs)
    elif id(hessian) in shared:
        prep = shared[id(hessian)]
    else:
        prep = shared[id(hessian)] = prepare_hessian(pad_hessian(hessian, k, device), su_signs)
    w_reg, su, sv = regularize(w, su_signs, sv_signs)
    return _Job(weight, hessian, w, prep, w_reg, su, sv)


def _check_fp16_range(weight: torch.Tensor) -> None:
    """EXL3 decodes in float16: a weight beyond its range, or below what it resolves, cannot be stored."""
    w = weight.detach().float()
    peak, rms = w.abs().max().item(), w.square().mean().sqrt().item()
    if peak >= FP16_MAX:
        raise NumericalError(f"weight {tuple(weight.shape)} reaches |w| = {peak:.4g}, beyond the float16 range "
                             f"(65,504) that EXL3 decodes in; rescale the model's weights before encoding")
    if 0 < rms < FP16_SMALLEST_RMS:
        raise NumericalError(f"weight {tuple(weight.shape)} has RMS {rms:.3g}, below what float16 (which EXL3 decodes "
                             f"in) resolves: it would decode to mostly zeros")


def _finish(job: _Job, q: torch.Tensor, states: torch.Tensor, bits: int, codebook: Codebook) -> EncodedLinear:
    su, sv = job.su, job.sv
    if job.prep.hessian is not None:
        wq = had_right(had_left(q) * su[:, None]) * sv[None, :]
        su, sv = refit_scales(job.w, wq, job.prep.hessian, su, sv)
    su, sv = balance_scales(su, sv)
    out_f, in_f = job.weight.shape
    tensor = EXL3Tensor(pack_trellis(states, bits).cpu(), su.half().cpu(), sv.half().cpu(), codebook, in_f, out_f)
    decoded = decode_weight(tensor, torch.float32)
    if not torch.isfinite(decoded).all():
        raise NumericalError(f"weight {tuple(job.weight.shape)} decodes to non-finite values in float16")
    used = job.hessian if job.prep.ldl is not None else None
    return EncodedLinear(tensor, proxy_error(job.weight, decoded, used), job.prep.fallback)


def encode_linears(
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    bits: int,
    codebook: Codebook | str = Codebook.MCG,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> list[EncodedLinear]:
    """Encode several (HF weight, Hessian or None) pairs; their Viterbi searches share backend calls.

    Each result equals encode_linear on that pair alone. backend: None (best for device), "native",
    "torch" or "exllamav3".
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    if not items:
        return []
    codebook, dev = Codebook(codebook), torch.device(device)
    search: TileSearch = select_backend(dev, backend)

    def values(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_tiles(search, tiles, bits, codebook)

    shared: dict[int, PreparedHessian] = {}
    jobs = [_prepare(w, h, seed, dev, shared) for w, h in items]
    drift = LDLQ_DRIFT.get(bits, 1.0)
    scales = search_scales([sample_tiles(j.w_reg) * drift for j in jobs], lambda t: values(t)[0])
    for job, g in zip(jobs, scales):
        job.w_reg *= g
        job.su = job.su / g
    results = ldlq([(j.w_reg, j.prep.ldl) for j in jobs], values)
    return [_finish(j, q, s, bits, codebook) for j, (q, s) in zip(jobs, results)]


def encode_linear(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    bits: int,
    codebook: Codebook | str = Codebook.MCG,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    backend: str | None = None,
) -> EncodedLinear:
    """Encode one HF-orientation (out, in) weight; hessian is E[x x^T] (in, in) or None (uncalibrated).

    Deterministic: the same inputs and seed give bit-identical output on the CPU.
    """
    return encode_linears([(weight, hessian)], bits, codebook, seed, device=device, backend=backend)[0]
