"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`): KDA linear attention, sparse MLA with a DSA indexer,
4-stream mHC hyper-connections, 288 sigmoid-routed experts, an MTP layer and a vision tower.

Names are those of the released checkpoint (what transformers' `save_pretrained` writes: per-expert
weights, split q/k/v convolutions, `hc_*` names), plus the MTP layer that transformers does not model.
"""

from __future__ import annotations

from glmquant.arch.glm_common import DENSE_MLP, LAYER_NORMS, MOE, MTP_EXTRA
from glmquant.arch.roles import TensorRole as R
from glmquant.arch.spec import ModelSpec
from glmquant.arch.table import ArchitectureTable, TensorInfo, register
from glmquant.arch.table import Template as T


def _kda(s: ModelSpec) -> tuple[int, int, int]:
    """(heads, head_dim, conv kernel) of the KDA layers, from either config spelling."""
    la = s.text.get("linear_attn_config") or {}
    heads = la.get("num_heads", s.text.get("linear_num_heads", 64))
    head_dim = la.get("head_dim", s.text.get("linear_head_dim", 128))
    kernel = la.get("short_conv_kernel_size", s.text.get("linear_conv_kernel_dim", 4))
    return int(heads), int(head_dim), int(kernel)


def _qk_head_dim(s: ModelSpec) -> int:
    return s.dim("qk_nope_head_dim") + s.dim("qk_rope_head_dim", 0)


def _hc_width(s: ModelSpec) -> int:
    return (2 + s.dim("hc_mult")) * s.dim("hc_mult")


def _kda_proj(s: ModelSpec) -> int:
    heads, head_dim, _ = _kda(s)
    return heads * head_dim


KDA = (
    T("self_attn.q_proj.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), s.hidden_size)),
    T("self_attn.k_proj.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), s.hidden_size)),
    T("self_attn.v_proj.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), s.hidden_size)),
    T("self_attn.q_conv1d.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), 1, _kda(s)[2])),
    T("self_attn.k_conv1d.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), 1, _kda(s)[2])),
    T("self_attn.v_conv1d.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), 1, _kda(s)[2])),
    T("self_attn.f_a_proj.weight", R.KDA_ATTENTION, lambda s: (_kda(s)[1], s.hidden_size)),
    T("self_attn.f_b_proj.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), _kda(s)[1])),
    T("self_attn.A_log", R.KDA_ATTENTION, lambda s: (_kda(s)[0],), "F32"),
    T("self_attn.dt_bias", R.KDA_ATTENTION, lambda s: (_kda_proj(s),), "F32"),
    T("self_attn.b_proj.weight", R.KDA_ATTENTION, lambda s: (_kda(s)[0], s.hidden_size)),
    T("self_attn.g_a_proj.weight", R.KDA_ATTENTION, lambda s: (_kda(s)[1], s.hidden_size)),
    T("self_attn.g_b_proj.weight", R.KDA_ATTENTION, lambda s: (_kda_proj(s), _kda(s)[1])),
    T("self_attn.o_norm.weight", R.KDA_ATTENTION, lambda s: (_kda(s)[1],)),
    T("self_attn.o_proj.weight", R.KDA_ATTENTION, lambda s: (s.hidden_size, _kda_proj(s))),
)

MLA = (
    T("self_attn.q_a_proj.weight", R.MLA_ATTENTION, lambda s: (s.dim("q_lora_rank"), s.hidden_size)),
    T("self_attn.q_a_layernorm.weight", R.MLA_ATTENTION, lambda s: (s.dim("q_lora_rank"),)),
    T(
        "self_attn.q_b_proj.weight",
        R.MLA_ATTENTION,
        lambda s: (s.dim("num_attention_heads") * _qk_head_dim(s), s.dim("q_lora_rank")),
    ),
    T(
        "self_attn.kv_a_proj_with_mqa.weight",
        R.MLA_ATTENTION,
        lambda s: (s.dim("kv_lora_rank") + s.dim("qk_rope_head_dim", 0), s.hidden_size),
    ),
    T("self_attn.kv_a_layernorm.weight", R.MLA_ATTENTION, lambda s: (s.dim("kv_lora_rank"),)),
    T(
        "self_attn.kv_b_proj.weight",
        R.MLA_ATTENTION,
        lambda s: (
            s.dim("num_attention_heads") * (s.dim("qk_nope_head_dim") + s.dim("v_head_dim")),
            s.dim("kv_lora_rank"),
        ),
    ),
    T(
        "self_attn.o_proj.weight",
        R.MLA_ATTENTION,
        lambda s: (s.hidden_size, s.dim("num_attention_heads") * s.dim("v_head_dim")),
    ),
)

DSA_INDEXER = (
    T(
        "self_attn.indexer.wq_b.weight",
        R.DSA_INDEXER,
        lambda s: (s.dim("index_n_heads") * s.dim("index_head_dim"), s.dim("q_lora_rank")),
    ),
    T("self_attn.indexer.wk.weight", R.DSA_INDEXER, lambda s: (s.dim("index_head_dim"), s.hidden_size)),
    T("self_attn.indexer.k_norm.weight", R.DSA_INDEXER, lambda s: (s.dim("index_head_dim"),)),
    T("self_attn.indexer.k_norm.bias", R.DSA_INDEXER, lambda s: (s.dim("index_head_dim"),)),
    T("self_attn.indexer.weights_proj.weight", R.DSA_INDEXER, lambda s: (s.dim("index_n_heads"), s.hidden_size)),
    T(
        "self_attn.indexer.index_kpool_compress_ape",
        R.DSA_INDEXER,
        lambda s: (s.dim("index_kpool"), s.dim("index_head_dim")),
    ),
    T("self_attn.indexer.index_kpool_compress_gate", R.DSA_INDEXER, lambda s: (s.dim("index_head_dim"), s.hidden_size)),
)

MHC = tuple(
    t
    for site in ("attn", "ffn")
    for t in (
        T(f"hc_{site}_fn", R.HYPER_CONNECTION, lambda s: (_hc_width(s), s.dim("hc_mult") * s.hidden_size)),
        T(f"hc_{site}_base", R.HYPER_CONNECTION, lambda s: (_hc_width(s),), "F32"),
        T(f"hc_{site}_scale", R.HYPER_CONNECTION, lambda s: (3,), "F32"),
    )
)


def _has_indexer(s: ModelSpec, layer: int) -> bool:
    types = s.text.get("indexer_types") or ["full"] * s.num_hidden_layers
    return layer >= s.num_hidden_layers or types[layer] == "full"


def layer_groups(s: ModelSpec, layer: int) -> list[tuple[T, ...]]:
    """The non-expert tensor groups of decoder layer `layer` (or of the MTP layer past the last one)."""
    if layer >= s.num_hidden_layers:  # MTP: sparse-MLA attention with indexer, MoE, no mHC
        return [LAYER_NORMS, MLA, DSA_INDEXER, MOE, MTP_EXTRA]
    groups = [LAYER_NORMS, MHC]
    if s.attention_types[layer] == "kda":
        groups.append(KDA)
    else:
        groups += [MLA, DSA_INDEXER] if _has_indexer(s, layer) else [MLA]
    groups.append(MOE if s.mlp_layer_types[layer] == "sparse" else DENSE_MLP)
    return groups


def _vision(s: ModelSpec) -> list[TensorInfo]:
    v = s.vision
    if not v:
        return []
    d, inter, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    head = d // v["num_heads"]
    merge, patch, tp = v.get("spatial_merge_size", 2), v["patch_size"], v.get("temporal_patch_size", 2)
    block = {
        "attn.qkv.weight": (3 * d, d),
        "attn.qkv.bias": (3 * d,),
        "attn.proj.weight": (d, d),
        "attn.proj.bias": (d,),
        "attn.q_norm.weight": (head,),
        "attn.k_norm.weight": (head,),
        "mlp.gate_proj.weight": (inter, d),
        "mlp.gate_proj.bias": (inter,),
        "mlp.up_proj.weight": (inter, d),
        "mlp.up_proj.bias": (inter,),
        "mlp.down_proj.weight": (d, inter),
        "mlp.down_proj.bias": (d,),
        "norm1.weight": (d,),
        "norm2.weight": (d,),
    }
    pinter = v.get("projection_intermediate_size", out)
    top = {
        "patch_embed.proj.weight": (d, v.get("in_channels", 3), tp, patch, patch),
        "patch_embed.proj.bias": (d,),
        "post_layernorm.weight": (d,),
        "downsample.weight": (out, d, merge, merge),
        "downsample.bias": (out,),
        "merger.proj.weight": (out, out),
        "merger.post_projection_norm.weight": (out,),
        "merger.post_projection_norm.bias": (out,),
        "merger.gate_proj.weight": (pinter, out),
        "merger.up_proj.weight": (pinter, out),
        "merger.down_proj.weight": (out, pinter),
    }
    names = {f"model.visual.blocks.{i}.{k}": shape for i in range(v["depth"]) for k, shape in block.items()}
    names.update({f"model.visual.{k}": shape for k, shape in top.items()})
    return [TensorInfo(n, R.VISION, tuple(shape), "BF16") for n, shape in names.items()]


def top_level(s: ModelSpec) -> list[TensorInfo]:
    p = "model.language_model."
    out = [
        TensorInfo(p + "embed_tokens.weight", R.EMBEDDING, (s.vocab_size, s.hidden_size), "BF16"),
        TensorInfo(p + "norm.weight", R.NORM, (s.hidden_size,), "BF16"),
    ]
    if not s.tie_word_embeddings:
        out.append(TensorInfo("lm_head.weight", R.LM_HEAD, (s.vocab_size, s.hidden_size), "BF16"))
    return out + _vision(s)


GLM5_NEXT = register(ArchitectureTable("glm5_next", "model.language_model.", top_level, layer_groups))
