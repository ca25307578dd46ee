import pytest
import torch

from glmquant.errors import NumericalError
from glmquant.exl3 import (
    Codebook,
    EXL3Tensor,
    decode_weight,
    encode_linear,
    encode_linears,
    proxy_error,
)
from glmquant.exl3.native import load_kernel

CASES = [f"{cb}.K{k}" for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)]


@pytest.fixture(scope="module", autouse=True)
def fast_backend():
    if load_kernel() is None:
        pytest.skip("encoder tests need the native Viterbi kernel (no C++ compiler here)")


def correlated(out_f: int, in_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and a realistic, ill-conditioned Hessian from correlated activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * in_f, in_f, generator=g) @ (torch.randn(in_f, in_f, generator=g) / in_f**0.5)
    x[:, : in_f // 8] *= 8.0  # a few outlier channels
    return torch.randn(out_f, in_f, generator=g) * 0.02, x.T @ x / x.shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("tag", CASES)
def test_golden_proxy_error_on_par_with_exllamav3(golden, golden_meta, tag: str) -> None:
    codebook, bits = tag.split(".K")
    w, h = golden[f"{tag}.W"].T, golden[f"{tag}.H"]  # golden W is (in, out)
    result = encode_linear(w, h, int(bits), codebook, seed=0)
    reference = golden_meta[f"golden.{tag}"]["proxy_err"]
    assert result.fallback is None
    assert result.proxy_error <= 1.03 * reference
    assert result.proxy_error > 0.8 * reference  # a far better figure would mean a broken measurement
    assert result.proxy_error == pytest.approx(proxy_error(w, decode_weight(result.tensor, torch.float32), h))


@pytest.mark.slow
def test_gaussian_source_mse_at_two_bits() -> None:
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    result = encode_linear(w, torch.eye(256), 2, Codebook.MCG)
    mse = (decode_weight(result.tensor, torch.float32) - w).square().mean() / w.var()
    assert mse.item() <= 0.071  # QTIP ~0.069, rate-distortion bound 0.0625
    assert result.proxy_error == pytest.approx(mse.item(), rel=0.02)


@pytest.mark.slow
def test_encoding_is_deterministic_and_seeded() -> None:
    w, h = correlated(128, 128)
    a, b = encode_linear(w, h, 3, "3inst", seed=7), encode_linear(w, h, 3, "3inst", seed=7)
    for x, y in zip(a.tensor.tensors("p").values(), b.tensor.tensors("p").values()):
        assert torch.equal(x, y)
    c = encode_linear(w, h, 3, "3inst", seed=8)
    assert not torch.equal(a.tensor.suh.abs(), c.tensor.suh.abs()) or not torch.equal(
        a.tensor.trellis, c.tensor.trellis
    )


@pytest.mark.slow
def test_batch_equals_one_by_one_and_handles_shapes_and_fallbacks() -> None:
    (w1, h1), (w2, _) = correlated(128, 256, seed=1), correlated(200, 100, seed=2)
    items = [(w1, h1), (w2, None)]
    batch = encode_linears(items, 2, Codebook.MUL1, seed=3)
    for (w, h), got in zip(items, batch):
        alone = encode_linear(w, h, 2, Codebook.MUL1, seed=3)
        assert torch.equal(got.tensor.trellis, alone.tensor.trellis) and torch.equal(got.tensor.svh, alone.tensor.svh)
        assert got.proxy_error == alone.proxy_error
    odd = batch[1]
    assert odd.fallback == "no_hessian"
    assert odd.tensor.trellis.shape == (128 // 16, 256 // 16, 32)  # (100, 200) padded to (128, 256)
    assert decode_weight(odd.tensor).shape == (200, 100)
    assert odd.proxy_error < 0.09  # identity metric: relative squared error


@pytest.mark.slow
def test_ldlq_uses_the_hessian() -> None:
    w, h = correlated(128, 256, seed=5)
    calibrated = encode_linear(w, h, 2, seed=1)
    blind = encode_linear(w, None, 2, seed=1)
    assert calibrated.fallback is None
    assert calibrated.proxy_error < 0.8 * proxy_error(w, decode_weight(blind.tensor, torch.float32), h)


@pytest.mark.slow
def test_hessian_fallbacks() -> None:
    w, h = correlated(128, 128, seed=6)
    nan = h.clone()
    nan[3, 5] = float("nan")
    assert encode_linear(w, nan, 2).fallback == "nonfinite_hessian"
    assert encode_linear(w, torch.zeros_like(h), 2).fallback == "zero_hessian"
    v = torch.zeros(128)
    v[0] = 1.0
    mildly_indefinite = torch.eye(128) - 1.1 * torch.outer(v, v)  # eigenvalue -0.1: damping alone is short
    result = encode_linear(w, mildly_indefinite, 2)
    assert result.fallback is not None and result.fallback.startswith("cholesky_retry:")
    hopeless = torch.eye(128) - 100.0 * torch.outer(v, v)
    failed = encode_linear(w, hopeless, 2)
    assert failed.fallback == "cholesky_failed" and failed.proxy_error < 0.09


def test_invalid_inputs_raise() -> None:
    w = torch.randn(128, 128)
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_linear(bad, None, 2)
    with pytest.raises(ValueError, match="hessian must have shape"):
        encode_linear(w, torch.eye(64), 2)
    with pytest.raises(ValueError, match="bits must be 1..8"):
        encode_linear(w, None, 9)
    with pytest.raises(ValueError):
        encode_linear(w, None, 2, "nf4")


@pytest.mark.slow
def test_zero_weight_encodes_to_zero() -> None:
    result = encode_linear(torch.zeros(128, 256), torch.eye(256), 2)
    assert torch.count_nonzero(decode_weight(result.tensor)) == 0
    assert isinstance(result.tensor, EXL3Tensor)


@pytest.mark.gpu
def test_cuda_encoder_matches_cpu_quality() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w, h = correlated(128, 256, seed=9)
    cpu = encode_linear(w, h, 2, seed=2)
    gpu = encode_linear(w, h, 2, seed=2, device="cuda")
    assert gpu.tensor.trellis.device.type == "cpu"  # stored tensors always come back on the CPU
    assert gpu.proxy_error == pytest.approx(cpu.proxy_error, rel=0.03)


@pytest.mark.gpu
def test_cuda_encoder_repeats_its_bytes() -> None:
    """On a GPU too the same inputs give the same bytes (the scale search averages without atomics)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    items = [correlated(128, 256, seed=s) for s in (9, 10, 11)]
    first, second = (encode_linears(items, 2, "mcg", 3, device="cuda") for _ in range(2))
    for a, b in zip(first, second):
        for x, y in zip(a.tensor.tensors("p").values(), b.tensor.tensors("p").values()):
            assert torch.equal(x, y)


@pytest.mark.gpu
def test_cuda_encodes_from_two_threads_equal_sequential_ones() -> None:
    """An encode's write-behind thread may encode (retained linears) while the main thread encodes a unit: the
    device lock runs them one at a time, and each gives the bytes it gives alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from concurrent.futures import ThreadPoolExecutor

    batches = [[correlated(128, 256, seed=s) for s in (9, 10)], [correlated(256, 128, seed=s) for s in (12, 13)]]
    alone = [encode_linears(b, 2, "mcg", 3, device="cuda") for b in batches]
    with ThreadPoolExecutor(max_workers=2) as pool:
        together = [f.result() for f in [pool.submit(encode_linears, b, 2, "mcg", 3, device="cuda") for b in batches]]
    for want, got in zip(alone, together):
        for a, b in zip(want, got):
            for x, y in zip(a.tensor.tensors("p").values(), b.tensor.tensors("p").values()):
                assert torch.equal(x, y)


def test_gpu_encodes_take_turns_on_one_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device lock, without a GPU: 'cuda' and 'cuda:<current>' share one lock, so two threads' encodes on one
    GPU never overlap, while two GPUs' encodes do."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import glmquant.exl3.encode as encode

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(encode, "select_backend", lambda dev, backend: None)
    assert encode._device_lock(torch.device("cuda")) is encode._device_lock(torch.device("cuda:0"))
    assert encode._device_lock(torch.device("cuda:1")) is not encode._device_lock(torch.device("cuda:0"))
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    guard = threading.Lock()

    def slow_encode(
        items: list, bits: int, codebook: object, seed: int, dev: torch.device, *rest: object
    ) -> list[None]:
        key = str(torch.device("cuda", dev.index if dev.index is not None else 0))
        with guard:
            running[key] = running.get(key, 0) + 1
            most[key] = max(most.get(key, 0), running[key])
        time.sleep(0.2)
        with guard:
            running[key] -= 1
        return [None] * len(items)  # a stand-in result per item

    monkeypatch.setattr(encode, "_encode_linears", slow_encode)
    item = [(torch.zeros(128, 256), None)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for f in [pool.submit(encode_linears, item, 2, device=d) for d in ("cuda", "cuda:0", "cuda:1", "cuda:1")]:
            f.result()
    assert most == {"cuda:0": 1, "cuda:1": 1}
    meet = threading.Barrier(2, timeout=30)  # passes only if both encodes are inside at once
    monkeypatch.setattr(encode, "_encode_linears", lambda items, *args: (meet.wait(), [None] * len(items))[1])
    for devices in (("cuda:0", "cuda:1"), ("cpu", "cpu")):  # other GPUs, and the CPU, take no common lock
        with ThreadPoolExecutor(max_workers=2) as pool:
            for f in [pool.submit(encode_linears, item, 2, device=d) for d in devices]:
                f.result()


@pytest.mark.slow
def test_weights_beyond_float16_are_refused_or_rebalanced() -> None:
    """EXL3 decodes in float16: scales are rebalanced by a power of two so weights of RMS 1e-5..1e4 keep their
    quality; weights float16 cannot hold are refused with an error instead of decoding to NaN or zeros."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g)
    reference = encode_linear(w, None, 2).proxy_error
    for scale in (1e4, 1e-5):
        result = encode_linear(w * scale, None, 2)
        assert torch.isfinite(decode_weight(result.tensor, torch.float32)).all()
        assert result.proxy_error == pytest.approx(reference, rel=0.02), scale
    with pytest.raises(NumericalError, match=r"reaches \|w\| = .*beyond the float16 range"):
        encode_linear(w * 3e4, None, 2)
    with pytest.raises(NumericalError, match="below what float16"):
        encode_linear(w * 1e-7, None, 2)
    assert encode_linear(torch.zeros(128, 256), None, 2).proxy_error == 0.0  # exactly zero is representable


@pytest.mark.slow
def test_degenerate_inputs_are_named() -> None:
    w, h = correlated(128, 128, seed=7)
    assert encode_linear(w, -h, 2).fallback == "negative_hessian"
    assert encode_linear(w, torch.zeros_like(h), 2).fallback == "zero_hessian"
    with pytest.raises(ValueError, match="has no elements"):
        encode_linear(torch.randn(0, 256), None, 2)
    tensor = encode_linear(w, None, 2).tensor
    parts = tensor.tensors("x")
    parts["x.suh"] = parts["x.suh"].clone()
    parts["x.suh"][5] = float("nan")
    with pytest.raises(ValueError, match="x.suh contains NaN or Inf"):
        EXL3Tensor.from_tensors(parts, "x", 128, 128)
    if torch.cuda.is_available():  # a checkpoint loaded straight onto a GPU is checked as well
        on_gpu = {name: part.cuda() for name, part in parts.items()}
        with pytest.raises(ValueError, match="x.suh contains NaN or Inf"):
            EXL3Tensor.from_tensors(on_gpu, "x", 128, 128)
    with pytest.raises(NumericalError, match="reaches \\|w\\| = 1e\\+300, beyond the float16 range"):
        encode_linear(torch.full((128, 256), 1e300, dtype=torch.float64), None, 2)
