"""The CUDA Viterbi kernel's arithmetic, step for step in torch (CPU or GPU), to check the kernel bit for bit.

fp16 targets and fp16 differences, an FFMA (emulated in float64, then rounded once to float32) and each cost
stored with the chosen predecessor index in its low K bits, compared as an unsigned integer.
"""

from __future__ import annotations

import torch

UNREACHABLE = 1e30


def _step(prev_keys: torch.Tensor, x16: torch.Tensor, lut16: torch.Tensor, bits: int) -> torch.Tensor:
    """prev_keys [N, E] int64 (uint32 values) -> next keys [N, E] for one position; x16 [N] fp16."""
    kr, nc = 16 - bits, 1 << bits
    c = torch.arange(nc, device=prev_keys.device).view(nc, 1)
    e = torch.arange(1 << kr, device=prev_keys.device).view(1, -1)
    pred = (c << (kr - bits)) | (e >> bits)  # [NC, E]
    d = (lut16[(c << kr) | e].unsqueeze(0) - x16.view(-1, 1, 1)).float().double()  # fp16 difference, exact widen
    prev = prev_keys.to(torch.int32).view(torch.float32).double()[:, pred]  # [N, NC, E]
    cost = (d * d + prev).float()  # one rounding, as FFMA
    keys = (cost.view(torch.int32).long() & 0xFFFFFFFF & ~(nc - 1)) | c.unsqueeze(0)
    return keys.min(dim=1).values


def viterbi_cuda_reference(
    targets: torch.Tensor, lut16: torch.Tensor, bits: int, before: int = 128, after: int = 128
) -> torch.Tensor:
    """(n, 256) fp32 targets -> (n, 256) int32 states, as viterbi_cuda computes them."""
    n, kr, dev = targets.shape[0], 16 - bits, targets.device
    x16, lut16 = targets.half(), lut16.to(dev)
    edges = 1 << kr
    zero = torch.zeros((n, edges), dtype=torch.int64, device=dev)

    def forward(keys: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        hist = {}
        for ri in positions:
            keys = _step(keys, x16[:, ri], lut16, bits)
            hist[ri] = keys & ((1 << bits) - 1)
        return keys, hist

    def trace(hist: dict[int, torch.Tensor], edge: torch.Tensor, positions: list[int], out: torch.Tensor | None):
        for ri in reversed(positions):
            state = (hist[ri].gather(1, edge[:, None]).squeeze(1) << kr) | edge
            if out is not None:
                out[:, ri] = state
            edge = state >> bits
        return edge

    ring = list(range(256))
    final, hist = forward(zero, ring[256 - before :] + ring[:after])
    best = ((final << 32) | torch.arange(edges, device=dev)).min(
        dim=1
    ).values & 0xFFFFFFFF  # lowest cost, then lowest edge
    seam = trace(hist, best, ring[:after], None)
    unreachable = torch.tensor([UNREACHABLE], dtype=torch.float32).view(torch.int32).long().item()
    start = torch.full((n, edges), unreachable, dtype=torch.int64, device=dev)
    start.scatter_(1, seam[:, None], 0)
    _, hist = forward(start, ring)
    out = torch.empty((n, 256), dtype=torch.int64, device=dev)
    trace(hist, seam, ring, out)
    return out.to(torch.int32)
