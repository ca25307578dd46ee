"""mHC hyper-connection weights in one Triton launch: sigmoid gates and the Sinkhorn-Knopp normalized comb of
every token, from the mix logits. In PyTorch the 20 Sinkhorn iterations on [T, 4, 4] are ~120 tiny launches per
site, 90 sites a decode step; here a program holds ROWS tokens' n x n matrices in registers for all of them.
Same math as `arch.glm5_next_math.hyper_weights` (fp32; sums over n terms may round in another order)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
def _hyper_weights_kernel(
    mix_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    hc_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """mix [T, (2 + N) N] -> pre, post [T, N], comb [T, N, N] (fp32)."""
    W: tl.constexpr = (2 + N) * N
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows[:, None] < T
    n = tl.arange(0, N)[None, :]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    row_mix = mix_ptr + rows[:, None].to(tl.int64) * W
    pre = tl.sigmoid(tl.load(row_mix + n, mask=live, other=0.0) * s0 + tl.load(base_ptr + n)) + hc_eps
    post = 2 * tl.sigmoid(tl.load(row_mix + N + n, mask=live, other=0.0) * s1 + tl.load(base_ptr + N + n))
    tl.store(pre_ptr + rows[:, None] * N + n, pre, mask=live)
    tl.store(post_ptr + rows[:, None] * N + n, post, mask=live)
    ij = (tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :])[None, :, :]  # [1, N, N]
    live3 = rows[:, None, None] < T
    logits = tl.load(row_mix[:, :, None] + 2 * N + ij, mask=live3, other=0.0) * s2 + tl.load(base_ptr + 2 * N + ij)
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + rows[:, None, None].to(tl.int64) * (N * N) + ij, comb, mask=live3)


def hyper_weights(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`arch.glm5_next_math.hyper_weights` for mix [..., (2 + n) n] fp32 with n a power of two."""
    lead = mix.shape[:-1]
    flat = mix.reshape(-1, mix.shape[-1]).contiguous()
    t = flat.shape[0]
    pre = torch.empty((t, n), dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=mix.device)
    _hyper_weights_kernel[(triton.cdiv(t, ROWS),)](
        flat, base.contiguous(), scale.contiguous(), pre, post, comb, t, hc_eps, N=n, ITERS=sinkhorn_iters, ROWS=ROWS
    )
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
