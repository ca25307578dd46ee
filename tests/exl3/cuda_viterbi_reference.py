"""The CUDA Viterbi kernel's arithmetic, step for step in torch (CPU or GPU), to check the kernel bit for bit.

K >= 3: fp16 targets and fp16 differences, an FFMA (emulated in float64, then rounded once to float32) and each
cost stored with the chosen predecessor index in its low K bits, compared as an unsigned integer.
K <= 2: the 16-bit fixed-point search: per-tile scale (from its RMS), fp16 difference (HSUB2), fp16 square plus
the position's addend (HFMA2), its bits above 2^10's as the error, integer keys with the index in the low K bits, costs
renormalized by the lowest and clamped every step (a clamped edge's index reads 2^K - 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

UNREACHABLE = 1e30
FIXED_CAPS = {1: 26000, 2: 10000}
FIXED_PER_RMS = {1: 5.0, 2: 20.0}
MAGIC_BITS = 0x6400  # fp16 2^10


def _predecessors(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Predecessor edge and state of each (candidate c, edge e): both [2^K, 2^(16-K)]."""
    kr, nc = 16 - bits, 1 << bits
    c = torch.arange(nc, device=device).view(nc, 1)
    e = torch.arange(1 << kr, device=device).view(1, -1)
    return (c << (kr - bits)) | (e >> bits), (c << kr) | e


def _float_step(prev_keys: torch.Tensor, x16: torch.Tensor, lut16: torch.Tensor, bits: int) -> torch.Tensor:
    """prev_keys [N, E] int64 (uint32 values) -> next keys [N, E] for one position; x16 [N] fp16."""
    nc = 1 << bits
    pred, state = _predecessors(bits, prev_keys.device)
    d = (lut16[state].unsqueeze(0) - x16.view(-1, 1, 1)).float().double()  # fp16 difference, exact widen
    prev = prev_keys.to(torch.int32).view(torch.float32).double()[:, pred]  # [N, NC, E]
    cost = (d * d + prev).float()  # one rounding, as FFMA
    c = torch.arange(nc, device=prev_keys.device).view(1, nc, 1)
    keys = (cost.view(torch.int32).long() & 0xFFFFFFFF & ~(nc - 1)) | c
    return keys.min(dim=1).values


def _fp16_bits(h: torch.Tensor) -> torch.Tensor:
    return h.view(torch.int16).long() & 0xFFFF


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the smallest fp16 at or above it (__float2half_ru)."""
    h = x.half()
    up = torch.nextafter(h, torch.tensor(float("inf"), dtype=torch.float16, device=h.device))
    return torch.where(h.float() < x, up, h)


def tile_scales(targets: torch.Tensor, peak: float, bits: int) -> torch.Tensor:
    """PER_RMS / RMS of the fp16-rounded targets (summed in order, in fp32) as an fp16 multiple of 16, at most 64,
    halved until (max |x| + codebook peak) x scale <= 256; per tile, fp32 arithmetic as in the kernel."""
    x16 = targets.half().float()
    total = torch.zeros(targets.shape[0], dtype=torch.float32, device=targets.device)
    for i in range(256):
        total = total + x16[:, i] * x16[:, i]
    rms = torch.sqrt(total / 256)
    scale = (torch.tensor(FIXED_PER_RMS[bits], dtype=torch.float32, device=targets.device) / rms).clamp(max=64.0)
    scale = (scale / 16).half().float() * 16
    top = targets.float().abs().amax(dim=1) + torch.tensor(peak, dtype=torch.float32)
    while bool(((top * scale) > 256).any()):
        scale = torch.where(top * scale > 256, scale * 0.5, scale)
    return scale


class _Fixed:
    """The fixed-point search's per-tile tables and one step over costs [N, E] (int64 cost fields)."""

    def __init__(self, targets: torch.Tensor, lut16: torch.Tensor, bits: int) -> None:
        peak = lut16.float().abs().max().item()
        scale = tile_scales(targets, peak, bits)
        self.bits, self.cap = bits, FIXED_CAPS[bits]
        self.x16 = (targets.float() * scale[:, None]).half()  # [N, 256]
        values = ((lut16.float() * 16).half().float() * (scale[:, None] / 16)).half()  # [N, 65536], as HMUL2
        over = (self.x16.float().abs() - (torch.tensor(peak, dtype=torch.float32) * scale)[:, None]).clamp(min=0)
        floor = torch.floor((over * over) * torch.tensor(1 - 1 / 512, dtype=torch.float32))
        self.adds = _round_up_fp16(1024.0 - floor)  # [N, 256]
        self.pred, state = _predecessors(bits, targets.device)
        self.values = values[:, state].double()  # [N, NC, E]
        kr = 16 - bits
        self.index = torch.arange(1 << kr, device=targets.device) >> (kr - bits)

    def step(self, costs: torch.Tensor, ri: int) -> tuple[torch.Tensor, torch.Tensor]:
        """costs [N, E] -> (next costs, chosen indices) at position ri."""
        k = self.bits
        d = (self.values - self.x16[:, ri].double().view(-1, 1, 1)).half().double()  # HSUB2
        h = (d * d + self.adds[:, ri].double().view(-1, 1, 1)).half()  # HFMA2: one rounding
        error = _fp16_bits(h) - MAGIC_BITS
        packed = (costs << k) | self.index
        keys = (error << k) + packed[:, self.pred]
        assert int(error.min()) >= 0 and int(keys.max()) < 65536
        best = keys.min(dim=1).values
        cost = (best >> k) - costs.min(dim=1, keepdim=True).values
        clamped = cost > self.cap  # the kernel's clamp replaces the whole key: its index bits read 2^K - 1
        return cost.clamp(max=self.cap), torch.where(clamped, (1 << k) - 1, best & ((1 << k) - 1))


def viterbi_cuda_reference(
    targets: torch.Tensor, lut16: torch.Tensor, bits: int, before: int = 128, after: int = 128
) -> torch.Tensor:
    """(n, 256) fp32 targets -> (n, 256) int32 states, as viterbi_cuda computes them."""
    n, kr, dev = targets.shape[0], 16 - bits, targets.device
    lut16 = lut16.to(dev)
    edges = 1 << kr
    free = torch.zeros((n, edges), dtype=torch.int64, device=dev)
    step: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    if bits <= 2:
        fixed = _Fixed(targets, lut16, bits)
        step = fixed.step
        unreachable = fixed.cap
    else:
        x16 = targets.half()

        def step(keys: torch.Tensor, ri: int) -> tuple[torch.Tensor, torch.Tensor]:
            keys = _float_step(keys, x16[:, ri], lut16, bits)
            return keys, keys & ((1 << bits) - 1)

        unreachable = int(torch.tensor([UNREACHABLE], dtype=torch.float32).view(torch.int32).item())

    def forward(costs: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        hist = {}
        for ri in positions:
            costs, hist[ri] = step(costs, ri)
        return costs, hist

    def trace(hist: dict[int, torch.Tensor], edge: torch.Tensor, positions: list[int], out: torch.Tensor | None):
        for ri in reversed(positions):
            state = (hist[ri].gather(1, edge[:, None]).squeeze(1) << kr) | edge
            if out is not None:
                out[:, ri] = state
            edge = state >> bits
        return edge

    ring = list(range(256))
    final, hist = forward(free, ring[256 - before :] + ring[:after])
    # lowest final cost (the float search: its whole key), then lowest edge
    best = ((final << 32) | torch.arange(edges, device=dev)).min(dim=1).values & 0xFFFFFFFF
    seam = trace(hist, best, ring[:after], None)
    start = torch.full((n, edges), unreachable, dtype=torch.int64, device=dev)
    start.scatter_(1, seam[:, None], 0)
    _, hist = forward(start, ring)
    out = torch.empty((n, 256), dtype=torch.int64, device=dev)
    trace(hist, seam, ring, out)
    return out.to(torch.int32)
