"""EngineConfig: the dimensions and constants the runtime's own GLM-5.3-Flash forward needs, read once from
transformers' resolved text config (so its defaults and spellings, e.g. `linear_attn_config`, are transformers')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmquant.errors import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    hidden: int
    vocab: int
    layers: int
    rms_eps: float
    hc_mult: int
    hc_eps: float
    sinkhorn_iters: int
    layer_kinds: tuple[str, ...]  # "kda" | "mla" per decoder layer
    mlp_kinds: tuple[str, ...]  # "dense" | "sparse"
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    kda_lower_bound: float | None
    heads: int
    nope_dim: int
    v_dim: int
    kv_rank: int
    q_rank: int
    index_heads: int
    index_dim: int
    index_topk: int
    kpool: int
    kpool_tail: bool
    top_k: int
    routed_scaling: float
    norm_topk: bool
    swiglu_limit: float | None

    @property
    def kda_width(self) -> int:
        return self.kda_heads * self.kda_head_dim

    @classmethod
    def from_text_config(cls, c: Any) -> EngineConfig:
        """From a transformers `Glm5NextTextConfig`; ConfigError for what this forward does not implement."""
        kinds = tuple("kda" if t == "linear_attention" else "mla" for t in c.layer_types)
        shared = [i for i, (k, t) in enumerate(zip(kinds, c.indexer_types)) if k == "mla" and t != "full"]
        if c.qk_rope_head_dim or c.n_group != 1 or shared:
            raise ConfigError(
                f"the runtime's forward implements NoPE MLA, one expert group and a full indexer in "
                f"every MLA layer; the config has qk_rope_head_dim {c.qk_rope_head_dim}, "
                f"n_group {c.n_group}, shared-indexer layers {shared}"
            )
        return cls(
            hidden=c.hidden_size,
            vocab=c.vocab_size,
            layers=c.num_hidden_layers,
            rms_eps=c.rms_norm_eps,
            hc_mult=c.hc_mult,
            hc_eps=c.hc_eps,
            sinkhorn_iters=c.hc_sinkhorn_iters,
            layer_kinds=kinds,
            mlp_kinds=tuple(c.mlp_layer_types),
            kda_heads=c.linear_num_heads,
            kda_head_dim=c.linear_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            kda_lower_bound=c.linear_lower_bound,
            heads=c.num_attention_heads,
            nope_dim=c.qk_nope_head_dim,
            v_dim=c.v_head_dim,
            kv_rank=c.kv_lora_rank,
            q_rank=c.q_lora_rank,
            index_heads=c.index_n_heads,
            index_dim=c.index_head_dim,
            index_topk=c.index_topk,
            kpool=c.index_kpool,
            kpool_tail=c.index_kpool_always_select_tail,
            top_k=c.num_experts_per_tok,
            routed_scaling=c.routed_scaling_factor,
            norm_topk=c.norm_topk_prob,
            swiglu_limit=c.swiglu_limit,
        )
