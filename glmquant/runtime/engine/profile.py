"""Where a decode step's time and bytes go, per kernel class: KDA, MLA/DSA (indexer included), routed MoE (router
included), shared/dense MLP, lm_head, and the rest (mHC, norms, embedding, adds: the whole step minus the others).

`class_steps` gives each class as a function that runs it for every layer of the model on the engine's own weights
and caches, for B rows at one position, so a benchmark can capture and time it like the whole step. `class_bytes`
counts what each class reads per step: weights, plus cache state (KDA state read and written, MLA latents of the
selected tokens and the k-pool keys the indexer scores, none while it keeps every pool) and the routed experts'
EXL3 bytes; activations are not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING

import torch

from glmquant.arch.glm5_next_math import indexer_ranks
from glmquant.runtime.engine.blocks import kda_block, mla_block, mlp, routed_experts
from glmquant.runtime.engine.cache import KDACache, MLACache
from glmquant.runtime.engine.linears import Exl3Proj, project
from glmquant.runtime.engine.model import Engine
from glmquant.runtime.engine.weights import MLP, KDAWeights, MLAWeights, MoEBlock

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

CLASSES = ("kda", "mla_dsa", "routed_moe", "shared_dense_mlp", "lm_head")


def block_input(engine: Engine, batch: int, seed: int = 0, tokens: int = 1) -> torch.Tensor:
    """A normed block input [B, S, H] of S = `tokens` per row (a verify step's k + 1): unit RMS, the model dtype."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    x = torch.randn(batch, tokens, engine.cfg.hidden, generator=gen, device=engine.device)
    return x.to(engine.weights.embed.dtype)


def class_steps(engine: Engine, x: torch.Tensor, position: int) -> dict[str, Callable[[], object]]:
    """Each class over all layers for the rows of x [B, S, H] at positions `position`.. (caches of slots 0..B-1 are
    written; S > 1 is a verify step's work without its per-token KDA state records)."""
    cfg, w, run = engine.cfg, engine.weights, engine.decode_run
    batch, tokens = x.shape[:2]
    rows = engine.caches.rows(0, batch)
    positions = position + torch.arange(tokens, device=engine.device).expand(batch, tokens)
    pools = engine.pools_for(position + tokens)
    layers = list(enumerate(w.layers))
    kda = [
        (lw.attention, c)
        for i, lw in layers
        if isinstance(lw.attention, KDAWeights) and isinstance(c := rows[i], KDACache)
    ]
    mla = [
        (lw.attention, c)
        for i, lw in layers
        if isinstance(lw.attention, MLAWeights) and isinstance(c := rows[i], MLACache)
    ]
    moe = [(i, lw.mlp) for i, lw in layers if isinstance(lw.mlp, MoEBlock)]
    mlps = [lw.mlp if isinstance(lw.mlp, MLP) else lw.mlp.shared for _, lw in layers]

    def run_kda() -> object:
        return [kda_block(x, a, c, run) for a, c in kda]

    def run_mla() -> object:
        return [mla_block(x, a, c, positions, pools, run) for a, c in mla]

    def run_routed() -> object:
        return [routed_experts(x, m, i, run) for i, m in moe]

    def run_mlps() -> object:
        return [mlp(x, m, run) for m in mlps]

    def run_head() -> object:
        return project(run.ops.rms_norm(x.flatten(0, 1), w.norm, cfg.rms_eps), w.lm_head)  # every token's logits

    return dict(zip(CLASSES, (run_kda, run_mla, run_routed, run_mlps, run_head)))


def unique_experts(engine: Engine, x: torch.Tensor) -> int:
    """Logical experts the rows of x route to, summed over the MoE layers (each layer routes the same x)."""
    cfg, route, flat = engine.cfg, engine.decode_run.ops.route, x.reshape(-1, x.shape[-1])
    total = 0
    for lw in engine.weights.layers:
        if isinstance(lw.mlp, MoEBlock):
            ids, _ = route(flat, lw.mlp.router, lw.mlp.bias, cfg.top_k, cfg.routed_scaling, cfg.norm_topk)
            total += int(torch.unique(ids).numel())
    return total


def class_bytes(engine: Engine, batch: int, context: int, experts_routed: int, expert_bytes: int) -> dict[str, int]:
    """Bytes each class reads in one decode step of `batch` rows at `context` tokens, and "rest"'s weights.

    experts_routed: logical experts routed over all MoE layers (`unique_experts`); expert_bytes: the EXL3 bytes of
    one logical expert (gate, up and down, every rank slice)."""
    cfg, w = engine.cfg, engine.weights
    item = w.embed.element_size()
    layers = w.layers
    kda_state = _kda_state_bytes(engine, batch)
    selected = min(cfg.index_topk, context) + cfg.kpool - 1
    pools = engine.pools_for(context)
    scored = pools if indexer_ranks(pools, cfg.kpool, cfg.index_topk) else 0  # else kept unscored
    per_mla_row = selected * cfg.kv_rank * item + scored * cfg.index_dim * item
    mla = [lw.attention for lw in layers if isinstance(lw.attention, MLAWeights)]
    moe = [lw.mlp for lw in layers if isinstance(lw.mlp, MoEBlock)]
    return {
        "kda": sum(_nbytes(lw.attention) for lw in layers if isinstance(lw.attention, KDAWeights)) + 2 * kda_state,
        "mla_dsa": sum(_nbytes(a) for a in mla) + len(mla) * batch * per_mla_row,
        "routed_moe": sum(m.router.nbytes + m.bias.nbytes for m in moe) + experts_routed * expert_bytes,
        "shared_dense_mlp": sum(_nbytes(lw.mlp if isinstance(lw.mlp, MLP) else lw.mlp.shared) for lw in layers),
        "lm_head": w.lm_head.nbytes + w.norm.nbytes,  # an EXL3 head (`--head-bits`): its stored bytes
        "rest": sum(
            _nbytes(lw.attn_hc) + _nbytes(lw.ffn_hc) + lw.input_norm.nbytes + lw.post_norm.nbytes for lw in layers
        )
        + batch * cfg.hidden * item,
    }


def verify_bytes(engine: Engine, tokens: int, context: int, experts_routed: int, expert_bytes: int) -> dict[str, int]:
    """`class_bytes` of one verify step of `tokens` (k + 1) at `context`: the weights once, the routed experts its
    tokens route to (`experts_routed`, `unique_experts` of the k + 1 rows), and KDA's state written once more per
    extra token (the per-token records a rejected draft rolls back to)."""
    nbytes = class_bytes(engine, 1, context, experts_routed, expert_bytes)
    return nbytes | {"kda": nbytes["kda"] + (tokens - 1) * _kda_state_bytes(engine, 1)}


def mtp_draft_bytes(engine: Engine) -> int:
    """Weight bytes one drafted token reads: the MTP layer (eh_proj, norms, attention, router, shared expert and
    its top-k routed experts: the artifact's dense ones, or a draft file's EXL3 copy) and its draft head or else the
    target's lm_head; its MLA cache not counted."""
    mtp = engine.mtp
    if mtp is None:
        raise ValueError("the engine was loaded without its MTP layer")
    per_expert = mtp.experts.expert_bytes
    layer = sum(t.nbytes for t in (mtp.enorm, mtp.hnorm, mtp.eh_proj, mtp.input_norm, mtp.post_norm, mtp.head_norm))
    layer += _nbytes(mtp.attention) + mtp.mlp.router.nbytes + mtp.mlp.bias.nbytes + _nbytes(mtp.mlp.shared)
    head = engine.weights.lm_head if mtp.head is None else mtp.head
    return layer + engine.cfg.top_k * per_expert + head.nbytes


def exl3_stacks(engine: Engine) -> dict[str, int]:
    """The EXL3 stacks a plain decode step runs through `exl3_linear` (three launches each at batch 1) and the
    retained linears they hold (several in a stack: KDA's q, k, v; gate with up), over the text layers and the head."""
    layers = engine.weights.layers
    parts: list[DataclassInstance] = [lw.attention for lw in layers]
    parts += [lw.mlp if isinstance(lw.mlp, MLP) else lw.mlp.shared for lw in layers]
    projs = [engine.weights.lm_head, *(getattr(part, f.name) for part in parts for f in fields(part))]
    stacks = [b for p in projs if isinstance(p, Exl3Proj) for b in p.blocks if not isinstance(b, torch.Tensor)]
    return {"stacks": len(stacks), "linears": sum(int(b.trellis.shape[0]) for b in stacks)}


def _kda_state_bytes(engine: Engine, batch: int) -> int:
    """The KDA caches' bytes (recurrent and conv state) of slots 0..batch-1 over all layers."""
    return sum(_nbytes(c) for c in engine.caches.rows(0, batch) if isinstance(c, KDACache))


def _nbytes(obj: DataclassInstance) -> int:
    """Bytes of every tensor field of a weights or cache dataclass (an EXL3 projection's: its stored bytes)."""
    values = [getattr(obj, f.name) for f in fields(obj)]
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor | Exl3Proj))
