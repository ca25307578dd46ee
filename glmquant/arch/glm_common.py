"""Tensor groups every GLM MoE family shares: layer norms, the dense MLP, the sigmoid-routed MoE block (router,
correction bias, shared expert) and the MTP layer's extra projections."""

from __future__ import annotations

from glmquant.arch.roles import TensorRole as R
from glmquant.arch.table import Template as T
from glmquant.arch.table import mlp_group

LAYER_NORMS = (
    T("input_layernorm.weight", R.NORM, lambda s: (s.hidden_size,)),
    T("post_attention_layernorm.weight", R.NORM, lambda s: (s.hidden_size,)),
)

DENSE_MLP = mlp_group(R.DENSE_MLP, lambda s: s.intermediate_size, "mlp.")

MOE = (
    T("mlp.gate.weight", R.ROUTER_WEIGHT, lambda s: (s.n_routed_experts, s.hidden_size)),
    T("mlp.gate.e_score_correction_bias", R.ROUTER_BIAS, lambda s: (s.n_routed_experts,), "F32"),
    *mlp_group(R.SHARED_EXPERT, lambda s: s.moe_intermediate_size * s.n_shared_experts, "mlp.shared_experts."),
)

MTP_EXTRA = (
    T("eh_proj.weight", R.MTP, lambda s: (s.hidden_size, 2 * s.hidden_size)),
    T("enorm.weight", R.MTP, lambda s: (s.hidden_size,)),
    T("hnorm.weight", R.MTP, lambda s: (s.hidden_size,)),
    T("shared_head.norm.weight", R.MTP, lambda s: (s.hidden_size,)),
)
