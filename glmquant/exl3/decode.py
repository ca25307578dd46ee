"""Bit-exact EXL3 decoding: packed trellis -> inner Q -> W = diag(suh) P Q P diag(svh)."""

from __future__ import annotations

import torch

from glmquant.exl3.codebooks import Codebook, device_codebook
from glmquant.exl3.hadamard import had_left, had_right
from glmquant.exl3.tensor import EXL3Tensor
from glmquant.exl3.trellis import from_ring, unpack_trellis


def decode_inner(trellis: torch.Tensor, codebook: Codebook | str) -> torch.Tensor:
    """fp16 (in_pad, out_pad) inner weight Q, bit-identical to ExLlamaV3's reconstruction."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3 or trellis.shape[-1] % 16:
        raise ValueError(f"trellis must be int16 (tk, tn, 16*K), got {trellis.dtype} {tuple(trellis.shape)}")
    states = unpack_trellis(trellis, trellis.shape[-1] // 16)
    values = device_codebook(Codebook(codebook), trellis.device)[states.long()]
    return from_ring(values)


def decode_weight(t: EXL3Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """HF-orientation (out_features, in_features) weight, padding removed; fp16 steps as ExLlamaV3 takes them."""
    w = had_left(decode_inner(t.trellis, t.codebook))
    w = had_right(w * t.suh.unsqueeze(1)) * t.svh.unsqueeze(0)
    return w[: t.in_features, : t.out_features].T.to(dtype)
