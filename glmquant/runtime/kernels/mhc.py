"""mHC hyper-connections in three Triton launches per site: the mix's partial dot products, then each token's
weights and block input, then the next streams.

A site was ~9 launches in a compiled decode step (the RMS of the streams, the fn projection as cuBLAS's split GEMV,
fn's BF16 -> fp32 copy, the Sinkhorn weights, the pre-weighted collapse, the block's RMS norm, the comb's small
matmul and the expand), 90 sites a step, and the fp32 copy of fn moved 3.1 MB per site that the BF16 weights
(0.8 MB) do not need. Here `hyper_enter` reads fn in its own dtype once: for a few tokens `_mix_partials_kernel`
spreads each token's (N H)-long dot products over programs of BLOCK columns (more tokens take one matrix product,
which reads fn once for all), and `_hyper_enter_kernel` (a program per token) sums them, forms pre, post and the
Sinkhorn-normalized comb in registers, collapses the streams with pre and applies the block's RMS norm;
`_hyper_expand_kernel` writes the next streams. Same math and roundings as `arch.glm5_next_math.hyper_enter` /
`hyper_expand` (fp32 sums in another order; the N-term sums and the casts to the streams' dtype where PyTorch makes
them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 256  # columns of the flattened streams per `_mix_partials_kernel` program
EXPAND_BLOCK = 1024  # hidden columns per `_hyper_expand_kernel` program
PARTIALS_MAX_TOKENS = 64  # decode and verify steps; a prefill chunk's mix is one matrix product


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (nearest, ties to even) and back: BF16 by its bits, which Triton's CPU interpreter
    would otherwise truncate, so the tests see the GPU's rounding; a NaN stays NaN (its bits would carry into the
    exponent)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _mix_partials_kernel(
    streams_ptr, fn_ptr, dots_ptr, squares_ptr, K, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr
):
    """Token t, columns [p BLOCK, (p + 1) BLOCK) of its flattened streams [K]: fn's W rows dotted with them, and their
    sum of squares -> dots [T, P, W], squares [T, P] (fp32)."""
    t, p = tl.program_id(0), tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    live = cols < K
    x = tl.load(streams_ptr + t.to(tl.int64) * K + cols, mask=live, other=0.0).to(tl.float32)
    rows = tl.arange(0, WP)
    w = tl.load(fn_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < W) & live[None, :], other=0.0)
    dots = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    parts = tl.num_programs(1)
    tl.store(dots_ptr + (t * parts + p) * W + rows, dots, mask=rows < W)
    tl.store(squares_ptr + t * parts + p, tl.sum(x * x, axis=0))


@triton.jit
def _hyper_enter_kernel(
    streams_ptr,
    dots_ptr,
    squares_ptr,
    base_ptr,
    scale_ptr,
    norm_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    P,
    H,
    rms_eps,
    hc_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,
    PP: tl.constexpr,
    HP: tl.constexpr,
):
    """Token t: the mix (its partial dot products summed, times the streams' RMS), pre, post [N] and comb [N, N]
    (fp32, post and comb stored for the expand), then the block input norm * rms_norm(sum_n pre_n s_n) -> out."""
    W: tl.constexpr = (2 + N) * N
    t = tl.program_id(0)
    parts = tl.arange(0, PP)
    live = parts < P
    n = tl.arange(0, N)
    ij = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]  # [N, N]
    row = dots_ptr + (t * P + parts) * W  # [PP]
    squares = tl.sum(tl.load(squares_ptr + t * P + parts, mask=live, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(squares / (N * H) + rms_eps)
    pre_dot = tl.sum(tl.load(row[:, None] + n[None, :], mask=live[:, None], other=0.0), axis=0)
    post_dot = tl.sum(tl.load(row[:, None] + N + n[None, :], mask=live[:, None], other=0.0), axis=0)
    comb_dot = tl.sum(tl.load(row[:, None, None] + 2 * N + ij[None, :, :], mask=live[:, None, None], other=0.0), 0)
    pre = tl.sigmoid(pre_dot * r * tl.load(scale_ptr) + tl.load(base_ptr + n)) + hc_eps
    post = 2 * tl.sigmoid(post_dot * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + n))
    logits = comb_dot * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + t * N + n, post)
    tl.store(comb_ptr + t * (N * N) + ij, comb)

    h = tl.arange(0, HP)
    hl = h < H
    s = tl.load(streams_ptr + t.to(tl.int64) * (N * H) + n[:, None] * H + h[None, :], mask=hl[None, :], other=0.0)
    dtype = out_ptr.dtype.element_ty
    x = _rounded(tl.sum(pre[:, None] * s.to(tl.float32), axis=0), dtype)  # the collapse, in the streams' dtype
    rx = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + rms_eps)
    y = _rounded(x * rx, dtype)
    weight = tl.load(norm_ptr + h, mask=hl, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + h, _rounded(weight * y, dtype).to(dtype), mask=hl)


@triton.jit
def _hyper_expand_kernel(streams_ptr, out_ptr, post_ptr, comb_ptr, next_ptr, H, N: tl.constexpr, BLOCK: tl.constexpr):
    """Token t, hidden columns of block b: next[n] = post_n out + sum_m comb[m, n] s_m, each term and the sum rounded
    to the streams' dtype (post and comb cast to it first), as PyTorch's BF16 product and matmul do. The sum runs
    over the source streams m one at a time: [N, BLOCK] in registers, not [N, N, BLOCK]."""
    t, b = tl.program_id(0), tl.program_id(1)
    dtype = next_ptr.dtype.element_ty
    n = tl.arange(0, N)
    h = b * BLOCK + tl.arange(0, BLOCK)
    hl = h < H
    base = t.to(tl.int64) * (N * H)
    out = tl.load(out_ptr + t.to(tl.int64) * H + h, mask=hl, other=0.0).to(tl.float32)
    post = _rounded(tl.load(post_ptr + t * N + n), dtype)
    spread = _rounded(post[:, None] * out[None, :], dtype)
    acc = tl.zeros((N, BLOCK), dtype=tl.float32)
    for m in tl.static_range(N):
        s_m = tl.load(streams_ptr + base + m * H + h, mask=hl, other=0.0).to(tl.float32)
        comb_m = _rounded(tl.load(comb_ptr + t * (N * N) + m * N + n), dtype)  # comb[m, n] for every n
        acc += comb_m[:, None] * s_m[None, :]
    mixed = _rounded(acc, dtype)
    tl.store(next_ptr + base + n[:, None] * H + h[None, :], _rounded(spread + mixed, dtype).to(dtype), mask=hl[None, :])


def hyper_enter(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`arch.glm5_next_math.hyper_enter` for streams [..., N, H] (N a power of two): the block input [..., H],
    post [..., N] and comb [..., N, N] (fp32)."""
    *lead, n, hidden = streams.shape
    flat = streams.reshape(-1, n * hidden).contiguous()
    t, k, w = flat.shape[0], n * hidden, (2 + n) * n
    if t <= PARTIALS_MAX_TOKENS:
        parts = triton.cdiv(k, BLOCK)
        dots = torch.empty((t, parts, w), dtype=torch.float32, device=streams.device)
        squares = torch.empty((t, parts), dtype=torch.float32, device=streams.device)
        _mix_partials_kernel[(t, parts)](
            flat, fn.contiguous(), dots, squares, k, W=w, WP=triton.next_power_of_2(w), BLOCK=BLOCK
        )
    else:
        parts, wide = 1, flat.float()
        dots, squares = F.linear(wide, fn.float()).unsqueeze(1), wide.square().sum(-1, keepdim=True)
    out = torch.empty((t, hidden), dtype=streams.dtype, device=streams.device)
    post = torch.empty((t, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=streams.device)
    hp = triton.next_power_of_2(hidden)
    _hyper_enter_kernel[(t,)](
        flat,
        dots,
        squares,
        base.contiguous(),
        scale.contiguous(),
        norm.contiguous(),
        out,
        post,
        comb,
        parts,
        hidden,
        rms_eps,
        hc_eps,
        N=n,
        ITERS=sinkhorn_iters,
        PP=triton.next_power_of_2(parts),
        HP=hp,
        num_warps=max(1, min(16, hp * n // 1024)),
    )
    return out.view(*lead, hidden), post.view(*lead, n), comb.view(*lead, n, n)


def hyper_expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`arch.glm5_next_math.hyper_expand`: the next streams [..., N, H] from post [..., N], comb [..., N, N] (fp32),
    the block output [..., H] and the streams [..., N, H]."""
    *lead, n, hidden = streams.shape
    flat = streams.reshape(-1, n, hidden).contiguous()
    t = flat.shape[0]
    nxt = torch.empty_like(flat)
    block = min(EXPAND_BLOCK, triton.next_power_of_2(hidden))
    _hyper_expand_kernel[(t, triton.cdiv(hidden, block))](
        flat,
        out.reshape(t, hidden).contiguous(),
        post.reshape(t, n).contiguous(),
        comb.reshape(t, n, n).contiguous(),
        nxt,
        hidden,
        N=n,
        BLOCK=block,
    )
    return nxt.view(*lead, n, hidden)
