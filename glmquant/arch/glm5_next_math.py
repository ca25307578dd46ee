"""GLM-5.3-Flash's own math as pure tensor functions: mHC hyper-connections, the KDA forget gate and gated norm,
noaux_tc routing, the DSA indexer's k-pool scoring and selection, and sparse MLA in its absorbed form.

Each function reproduces transformers' `modeling_glm5_next` (5.2x) operation for operation, dtype casts included,
so the runtime's own decode path matches it to rounding; shapes are written as [T, ...] for tokens. Sparse MLA is
the one rewrite: keys and values are never expanded, the query is absorbed into kv_b_proj's key half and the
output leaves through its value half (exact algebra; differences are float rounding only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INVALID = -1  # a selected token index that selects nothing


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`Glm5NextTextRMSNorm`: normalized in fp32, cast back, times the weight."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def hyper_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """mHC's projection of the RMS-normalized streams [T, N, H] -> [T, (2 + N) N] fp32 (pre, post, comb logits)."""
    flat = streams.flatten(-2).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.float())


def hyper_weights(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC (`Glm5NextTextHyperConnection`) weights of n streams from `hyper_mix`'s [T, (2 + n) n]: pre [T, n],
    post [T, n] and the doubly stochastic comb [T, n, n] (Sinkhorn-Knopp), all fp32."""
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hyper_collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block input [T, H]: streams [T, N, H] summed with the pre weights [T, N]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


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
    """One mHC site's way into its block: the block input [T, H] (the streams [T, N, H] collapsed with pre, then the
    block's RMS norm), and post [T, N] and comb [T, N, N] for `hyper_expand`."""
    n = streams.shape[-2]
    pre, post, comb = hyper_weights(hyper_mix(streams, fn, rms_eps), base, scale, n, hc_eps, sinkhorn_iters)
    return rms_norm(hyper_collapse(pre, streams), norm, rms_eps), post, comb


def hyper_expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The next streams [T, N, H]: the block output [T, H] spread by post plus the streams mixed by comb."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """GLM's clamped SwiGLU of the fused [.., 2I] gate/up projection (gate first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def route(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing with one expert group: (expert ids [T, k], fp32 weights [T, k]); the correction bias
    chooses, the plain sigmoid scores weigh."""
    return select_experts(F.linear(hidden.float(), weight.float()).sigmoid(), bias, top_k, scaling, normalize)


def select_experts(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` from the router's fp32 sigmoid scores [T, E]."""
    ids = torch.topk(scores + bias, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def kda_gate(
    f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None, head_dim: int
) -> torch.Tensor:
    """KDA's per-channel log decay [.., heads, head_dim] (fp32) from the forget projection f [.., heads * head_dim]."""
    g = (f.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    rate = a_log.float().exp().unsqueeze(-1)  # [heads, 1]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's output norm: fp32 RMSNorm times the weight times sigmoid(gate), cast back to x's dtype."""
    y = x.float()
    y = weight.float() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps))
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """DSA k-pool keys [.., P, D] from the indexer keys and gate scores of each pool's tokens [.., P, kpool, D]."""
    probs = torch.softmax(gates.float() + ape.float(), dim=-2).to(keys.dtype)
    return (probs * keys).sum(dim=-2)


def index_scores(
    q: torch.Tensor, pooled: torch.Tensor, head_weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Indexer score of every pool for each query: q [B, S, Hi, D], pooled [B, P, D], head_weights [B, S, Hi]
    (already times Hi^-1/2) -> [B, S, P] fp32."""
    scores = F.relu(torch.matmul(q.float(), pooled.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale)
    return torch.matmul(head_weights.float().unsqueeze(-2), scores).squeeze(-2)


def indexer_ranks(pools: int, kpool: int, topk: int) -> bool:
    """Whether the indexer must score and rank `pools` k-pools: only when there are more than the topk / kpool it
    keeps (a context of at most topk tokens keeps every pool)."""
    return pools > topk // kpool


def select_tokens(
    scores: torch.Tensor | None, positions: torch.Tensor, pools: int, kpool: int, topk: int, with_tail: bool
) -> torch.Tensor:
    """Token indices each query attends to [B, S, W] (INVALID where none): the top-(topk / kpool) complete pools
    ending at or before the query's position, expanded to their tokens, then the query's incomplete tail pool.

    scores [B, S, P] over pools 0..P-1 (pool p holds tokens kpool*p ..), None when every pool is kept (P <= topk /
    kpool: a context of at most topk tokens needs no ranking, and attention does not depend on the order of its
    tokens); positions [B, S] int64.
    """
    ends = torch.arange(pools, device=positions.device) * kpool + kpool - 1
    valid = ends <= positions.unsqueeze(-1)  # [B, S, P]
    if not indexer_ranks(pools, kpool, topk):
        chosen = torch.arange(pools, device=positions.device).expand(valid.shape)
    elif scores is None:
        raise ValueError(f"select_tokens: {pools} pools, more than the {topk // kpool} kept, need their scores")
    else:
        valid_scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        chosen = top_indices(valid_scores, topk // kpool)
    offsets = torch.arange(kpool, device=positions.device)
    tokens = (chosen.unsqueeze(-1) * kpool + offsets).masked_fill(~valid.gather(-1, chosen).unsqueeze(-1), INVALID)
    tokens = tokens.flatten(-2)
    if with_tail and kpool > 1:
        count = (positions + 1) % kpool  # tokens of the incomplete pool, the query's own included
        tail = (positions + 1 - count).unsqueeze(-1) + offsets[:-1]
        tokens = torch.cat([tokens, tail.masked_fill(offsets[:-1] >= count.unsqueeze(-1), INVALID)], dim=-1)
    return tokens


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest fp32 scores along the last dim, equal scores to the earlier index on every device
    (`topk` leaves ties unspecified, and the indexer's ReLU scores tie at 0): an exact (score, -index) key."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # monotonic in the float value
    later = torch.arange(scores.shape[-1] - 1, -1, -1, device=scores.device)
    return ((ordered << 32) | later).topk(k, dim=-1).indices


def absorbed_query(q: torch.Tensor, kv_b: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """q [.., heads, nope_dim] through the key half of kv_b_proj [heads * (nope + v), rank] -> [.., heads, rank]."""
    heads = q.shape[-2]
    w_k = kv_b.view(heads, -1, kv_b.shape[-1])[:, :nope_dim]  # [heads, nope, rank]
    return torch.einsum("...hd,hdr->...hr", q, w_k)


def sparse_mla(
    q_latent: torch.Tensor,
    latents: torch.Tensor,
    tokens: torch.Tensor,
    kv_b: torch.Tensor,
    nope_dim: int,
    scaling: float,
) -> torch.Tensor:
    """Attention of absorbed queries q_latent [B, S, heads, rank] over the cached latents [B, L, rank] at `tokens`
    [B, S, W] (INVALID masked) -> per-head values [B, S, heads, v_dim] through kv_b_proj's value half."""
    b, s, w = tokens.shape
    picked = latents.gather(1, tokens.clamp(min=0).reshape(b, s * w, 1).expand(-1, -1, latents.shape[-1]))
    picked = picked.view(b, s, w, -1)  # [B, S, W, rank]
    logits = torch.einsum("bshr,bswr->bshw", q_latent, picked).float() * scaling
    logits = logits.masked_fill((tokens < 0).unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(latents.dtype)
    mixed = torch.einsum("bshw,bswr->bshr", probs, picked)
    heads = q_latent.shape[-2]
    w_v = kv_b.view(heads, -1, kv_b.shape[-1])[:, nope_dim:]  # [heads, v_dim, rank]
    return torch.einsum("bshr,hdr->bshd", mixed, w_v)
