"""The role of every tensor in a GLM checkpoint, shared by every stage."""

from __future__ import annotations

from enum import Enum


class TensorRole(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ROUTER_WEIGHT = "router_weight"
    ROUTER_BIAS = "router_correction_bias"
    DENSE_MLP = "dense_mlp"
    ATTENTION = "attention"  # plain softmax attention (GLM-4.5 family)
    MLA_ATTENTION = "mla_attention"
    DSA_INDEXER = "dsa_indexer"
    KDA_ATTENTION = "kda_linear_attention"
    HYPER_CONNECTION = "mhc_hyper_connection"
    NORM = "norm"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    VISION = "vision_tower"
    MTP = "mtp_layer"  # MTP-only tensors (eh_proj, enorm, hnorm, shared_head.*)
