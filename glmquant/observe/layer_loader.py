"""Source tensors of one decoder layer -> a ready transformers `Glm5NextTextDecoderLayer`.

The layer is built on the meta device and only its own tensors are read from the safetensors shards, so
memory is one layer. Which tensor goes where, and in which dtype, is the arch module map's layer plan
(`glmquant.arch.module_map`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from glmquant.arch import ModelSpec, load_model_spec
from glmquant.arch.hf_glm5_next import modeling
from glmquant.arch.module_map import (
    ATTN_IMPLEMENTATION,
    EXPERTS_IMPLEMENTATION,
    fp32_names,
    layer_plan,
    read_layer_state,
)
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.errors import ConfigError


def text_config(
    source: str | Path,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    experts_implementation: str = EXPERTS_IMPLEMENTATION,
):
    """The transformers text config of a checkpoint, with the implementations from_pretrained would pick."""
    from transformers import AutoConfig

    spec = load_model_spec(Path(source) / "config.json")
    if spec.family != "glm5_next":
        raise ConfigError(f"{source}: layer streaming supports glm5_next checkpoints, not {spec.family}")
    cfg = AutoConfig.from_pretrained(str(source))
    cfg = getattr(cfg, "text_config", cfg)
    cfg._attn_implementation = attn_implementation
    cfg._experts_implementation = experts_implementation
    return cfg


def model_dtype(cfg) -> torch.dtype:
    """The dtype the model computes in (the config's `dtype`, BF16 for GLM-5.3-Flash)."""
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_decoder_layer(
    ckpt: SourceCheckpoint, spec: ModelSpec, cfg, layer: int, device: str | torch.device = "cpu"
) -> nn.Module:
    """Build decoder layer `layer` with its weights read from `ckpt`, in eval mode on `device`."""
    glm = modeling()

    if layer >= spec.num_hidden_layers:
        raise ConfigError(f"layer {layer} is not a decoder layer (the model has {spec.num_hidden_layers})")
    dtype = model_dtype(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = glm.Glm5NextTextDecoderLayer(cfg, layer)
    finally:
        torch.set_default_dtype(previous)
    keep_fp32 = fp32_names(glm.Glm5NextPreTrainedModel._keep_in_fp32_modules_strict)
    state = read_layer_state(
        ckpt, layer_plan(spec, layer, cfg.moe_intermediate_size), module.state_dict(), keep_fp32, torch.device(device)
    )
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()
