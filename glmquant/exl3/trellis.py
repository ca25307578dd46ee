"""Tile ring order and the packed tail-biting bitstream of EXL3 trellises.

A 16x16 tile is a ring of 256 positions; position t carries a 16-bit state whose low K bits are new
and whose high 16-K bits repeat the previous state. Only the new bits are stored, MSB first.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def _ring_order() -> torch.Tensor:
    """Row-major tile element (16 * row + col) held by each ring position t = 8L + e."""
    t = torch.arange(256)
    lane, e = t // 8, t % 8
    row = 2 * (lane % 4) + (e & 1) + 8 * ((e >> 1) & 1)
    col = lane // 4 + 8 * ((e >> 2) & 1)
    return row * 16 + col


RING_ORDER = _ring_order()
TILE_ORDER = torch.argsort(RING_ORDER)  # ring position of each row-major tile element


@lru_cache(maxsize=16)
def ring_order(device: torch.device) -> torch.Tensor:
    """RING_ORDER on `device`, copied once (a copy per call would synchronize the host with the GPU each time)."""
    return RING_ORDER.to(device)


@lru_cache(maxsize=16)
def _tile_order(device: torch.device) -> torch.Tensor:
    return TILE_ORDER.to(device)


def to_ring(x: torch.Tensor) -> torch.Tensor:
    """(..., k, n) matrix -> (..., k/16, n/16, 256) tiles, each in ring order."""
    *lead, k, n = x.shape
    tiles = x.reshape(*lead, k // 16, 16, n // 16, 16).transpose(-3, -2)
    return tiles.reshape(*lead, k // 16, n // 16, 256)[..., ring_order(x.device)]


def from_ring(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of to_ring: (..., tk, tn, 256) ring-ordered tiles -> (..., 16 tk, 16 tn) matrix."""
    *lead, tk, tn, _ = tiles.shape
    x = tiles[..., _tile_order(tiles.device)].reshape(*lead, tk, tn, 16, 16).transpose(-3, -2)
    return x.reshape(*lead, tk * 16, tn * 16)


def _check_k(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits per weight must be 1..8, got {bits}")


def pack_trellis(states: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 256) states -> (..., 16*bits) int16 words: new bits of each position, MSB-first in uint32 words."""
    _check_k(bits)
    k = bits
    new = states.to(torch.int32) & ((1 << k) - 1)  # [..., 256]
    shifts = torch.arange(k - 1, -1, -1, dtype=torch.int32, device=states.device)
    stream = ((new.unsqueeze(-1) >> shifts) & 1).reshape(*states.shape[:-1], 8 * k, 32)
    weights = torch.ones(32, dtype=torch.int64, device=states.device) << torch.arange(31, -1, -1, device=states.device)
    words = (stream.to(torch.int64) * weights).sum(-1)  # [..., 8K] as unsigned 32-bit values
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(*states.shape[:-1], 16 * k)
    return (halves - ((halves >> 15) << 16)).to(torch.int16)


def unpack_trellis(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., 16*bits) int16 words -> (..., 256) int32 states in 0..65535 (tail-biting windows)."""
    _check_k(bits)
    k = bits
    if packed.shape[-1] != 16 * k:
        raise ValueError(f"trellis last dim {packed.shape[-1]} does not match {bits} bits (expected {16 * k})")
    w = packed.to(torch.int32) & 0xFFFF
    words = w[..., 0::2] | (w[..., 1::2] << 16)  # [..., 8K] uint32 bit patterns in int32
    shifts = torch.arange(31, -1, -1, dtype=torch.int32, device=packed.device)
    stream = ((words.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], 256, k)
    place = torch.ones(k, dtype=torch.int32, device=packed.device) << torch.arange(k - 1, -1, -1, device=packed.device)
    new = (stream * place).sum(-1, dtype=torch.int32)  # [..., 256] new bits per position
    state = torch.zeros_like(new)
    for m in range(-(-16 // k)):  # older positions fill the higher bits of the window
        state |= torch.roll(new, m, dims=-1) << (m * k)
    return state & 0xFFFF
