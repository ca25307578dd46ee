"""Reference tail-biting Viterbi search in torch (any device); the C++ kernel reproduces it bit for bit.

Costs are indexed by the low 16-K bits of a state (what it shares with its successor). A state
s = (c << 16-K) | e follows the state whose low bits are s >> K, so every step takes, for each e,
the best of 2^K candidates c, and remembers c for the traceback.
"""

from __future__ import annotations

import torch


def _tables(bits: int, lut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predecessor index and codebook value for each (candidate c, edge e): both [2^K, 2^(16-K)]."""
    kr = 16 - bits
    c = torch.arange(1 << bits, device=lut.device).unsqueeze(1)
    e = torch.arange(1 << kr, device=lut.device).unsqueeze(0)
    return (c << (kr - bits)) | (e >> bits), lut[(c << kr) | e]


def _forward(
    x: torch.Tensor,
    prev: torch.Tensor,
    pred: torch.Tensor,
    vals: torch.Tensor,
    positions: list[int],
    hist: torch.Tensor,
) -> torch.Tensor:
    """Run the steps at `positions` from costs `prev` [N, E]; fills hist [256, N, E] and returns final costs."""
    for ri in positions:
        d = vals - x[:, ri, None, None]  # [N, 2^K, E]
        best, arg = (prev[:, pred] + d * d).min(dim=1)  # ties keep the lowest c
        hist[ri] = arg.to(torch.uint8)
        prev = best
    return prev


def _trace(
    hist: torch.Tensor, edge: torch.Tensor, positions: list[int], bits: int, out: torch.Tensor | None
) -> torch.Tensor:
    """Walk back from edge at positions[-1] down to positions[0]; returns the edge before positions[0]."""
    kr = 16 - bits
    for ri in reversed(positions):
        s = (hist[ri].gather(1, edge[:, None]).squeeze(1).long() << kr) | edge
        if out is not None:
            out[:, ri] = s
        edge = s >> bits
    return edge


def viterbi_torch(targets: torch.Tensor, lut: torch.Tensor, bits: int, chunk: int = 32) -> torch.Tensor:
    """(n, 256) fp32 ring-ordered targets -> (n, 256) int32 states minimizing the squared error on the ring."""
    out = torch.empty(targets.shape, dtype=torch.int32, device=targets.device)
    lut = lut.to(device=targets.device, dtype=torch.float32)
    pred, vals = _tables(bits, lut)
    ring = list(range(256))
    for start in range(0, targets.shape[0], chunk):
        x = targets[start : start + chunk].float()
        n, edges = x.shape[0], 1 << (16 - bits)
        hist = torch.empty((256, n, edges), dtype=torch.uint8, device=x.device)
        # Pass 1: the ring rotated by 128 from free start states; its path fixes the state at the seam.
        rolled = ring[128:] + ring[:128]
        final = _forward(x, torch.zeros((n, edges), device=x.device), pred, vals, rolled, hist)
        seam = _trace(hist, final.argmin(dim=1), ring[:128], bits, None)
        # Pass 2: start and end on the seam, which closes the ring.
        prev = torch.full((n, edges), float("inf"), device=x.device)
        prev.scatter_(1, seam[:, None], 0.0)
        _forward(x, prev, pred, vals, ring, hist)
        sub = torch.empty((n, 256), dtype=torch.long, device=x.device)
        _trace(hist, seam, ring, bits, sub)
        out[start : start + n] = sub.to(torch.int32)
    return out
