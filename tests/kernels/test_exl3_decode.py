"""Triton decode helpers reproduce the codec's inner weight bit for bit: every codebook, K = 1..8, golden vectors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_device, random_exl3
from safetensors.torch import load_file

from glmquant.exl3 import Codebook, EXL3Tensor, decode_inner

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import triton
import triton.language as tl

from glmquant.runtime.kernels.exl3_decode import HASH_FLIP, HASH_MASK, codebook_id, load_window, window_values

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "exl3_golden.safetensors"


@triton.jit
def tiles_kernel(trellis_ptr, out_ptr, NT, mask, flip, K: tl.constexpr, CB: tl.constexpr, TILES: tl.constexpr):
    """Test-only: TILES 16x16 tiles per program, written in (row, col) order. Ring fields of (r, c) per the format
    spec: r = 2 l4 + e0 + 8 e1, c = g + 8 e2."""
    r = tl.arange(0, 16)[None, :, None]
    c = tl.arange(0, 16)[None, None, :]
    tile = tl.program_id(0) * TILES + tl.arange(0, TILES)[:, None, None]
    g, l4, e2, e01 = c % 8, (r % 8) // 2, c // 8, 2 * (r // 8) + r % 2
    q = window_values(load_window(trellis_ptr + tile * (8 * K), g, l4, e2, e01, K), e2, e01, K, CB, mask, flip)
    ti, tj = tile // NT, tile % NT
    tl.store(out_ptr + (16 * ti + r) * (16 * NT) + 16 * tj + c, q)


def decode_tiles(trellis: torch.Tensor, codebook: Codebook) -> torch.Tensor:
    """Q (in_pad, out_pad) fp16 through `load_window` + `window_values`, written by the test-only kernel."""
    kt, nt, words = trellis.shape
    out = torch.empty((kt * 16, nt * 16), dtype=torch.float16, device=trellis.device)
    tiles_kernel[(kt * nt // 64,)](
        trellis.view(torch.int32), out, nt, HASH_MASK, HASH_FLIP, K=words // 16, CB=codebook_id(codebook), TILES=64
    )
    return out


@pytest.mark.parametrize("codebook", list(Codebook))
@pytest.mark.parametrize("bits", range(1, 9))
def test_random_trellis_decodes_bit_exactly(codebook, bits):
    device = kernel_device()
    t = random_exl3(torch.Generator().manual_seed(bits), 16, 32, bits, codebook.value)  # 8 x 8 tiles
    got = decode_tiles(t.trellis.to(device), codebook).cpu()
    want = decode_inner(t.trellis, codebook)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("tag", [f"{cb}.K{k}" for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)])
def test_golden_inner_weight_bit_exact(tag):
    """exllamav3 1.6.5's own decoded Q of the golden vectors (tests/data)."""
    device = kernel_device()
    golden = load_file(str(GOLDEN))
    t = EXL3Tensor.from_tensors(golden, tag, 256, 128)
    got = decode_tiles(t.trellis.to(device), t.codebook).cpu()
    assert torch.equal(got.view(torch.int16), golden[f"{tag}.Q"].view(torch.int16))
