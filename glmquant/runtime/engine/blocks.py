"""The blocks of one GLM-5.3-Flash decoder layer on static caches: KDA, sparse MLA with the DSA indexer, the dense
MLP, the MoE block (router, routed experts through a backend, shared expert), joined by mHC hyper-connections.

Every block takes B rows of S new tokens, x [B, S, H], at positions [B, S] (int64, on the device) and the caches
of those rows. Nothing syncs with the host and every shape is fixed by (B, S, pools), so a decode step (S = 1)
can be captured in a CUDA graph; a prefill chunk (B = 1) runs the same code eagerly. The math comes from `Run.ops`
(eager or compiled PyTorch, `engine/ops.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glmquant.arch.glm5_next_math import indexer_ranks
from glmquant.runtime.engine.cache import KDACache, LayerCache, MLACache
from glmquant.runtime.engine.config import EngineConfig
from glmquant.runtime.engine.linears import project
from glmquant.runtime.engine.ops import Ops
from glmquant.runtime.engine.weights import MLP, Hyper, KDAWeights, LayerWeights, MLAWeights, MoEBlock
from glmquant.runtime.kernels.kda import kda
from glmquant.runtime.quantized_experts import ExpertBackend, expand_routes


@dataclass(frozen=True)
class Run:
    """What every block needs besides its weights and caches."""

    cfg: EngineConfig
    ops: Ops
    experts: ExpertBackend
    ranks: int  # virtual experts per logical expert (tr3: 4)


QUERY_BLOCK_BYTES = 1 << 30  # a prefill chunk's indexer scores and gathered latents are made this many bytes at a time


def decoder_layer(
    streams: torch.Tensor, layer: int, w: LayerWeights, cache: LayerCache, positions: torch.Tensor, pools: int, run: Run
) -> torch.Tensor:
    """streams [B, S, N, H] -> the next layer's streams (attention, then the feed-forward, each inside mHC)."""

    def attention(h: torch.Tensor) -> torch.Tensor:
        weights = w.attention
        if isinstance(weights, KDAWeights) and isinstance(cache, KDACache):
            return kda_block(h, weights, cache, run)
        if isinstance(weights, MLAWeights) and isinstance(cache, MLACache):
            return mla_block(h, weights, cache, positions, pools, run)
        raise TypeError(f"layer {layer}: {type(weights).__name__} with a {type(cache).__name__}")

    streams = _hyper_residual(streams, w.attn_hc, w.input_norm, run, attention)
    block = w.mlp
    if isinstance(block, MLP):
        return _hyper_residual(streams, w.ffn_hc, w.post_norm, run, lambda h: mlp(h, block, run))
    return _hyper_residual(streams, w.ffn_hc, w.post_norm, run, lambda h: moe_block(h, block, layer, run))


def _hyper_residual(
    streams: torch.Tensor, hc: Hyper, norm: torch.Tensor, run: Run, block: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """One block inside mHC: collapse the streams, norm, the block, spread its output and mix the streams."""
    cfg, ops = run.cfg, run.ops
    h, post, comb = ops.hyper_enter(
        streams, hc.fn, hc.base, hc.scale, norm, cfg.rms_eps, cfg.hc_eps, cfg.sinkhorn_iters
    )
    return ops.hyper_expand(post, comb, block(h), streams)


def mlp(x: torch.Tensor, w: MLP, run: Run) -> torch.Tensor:
    return project(run.ops.swiglu(project(x, w.gate_up), run.cfg.swiglu_limit), w.down)


def moe_block(x: torch.Tensor, w: MoEBlock, layer: int, run: Run) -> torch.Tensor:
    """Routed experts plus the shared expert."""
    return routed_experts(x, w, layer, run) + mlp(x, w.shared, run)


def routed_experts(x: torch.Tensor, w: MoEBlock, layer: int, run: Run) -> torch.Tensor:
    """noaux_tc routing, then the routed experts (rank slices as virtual experts) through the backend."""
    cfg, flat = run.cfg, x.reshape(-1, x.shape[-1])
    ids, weights = run.ops.route(flat, w.router, w.bias, cfg.top_k, cfg.routed_scaling, cfg.norm_topk)
    return run.experts.forward(layer, flat, *expand_routes(ids, weights, run.ranks)).view(x.shape)


def kda_block(x: torch.Tensor, w: KDAWeights, cache: KDACache, run: Run) -> torch.Tensor:
    """KDA linear attention: fused projections, causal conv over the cached inputs, the delta rule, gated norm."""
    cfg, ops = run.cfg, run.ops
    width, d, heads = cfg.kda_width, cfg.kda_head_dim, cfg.kda_heads
    qkv, f_a, g_a, b = project(x, w.in_proj).split([3 * width, d, d, heads], dim=-1)
    history = cache.history
    windows = None if history is None else history.windows
    q, k, v = causal_conv(qkv, w.conv, cache.conv, windows).unflatten(-1, (3, heads, d)).unbind(-3)
    g = ops.kda_gate(project(f_a, w.f_b), w.dt_bias, w.a_log, cfg.kda_lower_bound, d)
    out = kda(q, k, v, g, torch.sigmoid(b), cache.state, None if history is None else history.states)
    gate = project(g_a, w.g_b).unflatten(-1, (heads, d))
    return project(ops.gated_rms_norm(out, gate, w.o_norm, cfg.rms_eps).flatten(-2), w.o_proj)


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, windows: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal conv + SiLU of x [B, S, C] after the cached inputs state [B, kernel - 1, C] (updated);
    fp32 like the conv weight [C, kernel], returned in x's dtype. `windows` (one sequence's verify step) gets
    the cached inputs and x: any prefix's conv state can be put back from it."""
    window = torch.cat([state, x], dim=1)
    if windows is not None:
        windows[: window.shape[1]].copy_(window[0])
    state.copy_(window[:, -state.shape[1] :])
    if x.shape[1] == 1:
        out = (window.float() * weight.t()).sum(dim=1, keepdim=True)
    else:
        out = F.conv1d(window.transpose(1, 2).float(), weight.unsqueeze(1), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(out).to(x.dtype)


def mla_block(
    x: torch.Tensor, w: MLAWeights, cache: MLACache, positions: torch.Tensor, pools: int, run: Run
) -> torch.Tensor:
    """Sparse MLA: cache the new latents and indexer keys, score the first `pools` k-pools for every query, attend
    to the selected tokens' latents with absorbed queries. Queries go in blocks of bounded memory."""
    cfg, ops = run.cfg, run.ops
    q_a, kv, index_key, index_gate, head_w = project(x, w.in_proj).split(
        [cfg.q_rank, cfg.kv_rank, cfg.index_dim, cfg.index_dim, cfg.index_heads], dim=-1
    )
    q_resid = ops.rms_norm(q_a, w.q_norm, cfg.rms_eps)
    index_key = F.layer_norm(index_key, (cfg.index_dim,), w.k_norm_weight, w.k_norm_bias, 1e-6)
    _store(cache, positions, ops.rms_norm(kv, w.kv_norm, cfg.rms_eps), index_key, index_gate, w.ape, run)
    q, q_index = project(q_resid, w.q_b).split([cfg.heads * cfg.nope_dim, cfg.index_heads * cfg.index_dim], dim=-1)
    q_latent = ops.absorbed_query(q.unflatten(-1, (cfg.heads, cfg.nope_dim)), w.kv_b, cfg.nope_dim)
    q_index = q_index.unflatten(-1, (cfg.index_heads, cfg.index_dim))
    head_w = head_w.float() * cfg.index_heads**-0.5
    width = min(cfg.index_topk, pools * cfg.kpool) + cfg.kpool
    per_query = x.shape[0] * max(cfg.index_heads * pools * 4, width * (cfg.kv_rank * 2 + cfg.heads * 4))
    step = max(1, QUERY_BLOCK_BYTES // per_query)
    ranked = indexer_ranks(pools, cfg.kpool, cfg.index_topk)  # else every pool is kept: no scores
    outs = []
    for s in range(0, x.shape[1], step):
        block = slice(s, s + step)
        scores = (
            ops.index_scores(q_index[:, block], cache.pooled[:, :pools], head_w[:, block], cfg.index_dim**-0.5)
            if ranked
            else None
        )
        tokens = ops.select_tokens(scores, positions[:, block], pools, cfg.kpool, cfg.index_topk, cfg.kpool_tail)
        outs.append(ops.sparse_mla(q_latent[:, block], cache.latents, tokens, w.kv_b, cfg.nope_dim, cfg.nope_dim**-0.5))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return project(out.flatten(-2), w.o_proj)


def _store(
    cache: MLACache,
    positions: torch.Tensor,
    latent: torch.Tensor,
    index_key: torch.Tensor,
    index_gate: torch.Tensor,
    ape: torch.Tensor,
    run: Run,
) -> None:
    """Write the new positions' latents, indexer keys and gates, then recompute the k-pool key of every pool they
    touch (a pool's key is final once its last token is written; selection ignores pools not yet complete)."""
    b, s, kpool = *positions.shape, run.cfg.kpool

    def at(t: torch.Tensor) -> torch.Tensor:
        return positions.unsqueeze(-1).expand(b, s, t.shape[-1])

    for target, value in ((cache.latents, latent), (cache.index_keys, index_key), (cache.index_gates, index_gate)):
        target.scatter_(1, at(value), value.to(target.dtype))
    pool = positions // kpool  # [B, S]
    members = (pool.unsqueeze(-1) * kpool + torch.arange(kpool, device=pool.device)).flatten(1)  # [B, S kpool]

    def gather(t: torch.Tensor) -> torch.Tensor:
        return t.gather(1, members.unsqueeze(-1).expand(-1, -1, t.shape[-1])).unflatten(1, (s, kpool))

    pooled = run.ops.pool_keys(gather(cache.index_keys), gather(cache.index_gates), ape)  # [B, S, D]
    cache.pooled.scatter_(1, pool.unsqueeze(-1).expand(b, s, pooled.shape[-1]), pooled)
