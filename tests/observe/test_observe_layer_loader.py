"""A layer built from the source shards is the layer from_pretrained builds: same names, dtypes, values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmquant.arch import load_model_spec, table_for
from glmquant.arch.module_map import fp32_names, layer_plan, read_layer_state
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.errors import CheckpointFormatError, ConfigError
from glmquant.observe.layer_loader import load_decoder_layer, text_config


def test_layers_equal_from_pretrained(tiny_source: Path) -> None:
    from transformers import Glm5NextForConditionalGeneration

    full = Glm5NextForConditionalGeneration.from_pretrained(str(tiny_source), dtype=torch.bfloat16)
    spec, cfg = load_model_spec(tiny_source), text_config(tiny_source)
    with SourceCheckpoint.open(tiny_source) as ckpt:
        for i in range(spec.num_hidden_layers):
            want = full.model.language_model.layers[i].state_dict()
            got = load_decoder_layer(ckpt, spec, cfg, i).state_dict()
            assert list(got) == list(want)
            for name, value in want.items():
                assert got[name].dtype == value.dtype, name
                assert torch.equal(got[name], value), name
    assert want["mlp.gate.e_score_correction_bias"].dtype == torch.float32  # fp32 in every transformers version


def test_plan_places_every_source_tensor_once(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    plan = layer_plan(spec, 1, spec.moe_intermediate_size)
    prefix = table_for(spec).layer_prefix(1)
    sources = [p.source for p in plan.placements]
    assert sorted(sources) == sorted(t.name for t in table_for(spec).layer_tensors(spec, 1))
    up = next(p for p in plan.placements if p.source == f"{prefix}mlp.experts.3.up_proj.weight")
    assert up.target == "mlp.experts.gate_up_proj" and up.where == (3, slice(512, 1024))
    assert plan.source_of("self_attn.forget_gate.A_log") == f"{prefix}self_attn.A_log"
    assert plan.source_of("attn_hc.fn") == f"{prefix}hc_attn_fn"
    assert plan.source_of("self_attn.conv1d.weight") is None  # q/k/v concatenated, not one tensor


class _Missing:
    """A checkpoint view that lacks one tensor."""

    def __init__(self, ckpt: SourceCheckpoint, missing: str) -> None:
        self.ckpt, self.missing, self.directory = ckpt, missing, ckpt.directory

    def __contains__(self, name: str) -> bool:
        return name != self.missing and name in self.ckpt

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.ckpt.read_tensor(name)

    def shard_of(self, name: str) -> str:
        return self.ckpt.shard_of(name)


def test_missing_tensor_is_named(tiny_source: Path) -> None:
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

    spec, cfg = load_model_spec(tiny_source), text_config(tiny_source)
    with torch.device("meta"):
        meta = Glm5NextTextDecoderLayer(cfg, 2).state_dict()
    missing = table_for(spec).expert_name(2, 1, "down_proj")
    with SourceCheckpoint.open(tiny_source) as ckpt, pytest.raises(CheckpointFormatError, match=missing):
        read_layer_state(_Missing(ckpt, missing), layer_plan(spec, 2, 512), meta, None, torch.device("cpu"))
    with SourceCheckpoint.open(tiny_source) as ckpt, pytest.raises(ConfigError, match="not a decoder layer"):
        load_decoder_layer(ckpt, spec, cfg, spec.num_hidden_layers)


def test_fp32_patterns_follow_transformers_globs() -> None:
    pattern = fp32_names(["gate.weight", "attn_hc.*", "A_log"])
    assert pattern is not None
    assert pattern.search("mlp.gate.weight") and pattern.search("attn_hc.scale")
    assert pattern.search("self_attn.forget_gate.A_log")
    assert not pattern.search("mlp.shared_experts.gate_proj.weight")
    assert fp32_names(None) is None
