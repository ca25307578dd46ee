"""The MoE router's scores from its weights in their stored dtype: sigmoid(hidden · W^T) in fp32.

The router runs in fp32 (`moe_router_dtype`), and its weights were held in fp32 for it: 288 x 4096 x 4 bytes per MoE
layer, 198 MB read per decode step on GLM-5.3-Flash, twice the checkpoint's BF16. `router_scores` reads BF16 (or
fp32) weights and multiplies in fp32, which is exactly fp32 arithmetic on the upcast weights (fp32 sums in another
order), so the engine keeps the router in the model dtype where this kernel runs. A program takes BE experts of one
token; many tokens (a prefill chunk) take one matrix product instead, which reads the weights once for all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

EXPERTS_PER_PROGRAM = 8
HIDDEN_BLOCK = 512
KERNEL_MAX_TOKENS = 64  # decode and verify steps


@triton.jit
def _router_scores_kernel(x_ptr, w_ptr, out_ptr, H, E, BE: tl.constexpr, BH: tl.constexpr):
    """Token t, experts [b BE, (b + 1) BE): sigmoid of the fp32 dot products of its hidden row with their weights."""
    t, b = tl.program_id(0), tl.program_id(1)
    e = b * BE + tl.arange(0, BE)
    live = e < E
    acc = tl.zeros((BE,), dtype=tl.float32)
    for start in range(0, H, BH):
        h = start + tl.arange(0, BH)
        hl = h < H
        x = tl.load(x_ptr + t.to(tl.int64) * H + h, mask=hl, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * H + h[None, :], mask=live[:, None] & hl[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * E + e, tl.sigmoid(acc), mask=live)


def router_scores(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sigmoid(hidden [T, H] · weight [E, H]^T) in fp32 -> [T, E], the weights read in their own dtype."""
    t, h = hidden.shape
    e = weight.shape[0]
    if t > KERNEL_MAX_TOKENS:
        return F.linear(hidden.float(), weight.float()).sigmoid()
    scores = torch.empty((t, e), dtype=torch.float32, device=hidden.device)
    grid = (t, triton.cdiv(e, EXPERTS_PER_PROGRAM))
    _router_scores_kernel[grid](
        hidden.contiguous(), weight.contiguous(), scores, h, e, BE=EXPERTS_PER_PROGRAM, BH=HIDDEN_BLOCK
    )
    return scores


def route(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    scaling: float,
    normalize: bool,
    select: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`arch.glm5_next_math.route` with the scores from `router_scores`; `select` (`math.select_experts`, perhaps
    compiled) picks and weighs the experts."""
    return select(router_scores(hidden, weight), bias, top_k, scaling, normalize)
