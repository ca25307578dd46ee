"""Tensor classification: the tables know every tensor of the real config and of real checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from glmquant.arch import TensorRole, classify, load_model_spec, source_tensors
from glmquant.cli import app
from glmquant.errors import ConfigError, TensorCensusError


def _census(tensors):
    counts, sizes = Counter(), Counter()
    for t in tensors:
        group = (
            "mtp" if t.mtp else {TensorRole.VISION: "vision", TensorRole.ROUTED_EXPERT: "routed"}.get(t.role, "main")
        )
        counts[group] += 1
        sizes[group] += t.nbytes
    return counts, sizes


def test_real_config_census_matches_release(reference_config: Path) -> None:
    counts, sizes = _census(source_tensors(load_model_spec(reference_config)))
    # the release metadata: non-routed main 1,246 / 17,842,600,184 B; vision 347 / 1,127,254,016 B;
    # MTP 889 / 14,865,185,408 B; 42 MoE layers x 288 experts x 3 projections routed
    assert counts == {"main": 1246, "vision": 347, "mtp": 889, "routed": 42 * 288 * 3}
    assert sizes["main"] == 17_842_600_184
    assert sizes["vision"] == 1_127_254_016
    assert sizes["mtp"] == 14_865_185_408
    assert sizes["routed"] == 42 * 288 * 3 * 4096 * 2048 * 2
    assert round(sum(sizes.values()) / 1e9, 2) == 642.65  # the 642.65 GB BF16 source


def test_real_config_roles_and_dtypes(reference_config: Path) -> None:
    tensors = source_tensors(load_model_spec(reference_config))
    roles = Counter(t.role for t in tensors if not t.mtp)
    assert roles[TensorRole.ROUTER_WEIGHT] == roles[TensorRole.ROUTER_BIAS] == 42
    assert roles[TensorRole.HYPER_CONNECTION] == 45 * 6
    assert roles[TensorRole.KDA_ATTENTION] == 34 * 15
    assert roles[TensorRole.MLA_ATTENTION] == 11 * 7 and roles[TensorRole.DSA_INDEXER] == 11 * 7
    assert roles[TensorRole.DENSE_MLP] == 3 * 3 and roles[TensorRole.SHARED_EXPERT] == 42 * 3
    f32 = {t.name.rsplit(".", 1)[-1] for t in tensors if t.dtype == "F32"}
    assert f32 == {
        "e_score_correction_bias",
        "A_log",
        "dt_bias",
        "hc_attn_base",
        "hc_attn_scale",
        "hc_ffn_base",
        "hc_ffn_scale",
    }
    expert = next(t for t in tensors if t.name == "model.language_model.layers.44.mlp.experts.287.down_proj.weight")
    assert (expert.role, expert.layer, expert.expert, expert.proj, expert.shape) == (
        TensorRole.ROUTED_EXPERT,
        44,
        287,
        "down_proj",
        (4096, 2048),
    )


def test_tiny_checkpoint_every_tensor_classified(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    index = json.loads((tiny_source / "model.safetensors.index.json").read_text())
    infos = classify(spec, index["weight_map"])
    assert len(infos) == len(index["weight_map"])
    mtp = [i for i in infos.values() if i.mtp]
    assert {i.name.split(".layers.")[1].split(".")[0] for i in mtp} == {str(spec.num_hidden_layers)}
    assert sum(i.role is TensorRole.ROUTED_EXPERT for i in mtp) == spec.n_routed_experts * 3


def test_unknown_and_missing_names_fail_closed(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    names = [t.name for t in source_tensors(spec)]
    bogus = names[1:] + ["model.language_model.layers.1.mlp.experts.99.gate_proj.weight"]
    with pytest.raises(TensorCensusError) as err:
        classify(spec, bogus)
    assert err.value.unknown == ["model.language_model.layers.1.mlp.experts.99.gate_proj.weight"]
    assert err.value.missing == [names[0]]
    assert "experts.99" in str(err.value) and names[0] in str(err.value)


def test_bad_configs_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_spec(tmp_path)
    with pytest.raises(ConfigError, match="unsupported model_type"):
        load_model_spec({"model_type": "llama"})
    with pytest.raises(ConfigError, match="no such config"):
        load_model_spec(tmp_path / "missing")


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"hidden_size": None}, "missing required key 'text_config.hidden_size'"),
        ({"n_routed_experts": None}, "missing required key 'text_config.n_routed_experts'"),
        (
            {"num_hidden_layers": "three"},
            "'text_config.num_hidden_layers' has a bad value 'three' (expected an integer)",
        ),
        ({"moe_intermediate_size": [512]}, "'text_config.moe_intermediate_size' has a bad value [512]"),
        ({"hidden_size": "128"}, "'text_config.hidden_size' has a bad value '128' (expected an integer)"),
        ({"hidden_size": 128.0}, "'text_config.hidden_size' has a bad value 128.0 (expected an integer)"),
        ({"hidden_size": -8}, "'text_config.hidden_size' is -8; it must be at least 1"),
        ({"n_shared_experts": -1}, "'text_config.n_shared_experts' is -1; it must be at least 0"),
        ({"num_experts_per_tok": 99}, "'text_config.num_experts_per_tok' is 99, more than the 4 routed experts"),
        ({"mlp_layer_types": ["dense"]}, "text_config.mlp_layer_types must list 'dense'/'sparse' for each of 3 layers"),
        ({"layer_types": ["mla"]}, "text_config.layer_types must list one type for each of 3 layers"),
    ],
)
def test_a_missing_or_bad_key_names_the_config_file_and_the_key(
    tiny_source: Path, tmp_path: Path, edit: dict, message: str
) -> None:
    """A config.json without a required key, or with a value of the wrong kind, is refused naming the file and the
    key (it said "config is missing or has a bad value for invalid literal for int() ...", naming neither)."""
    source = tmp_path / "source"
    source.mkdir()
    config = json.loads((tiny_source / "config.json").read_text())
    for key, value in edit.items():
        if value is None:
            del config["text_config"][key]
        else:
            config["text_config"][key] = value
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(f"{source / 'config.json'}: {message}")):
        load_model_spec(source)
    result = CliRunner().invoke(app, ["plan", str(source)])
    assert result.exit_code == 2 and f"{source / 'config.json'}: {message}" in " ".join(result.output.split())


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            "model_type 'llama', text_config.model_type 'glm5_next_text': unsupported model_type 'llama'",
        ),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures ['LlamaForCausalLM'] is not a glm5_next model class"),
        ({"model_type": "glm4_moe"}, "the two levels name different models"),
    ],
)
def test_top_level_and_text_config_must_agree(tiny_source: Path, tmp_path: Path, edit: dict, message: str) -> None:
    """A config whose top level names another model than its text_config is refused by every stage, before any
    work, naming the file (it used to be encoded as a LlamaForCausalLM artifact, or end in a traceback)."""
    source = Path(shutil.copytree(tiny_source, tmp_path / "source"))
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_model_spec(source)
    runner = CliRunner()
    for args in (
        ["encode", source, "--out", tmp_path / "art", "--uncalibrated"],
        ["observe", source, "--out", tmp_path / "obs"],
        ["plan", source],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 2 and f"{source / 'config.json'}: " in " ".join(result.output.split()), result.output
    assert not (tmp_path / "art").exists() or not any((tmp_path / "art").iterdir())


def test_glm4_moe_table_matches_transformers(tmp_path: Path) -> None:
    """GLM-4.5-family names and shapes as transformers' save_pretrained writes them (plus the MTP layer)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(  # type: ignore[call-arg]  # the config keeps keys its signature does not name
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        head_dim=8,
        num_nextn_predict_layers=1,
    )
    Glm4MoeForCausalLM(cfg).save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has keys() but no __iter__
    spec = load_model_spec(tmp_path)
    expected = {t.name: t.shape for t in source_tensors(spec) if not t.mtp}
    assert saved == expected
    assert sum(t.mtp for t in source_tensors(spec)) > 0
