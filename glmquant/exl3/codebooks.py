"""The three procedural EXL3 codebooks: a 16-bit trellis state maps to one fp16 value by integer hashing."""

from __future__ import annotations

from enum import Enum
from functools import cache, lru_cache

import numpy as np
import torch


class Codebook(str, Enum):
    """Codebook of a quantized tensor; the value is the name used in configs and reports."""

    THREE_INST = "3inst"
    MCG = "mcg"
    MUL1 = "mul1"


# 0-dim int32 marker stored next to the trellis; only its presence is read back (3INST has none).
MARKER_VALUES: dict[Codebook, int] = {
    Codebook.MCG: np.array(0xCBAC1FED, dtype=np.uint32).view(np.int32).item(),
    Codebook.MUL1: np.array(0x83DCD12D, dtype=np.uint32).view(np.int32).item(),
}

# ExLlamaV3 divides input scales by this constant (the 3INST codebook RMS) for every codebook.
CODEBOOK_SCALE = 1.24371088


def _half_sum(x: np.ndarray) -> np.ndarray:
    """Mask/xor the 32-bit hash into two fp16 patterns and add them (exact in fp32, rounded once)."""
    y = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
    lo = (y & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)
    hi = (y >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float32)
    return (lo + hi).astype(np.float16)


def _mul1(x: np.ndarray) -> np.ndarray:
    """Byte sum of the hash, mapped affinely (one fp16 rounding, like the kernel's hfma)."""
    b = sum(((x >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.float32) for i in range(4))
    scale = np.array(0x1EEE, dtype=np.uint16).view(np.float16).astype(np.float32)
    bias = np.array(0xC931, dtype=np.uint16).view(np.float16).astype(np.float32)
    return ((np.float32(1024.0) + b) * scale + bias).astype(np.float16)


@cache
def _lut(codebook: Codebook) -> np.ndarray:
    s = np.arange(65536, dtype=np.uint64)
    if codebook is Codebook.THREE_INST:
        return _half_sum(((s * 89226354 + 64248484) & 0xFFFFFFFF).astype(np.uint32))
    if codebook is Codebook.MCG:
        return _half_sum(((s * 0xCBAC1FED) & 0xFFFFFFFF).astype(np.uint32))
    return _mul1(((s * 0x83DCD12D) & 0xFFFFFFFF).astype(np.uint32))


def codebook_values(codebook: Codebook | str) -> torch.Tensor:
    """fp16 value of every 16-bit state, shape (65536,); a fresh tensor the caller may keep."""
    return torch.from_numpy(_lut(Codebook(codebook)).copy())


@lru_cache(maxsize=16)
def device_codebook(codebook: Codebook, device: torch.device) -> torch.Tensor:
    """codebook_values on `device`, copied once and shared read-only (a copy per call would synchronize the host
    with the GPU each time)."""
    return codebook_values(codebook).to(device)
