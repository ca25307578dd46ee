"""encode_linear(s): ExLlamaV3 1.6.5's EXL3 encoder (regularize, scale search, LDLQ + Viterbi, refit, pack)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from glmquant.environment import encode_memo_dir
from glmquant.errors import NumericalError
from glmquant.exl3.backends import TileSearch, quantize_tiles, select_backend
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.decode import decode_weight
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.hessian import PreparedHessian, pad_hessian, prepare_hessian
from glmquant.exl3.ldlq import ldlq
from glmquant.exl3.memo import EncodeMemo
from glmquant.exl3.refit import REFIT_ROUNDS, refit_scales
from glmquant.exl3.regularize import LDLQ_DRIFT, balance_scales, regularize, sample_tiles
from glmquant.exl3.scale_search import DEFAULT_SEARCH, ScaleSearch, search_scales
from glmquant.exl3.tensor import EXL3Tensor, padded
from glmquant.exl3.timing import stage
from glmquant.exl3.trellis import pack_trellis

FP16_MAX = 65504.0
FP16_SMALLEST_RMS = 2.0**-17  # a weight this small keeps ~1 % precision in float16's subnormals; smaller, less


@dataclass(frozen=True)
class EncodedLinear:
    """An encoded linear with its proxy error tr(E H E^T)/tr(W H W^T) (H = identity on an uncalibrated fallback)."""

    tensor: EXL3Tensor
    proxy_error: float
    # None, "no_hessian", "nonfinite_hessian", "negative_hessian", "zero_hessian", "cholesky_retry:N", "cholesky_failed"
    fallback: str | None
    calibrated: bool = True  # encoded with its Hessian (the proxy error is in its metric), not uncalibrated

    def with_tensor(
        self, tensor: EXL3Tensor, weight_hf: torch.Tensor, hessian: torch.Tensor | None, device: torch.device
    ) -> EncodedLinear | None:
        """This encode with `tensor` stored instead (the same codes, other scales), its proxy error measured as the
        encoder measures it, decoded on `device`; None when `tensor` decodes to non-finite values in float16."""
        decoded = decode_weight(tensor.to(device), torch.float32)
        if not torch.isfinite(decoded).all():
            return None
        error = proxy_error(weight_hf, decoded, hessian if self.calibrated else None)
        return EncodedLinear(tensor, error, self.fallback, self.calibrated)


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
    return proxy_error_on_device(weight_hf, decoded_hf, hessian).item()


def proxy_error_on_device(
    weight_hf: torch.Tensor, decoded_hf: torch.Tensor, hessian: torch.Tensor | None
) -> torch.Tensor:
    """proxy_error as a 0-d float64 tensor on the weight's device (no host sync)."""
    w = weight_hf.float()
    e = w - decoded_hf.to(w.device).float()
    if hessian is None:
        return e.double().square().sum() / w.double().square().sum().clamp(min=1e-30)
    h = hessian.to(w.device).float()
    num = ((e @ h) * e).double().sum()
    den = ((w @ h) * w).double().sum()
    return num / den.clamp(min=1e-30)


def _signs(count: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(count, generator=generator).sign() + 1e-5).sign()


def _check_weights(weights: Sequence[torch.Tensor]) -> None:
    """Every weight is a non-empty finite 2-D float matrix that float16 (which EXL3 decodes in) can hold; the
    statistics of all of them are read back in one transfer per device."""
    for weight in weights:
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"weight must be a 2-D float tensor (out_features, in_features), got {weight.dtype} "
                f"{tuple(weight.shape)}"
            )
        if weight.numel() == 0:
            raise ValueError(f"weight {tuple(weight.shape)} has no elements; EXL3 encodes a non-empty matrix")
    by_device: dict[torch.device, list[int]] = {}
    for i, weight in enumerate(weights):
        by_device.setdefault(weight.device, []).append(i)
    stats: dict[int, list[float]] = {}
    for members in by_device.values():
        rows = []
        for i in members:
            w = weights[i].detach()  # finiteness and peak in the weight's own dtype: float32 overflows a huge float64
            rows.append(
                torch.stack(
                    (
                        torch.isfinite(w).all().double(),
                        w.abs().max().double(),
                        w.float().square().mean().sqrt().double(),
                    )
                )
            )
        stats.update(zip(members, torch.stack(rows).tolist()))
    for i, weight in enumerate(weights):
        finite, peak, rms = stats[i]
        if not finite:
            raise ValueError(f"weight {tuple(weight.shape)} contains NaN or Inf values; EXL3 cannot encode it")
        if peak >= FP16_MAX:
            raise NumericalError(
                f"weight {tuple(weight.shape)} reaches |w| = {peak:.4g}, beyond the float16 range "
                f"(65,504) that EXL3 decodes in; rescale the model's weights before encoding"
            )
        if 0 < rms < FP16_SMALLEST_RMS:
            raise NumericalError(
                f"weight {tuple(weight.shape)} has RMS {rms:.3g}, below what float16 (which EXL3 decodes "
                f"in) resolves: it would decode to mostly zeros"
            )


def _prepare(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    seed: int,
    device: torch.device,
    shared: dict[int, PreparedHessian],
) -> _Job:
    """One checked weight (_check_weights) padded, regularized, with its Hessian factored (or shared)."""
    out_f, in_f = weight.shape
    if hessian is not None and tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(
            f"hessian must have shape ({in_f}, {in_f}) for a weight of shape {tuple(weight.shape)}, "
            f"got {tuple(hessian.shape)}"
        )
    k, n = padded(in_f), padded(out_f)
    w = torch.zeros((k, n), dtype=torch.float32, device=device)
    w[:in_f, :out_f] = weight.to(device=device, dtype=torch.float32).T
    gen = torch.Generator().manual_seed(seed)  # CPU draws: identical signs on every device
    signs = torch.cat((_signs(k, gen), _signs(n, gen)))
    if device.type == "cuda":  # from pinned memory the copy does not wait for the GPU
        signs = signs.pin_memory().to(device, non_blocking=True)
    su_signs, sv_signs = signs[:k], signs[k:]
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


@dataclass
class _Finished:
    """One encode still on the device: its proxy error and whether it decodes finite, read back for all at once."""

    tensor: EXL3Tensor
    error: torch.Tensor  # 0-d
    finite: torch.Tensor  # 0-d bool
    fallback: str | None
    calibrated: bool


def _finish(
    job: _Job, q: torch.Tensor, states: torch.Tensor, bits: int, codebook: Codebook, refit_rounds: int
) -> _Finished:
    """Refit, pack, decode and measure one tensor, queueing GPU work only (no host sync)."""
    su, sv = job.su, job.sv
    if job.prep.hessian is not None and refit_rounds > 0:
        with stage("finish.refit", job.w.device):
            wq = had_right(had_left(q) * su[:, None]) * sv[None, :]
            su, sv = refit_scales(job.w, wq, job.prep.hessian, su, sv, refit_rounds)
    su, sv = balance_scales(su, sv)
    out_f, in_f = job.weight.shape
    on_device = EXL3Tensor(pack_trellis(states, bits), su.half(), sv.half(), codebook, in_f, out_f)
    decoded = decode_weight(on_device, torch.float32)  # decoded where it was encoded
    calibrated = job.prep.ldl is not None
    weight = job.w[:in_f, :out_f].T  # the given weight in float32, on the encoding device like every result
    error = proxy_error_on_device(weight, decoded, job.hessian if calibrated else None)
    return _Finished(on_device, error, torch.isfinite(decoded).all(), job.prep.fallback, calibrated)


def _collect(finished: list[_Finished]) -> list[EncodedLinear]:
    """Read every proxy error and finiteness flag back in one transfer; then the tensors, to the CPU."""
    errors = torch.stack([f.error.double() for f in finished]).tolist()
    finite = torch.stack([f.finite for f in finished]).tolist()
    for f, ok in zip(finished, finite):
        if not ok:
            shape = (f.tensor.out_features, f.tensor.in_features)
            raise NumericalError(f"weight {shape} decodes to non-finite values in float16")
    return [EncodedLinear(f.tensor.to("cpu"), e, f.fallback, f.calibrated) for f, e in zip(finished, errors)]


def encode_linears(
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    bits: int,
    codebook: Codebook | str = Codebook.MCG,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    scale_search: ScaleSearch = DEFAULT_SEARCH,
    refit_rounds: int = REFIT_ROUNDS,
) -> list[EncodedLinear]:
    """Encode several (HF weight, Hessian or None) pairs; their Viterbi searches share backend calls.

    Each result equals encode_linear on that pair alone. backend: None (best for device), "native",
    "torch", "cuda" or "exllamav3". refit_rounds: rounds of the post-LDLQ scale refit (0: none).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    if refit_rounds < 0:
        raise ValueError(f"refit_rounds must be >= 0, got {refit_rounds}")
    if not items:
        return []
    codebook, dev = Codebook(codebook), torch.device(device)
    search = select_backend(dev, backend)
    memo_dir = encode_memo_dir()  # None unless $GLMQUANT_ENCODE_MEMO is set
    settings = {
        "bits": bits,
        "codebook": codebook.value,
        "seed": seed,
        "scale_search": repr(scale_search),
        "refit_rounds": refit_rounds,
    }
    memo = None if memo_dir is None else EncodeMemo(memo_dir, settings, dev, search)
    keys = memo.keys(items) if memo is not None else []
    kept = [memo.get(key) for key in keys] if memo is not None else [None] * len(items)
    out = [None if entry is None else EncodedLinear(*entry) for entry in kept]
    todo = [i for i, result in enumerate(out) if result is None]
    if todo:
        with _device_lock(dev):
            encoded = _encode_linears(
                [items[i] for i in todo], bits, codebook, seed, dev, search, scale_search, refit_rounds
            )
        for i, result in zip(todo, encoded, strict=True):
            out[i] = result
            if memo is not None:
                memo.put(keys[i], result.tensor, result.proxy_error, result.fallback, result.calibrated)
    return cast(list[EncodedLinear], out)  # every place filled: a kept encode or a new one


_GPU_LOCKS: dict[torch.device, threading.Lock] = {}


def _device_lock(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """One encode at a time per GPU: an encode's write-behind thread encodes retained linears while it assembles a
    layer's files (the ExLlamaV3 layout), and beside the main thread's unit that would hold two encodes' buffers at
    once. The CPU runs them side by side."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _GPU_LOCKS.setdefault(torch.device("cuda", index), threading.Lock())


def _encode_linears(
    items: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    bits: int,
    codebook: Codebook,
    seed: int,
    dev: torch.device,
    search: TileSearch,
    scale_search: ScaleSearch,
    refit_rounds: int,
) -> list[EncodedLinear]:
    """encode_linears' work, holding the device's lock."""

    def values(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with stage("viterbi", dev):
            return quantize_tiles(search, tiles, bits, codebook)

    shared: dict[int, PreparedHessian] = {}
    with stage("prepare", dev):
        _check_weights([w for w, _ in items])
        jobs = [_prepare(w, h, seed, dev, shared) for w, h in items]
    drift = LDLQ_DRIFT.get(bits, 1.0)
    with stage("scale_search", dev):
        scales = search_scales(
            [sample_tiles(j.w_reg, scale_search.band_width) * drift for j in jobs], lambda t: values(t)[0], scale_search
        )
    for job, g in zip(jobs, scales):
        job.w_reg *= g
        job.su = job.su / g
    with stage("ldlq", dev):
        results = _ldlq_jobs(jobs, values)
    with stage("finish", dev):
        return _collect([_finish(j, q, s, bits, codebook, refit_rounds) for j, (q, s) in zip(jobs, results)])


def _ldlq_jobs(
    jobs: list[_Job],
    values: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LDLQ of every job in one set of stacks: jobs sharing a factorization become one [k, sum n] problem (LDLQ
    treats columns independently), and problems of one shape are stacked, so each step is one batched matmul
    per shape and one Viterbi call for all."""
    by_factor: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        by_factor.setdefault(id(job.prep), []).append(i)
    by_shape: dict[tuple[int, int, bool], list[list[int]]] = {}
    for members in by_factor.values():
        first = jobs[members[0]]
        key = (first.w_reg.shape[0], sum(jobs[i].w_reg.shape[1] for i in members), first.prep.ldl is not None)
        by_shape.setdefault(key, []).append(members)
    stacks = []
    for shape in by_shape.values():
        weights = torch.stack([torch.cat([jobs[i].w_reg for i in members], dim=1) for members in shape])
        # a shape's jobs all have a factor or none (the key says which)
        factors = [ldl for members in shape if (ldl := jobs[members[0]].prep.ldl) is not None]
        stacks.append((weights, torch.stack(factors) if factors else None))
    out: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty(0), torch.empty(0))] * len(jobs)
    for shape, (q, states) in zip(by_shape.values(), ldlq(stacks, values)):
        for g, members in enumerate(shape):
            col = 0
            for i in members:
                n = jobs[i].w_reg.shape[1]
                out[i] = (q[g, :, col : col + n], states[g, :, col // 16 : (col + n) // 16])
                col += n
    return out


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
