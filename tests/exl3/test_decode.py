import pytest
import torch

from glmquant.exl3 import Codebook, EXL3Tensor, decode_inner, decode_weight

CASES = [f"{cb}.K{k}" for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)]


def case_args(tag: str) -> tuple[str, int]:
    codebook, bits = tag.split(".K")
    return codebook, int(bits)


@pytest.mark.parametrize("tag", CASES)
def test_golden_inner_weight_is_bit_exact(golden, tag: str) -> None:
    q = decode_inner(golden[f"{tag}.trellis"], case_args(tag)[0])
    assert q.dtype == torch.float16 and q.shape == (256, 128)
    assert torch.equal(q.view(torch.int16), golden[f"{tag}.Q"].view(torch.int16))


@pytest.mark.parametrize("tag", CASES)
def test_golden_reconstruction_and_matmul(golden, tag: str) -> None:
    t = EXL3Tensor.from_tensors(golden, tag, in_features=256, out_features=128)
    assert t.codebook is Codebook(case_args(tag)[0]) and t.bits == case_args(tag)[1]
    w = decode_weight(t, torch.float32)  # HF orientation (out, in)
    recon = golden[f"{tag}.recon"].T
    assert w.shape == (128, 256)
    torch.testing.assert_close(w, recon, rtol=2e-3, atol=1e-5)  # fp16 rounding of the product steps
    y = golden[f"{tag}.x"].float() @ w.T
    torch.testing.assert_close(y, golden[f"{tag}.y"], rtol=0, atol=3e-3 * golden[f"{tag}.y"].abs().max().item())


@pytest.mark.parametrize("tag", ["3inst.K2", "mcg.K3", "mul1.K4"])
def test_tensors_round_trip_with_marker(golden, tag: str) -> None:
    t = EXL3Tensor.from_tensors(golden, tag, 256, 128)
    stored = t.tensors("model.proj")
    back = EXL3Tensor.from_tensors(stored, "model.proj", 256, 128)
    assert back.codebook is t.codebook and torch.equal(back.trellis, t.trellis)
    marker = {k: v for k, v in stored.items() if k.endswith((".mcg", ".mul1"))}
    if t.codebook is Codebook.THREE_INST:
        assert not marker
    else:
        (value,) = marker.values()
        assert (
            value.dtype == torch.int32
            and value.dim() == 0
            and value.item() == golden[f"{tag}.{t.codebook.value}"].item()
        )
    size = sum(v.numel() * v.element_size() for v in stored.values())
    assert size == EXL3Tensor.storage_bytes(256, 128, t.bits, t.codebook)


def test_storage_bytes_counts_padding() -> None:
    assert EXL3Tensor.storage_bytes(4096, 2048, 2, "mcg") == 4096 * 2048 * 2 // 8 + 2 * (4096 + 2048) + 4
    assert EXL3Tensor.storage_bytes(100, 200, 3, Codebook.THREE_INST) == 128 * 256 * 3 // 8 + 2 * (128 + 256)


def test_from_tensors_names_the_bad_tensor(golden) -> None:
    good = {k: v for k, v in golden.items() if k.startswith("mcg.K2.") and "nopack" not in k}
    with pytest.raises(ValueError, match=r"mcg.K2.suh must be float16"):
        EXL3Tensor.from_tensors({**good, "mcg.K2.suh": good["mcg.K2.suh"].float()}, "mcg.K2", 256, 128)
    with pytest.raises(ValueError, match=r"mcg.K2.trellis has shape"):
        EXL3Tensor.from_tensors(good, "mcg.K2", 512, 128)
    with pytest.raises(ValueError, match=r"missing tensor mcg.K2.svh"):
        EXL3Tensor.from_tensors({k: v for k, v in good.items() if not k.endswith("svh")}, "mcg.K2", 256, 128)
    with pytest.raises(ValueError, match=r"mcg.K2.mcg must be a 0-dim int32"):
        EXL3Tensor.from_tensors({**good, "mcg.K2.mcg": torch.tensor([1])}, "mcg.K2", 256, 128)


def test_decode_weight_drops_padding() -> None:
    trellis = torch.randint(-32768, 32767, (8, 16, 32), dtype=torch.int16)
    t = EXL3Tensor(
        trellis, torch.ones(128, dtype=torch.float16), torch.ones(256, dtype=torch.float16), Codebook.MCG, 100, 200
    )
    w = decode_weight(t, torch.bfloat16)
    assert w.shape == (200, 100) and w.dtype == torch.bfloat16
