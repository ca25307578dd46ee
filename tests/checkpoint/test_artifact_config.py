"""Config pieces that the round trip does not isolate: which small files are copied, ExLlamaV3's storage map."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.arch import load_model_spec
from glmquant.checkpoint.artifact_config import copy_small_files, quantization_block, tensor_storage
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.provenance import Provenance
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.errors import UsageError


def test_copy_small_files(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    files = {
        "tokenizer.json": 10,
        "chat_template.jinja": 5,
        "generation_config.json": 3,
        "config.json": 3,
        "model.safetensors.index.json": 3,
        "model-00001-of-00002.safetensors": 8,
        "pytorch_model.bin": 8,
        ".gitattributes": 2,
        "big_vocab.txt": 2000,
        "EXL3_MANIFEST.json": 2,
    }
    for name, size in files.items():
        (src / name).write_bytes(b"x" * size)
    (src / "original").mkdir()
    copied = copy_small_files(src, out, limit=1000)
    assert copied == ["chat_template.jinja", "generation_config.json", "tokenizer.json"]
    assert sorted(p.name for p in out.iterdir()) == copied
    assert (out / "tokenizer.json").read_bytes() == b"x" * 10


def test_tensor_storage_groups_modules() -> None:
    specs = [
        TensorSpec("m.e.down_proj.trellis", "I16", (8, 16, 48)),
        TensorSpec("m.e.down_proj.suh", "F16", (128,)),
        TensorSpec("m.e.down_proj.svh", "F16", (256,)),
        TensorSpec("m.e.down_proj.mul1", "I32", ()),
        TensorSpec("m.norm.weight", "BF16", (256,)),
    ]
    storage = tensor_storage(specs)
    down = storage["m.e.down_proj"]
    assert down["quant_format"] == "exl3" and down["bits_per_weight"] == 3 and down["mul1_multiplier"] == 0x83DCD12D
    assert down["stored_tensors"]["m.e.down_proj.mul1"] == {"shape": [], "n_bytes": 4, "dtype": "torch.int32"}
    assert storage["m.norm"] == {
        "stored_tensors": {"m.norm.weight": {"shape": [256], "n_bytes": 512, "dtype": "torch.bfloat16"}}
    }


def test_tr3_tiers_only(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    block = quantization_block(plan_artifact(spec, "tr3", bits=3), Provenance("x"))
    tiers = (block["k2_experts_per_layer"], block["k3_experts_per_layer"], block["selection"])
    assert tiers == (0, 4, "all routed experts use K3")
    with pytest.raises(UsageError, match="K1 to K4 tiers only"):
        quantization_block(plan_artifact(spec, "tr3", bits=5), Provenance("x"))


def test_tr3_block_counts_mixed_tiers(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    tiers = dict.fromkeys(spec.moe_layers, (3, 2, 1, 2))
    block = quantization_block(plan_artifact(spec, "tr3", bits=2, expert_bits=tiers), Provenance("x"))
    counts = {k: v for k, v in block.items() if k.endswith("_experts_per_layer") and k.startswith("k")}
    assert counts == {
        "k1_experts_per_layer": 1,
        "k2_experts_per_layer": 2,
        "k3_experts_per_layer": 1,
        "k4_retained_experts_per_layer": 0,
    }
    assert block["target_routed_tier_bpw"] == 2.0 and block["selection"].startswith("per-expert tiers")
    uniform = quantization_block(plan_artifact(spec, "tr3", bits=2), Provenance("x"))
    assert "k1_experts_per_layer" not in uniform  # the release's keys exactly
