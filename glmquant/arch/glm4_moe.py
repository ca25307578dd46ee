"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA attention with biases and optional QK norm, sigmoid-routed
experts with a correction bias, MTP layers appended after the decoder layers."""

from __future__ import annotations

from glmquant.arch.glm_common import DENSE_MLP, LAYER_NORMS, MOE, MTP_EXTRA
from glmquant.arch.roles import TensorRole as R
from glmquant.arch.spec import ModelSpec
from glmquant.arch.table import ArchitectureTable, TensorInfo, register
from glmquant.arch.table import Template as T


def _heads(s: ModelSpec) -> tuple[int, int, int]:
    head_dim = s.text.get("head_dim") or s.hidden_size // s.dim("num_attention_heads")
    return s.dim("num_attention_heads"), s.dim("num_key_value_heads"), int(head_dim)


def _attention(s: ModelSpec) -> tuple[T, ...]:
    q, kv, hd = _heads(s)
    group: list[T] = [
        T("self_attn.q_proj.weight", R.ATTENTION, lambda s: (q * hd, s.hidden_size)),
        T("self_attn.k_proj.weight", R.ATTENTION, lambda s: (kv * hd, s.hidden_size)),
        T("self_attn.v_proj.weight", R.ATTENTION, lambda s: (kv * hd, s.hidden_size)),
        T("self_attn.o_proj.weight", R.ATTENTION, lambda s: (s.hidden_size, q * hd)),
    ]
    if s.text.get("attention_bias", False):
        group += [
            T("self_attn.q_proj.bias", R.ATTENTION, lambda s: (q * hd,)),
            T("self_attn.k_proj.bias", R.ATTENTION, lambda s: (kv * hd,)),
            T("self_attn.v_proj.bias", R.ATTENTION, lambda s: (kv * hd,)),
        ]
    if s.text.get("use_qk_norm", False):
        group += [
            T("self_attn.q_norm.weight", R.ATTENTION, lambda s: (hd,)),
            T("self_attn.k_norm.weight", R.ATTENTION, lambda s: (hd,)),
        ]
    return tuple(group)


def layer_groups(s: ModelSpec, layer: int) -> list[tuple[T, ...]]:
    if layer >= s.num_hidden_layers:
        return [LAYER_NORMS, _attention(s), MOE, MTP_EXTRA]
    return [LAYER_NORMS, _attention(s), MOE if s.mlp_layer_types[layer] == "sparse" else DENSE_MLP]


def top_level(s: ModelSpec) -> list[TensorInfo]:
    out = [
        TensorInfo("model.embed_tokens.weight", R.EMBEDDING, (s.vocab_size, s.hidden_size), "BF16"),
        TensorInfo("model.norm.weight", R.NORM, (s.hidden_size,), "BF16"),
    ]
    if not s.tie_word_embeddings:
        out.append(TensorInfo("lm_head.weight", R.LM_HEAD, (s.vocab_size, s.hidden_size), "BF16"))
    return out


GLM4_MOE = register(ArchitectureTable("glm4_moe", "model.", top_level, layer_groups))
