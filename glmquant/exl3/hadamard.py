"""Block-diagonal 128x128 Sylvester Hadamard rotations (the incoherence transform P of EXL3)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

BLOCK = 128


@lru_cache(maxsize=8)
def _hadamard(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * (1 / math.sqrt(BLOCK))).to(device)


def hadamard_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """Normalized, symmetric, self-inverse 128x128 Hadamard matrix (fp32)."""
    return _hadamard(torch.device(device))


def had_left(x: torch.Tensor) -> torch.Tensor:
    """P @ x for (..., k, n), k a multiple of 128; computed in fp32, returned in x's dtype."""
    *lead, k, n = x.shape
    y = hadamard_matrix(x.device) @ x.float().reshape(*lead, k // BLOCK, BLOCK, n)
    return y.reshape(*lead, k, n).to(x.dtype)


def had_right(x: torch.Tensor) -> torch.Tensor:
    """x @ P for (..., k, n), n a multiple of 128; computed in fp32, returned in x's dtype."""
    *lead, k, n = x.shape
    y = x.float().reshape(*lead, k, n // BLOCK, BLOCK) @ hadamard_matrix(x.device)
    return y.reshape(*lead, k, n).to(x.dtype)
