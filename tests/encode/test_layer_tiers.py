"""Tiers by layer (`--tiers share:...`, `depth:...`) end to end on the tiny model's two MoE layers: the layer whose
routed output is the larger share of its residual stream gets the upper K, the other the lower (`depth`: the first
layer the upper); the artifact states the per-layer counts in its config block and manifest, verify-manifest checks
them, `plan` predicts the files and the runtime serves both widths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from encode_fixtures import encode_tiered, tiny_source
from encode_fixtures import observed as observe_source
from typer.testing import CliRunner

from glmquant.arch import load_model_spec
from glmquant.checkpoint.artifact_config import LAYER_TIERS_KEY
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.cli import app
from glmquant.errors import UsageError
from glmquant.fixtures import TinyModelConfig
from glmquant.observe.hessians import HessianMode
from glmquant.observe.stats import LayerStats, stats_files
from glmquant.observe.tiers import TierSpec, write_tier_plan

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("layer-tiers")]

SPEC = "share:K3=1,K2=rest,K1=1"  # two MoE layers: K3 for the larger share, K1 for the other (K2's bytes)
# two MoE layers (no dense one) of two experts each: the least encoding that still ranks two layers
TWO_MOE_TWO_EXPERTS = TinyModelConfig(num_hidden_layers=2, first_dense_layers=0, n_routed_experts=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory, "layer-tiers-src", TWO_MOE_TWO_EXPERTS)


@pytest.fixture(scope="module")
def observed(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return observe_source(source, tmp_path_factory, "layer-tiers-obs", hessians=HessianMode.NATURAL)


@pytest.fixture(scope="module")
def tiered(source: Path, observed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encode_tiered(source, observed, tmp_path_factory.mktemp("layer-tiers") / "artifact", SPEC)


def _shares(observed: Path) -> dict[int, float]:
    shares = {layer: LayerStats.load(path).routed_share for layer, path in stats_files(observed).items()}
    assert all(v is not None and v > 0 for v in shares.values()), shares
    return {layer: float(v) for layer, v in shares.items() if v is not None}


def test_spec_ranks_layers_by_routed_share() -> None:
    spec = TierSpec.parse("share:K4=1,K3=25%,K2=rest,K1=2")
    assert spec.ranks_layers and not TierSpec.parse("reap:K2=rest").ranks_layers
    assert TierSpec.parse("depth:K3=1,K2=rest,K1=1").ranks_layers
    assert spec.assign([0.3, 0.9, 0.1, 0.5, 0.05, 0.2, 0.7, 0.4]) == (2, 4, 1, 3, 1, 2, 3, 2)
    with pytest.raises(UsageError, match="take 5 MoE layers, the model has 4"):
        TierSpec.parse("share:K3=3,K2=rest,K1=2").counts(4)


def test_the_larger_share_gets_the_upper_k(tiered: Path, observed: Path, source: Path) -> None:
    shares = _shares(observed)
    assert len(shares) == 2 and len(set(shares.values())) == 2
    upper = max(shares, key=lambda layer: shares[layer])
    want = {layer: 3 if layer == upper else 1 for layer in shares}
    experts = load_model_spec(source).n_routed_experts
    with SourceCheckpoint.open(tiered) as art:
        for layer, k in want.items():
            for e in range(experts):
                name = f"model.language_model.layers.{layer}.mlp.experts.{e}.up_proj.rank0.trellis"
                assert art.spec(name).shape[-1] == 16 * k
    plan = json.loads((tiered.with_name("artifact.work") / "tier_plan.json").read_text())
    assert plan["layers"] == {str(layer): [k] * experts for layer, k in want.items()}
    assert plan["layer_counts"] == {str(layer): {f"k{k}": experts} for layer, k in want.items()}
    assert plan["mean_bits"] == 2.0


def test_config_and_manifest_state_the_counts_of_each_layer(tiered: Path, source: Path, observed: Path) -> None:
    assert verify_artifact(tiered, fast=False).ok
    shares = _shares(observed)
    upper = max(shares, key=lambda layer: shares[layer])
    experts = load_model_spec(source).n_routed_experts
    by_layer = {str(layer): {f"k{3 if layer == upper else 1}": experts} for layer in sorted(shares)}
    qc = json.loads((tiered / "config.json").read_text())["quantization_config"]
    assert qc[LAYER_TIERS_KEY] == by_layer
    assert (qc["k1_experts_per_layer"], qc["k2_experts_per_layer"], qc["k3_experts_per_layer"]) == (None, 0, None)
    assert qc["selection"].startswith("per-layer tiers") and qc["target_routed_tier_bpw"] == 2.0
    manifest = json.loads((tiered / MANIFEST_NAME).read_text())
    assert manifest["layout"][LAYER_TIERS_KEY] == by_layer
    assert manifest["layout"]["tier_experts_per_layer"] == {"k1": None, "k3": None}
    with SourceCheckpoint.open(source) as src:
        shards = {n: src.shard_of(n) for n in src.names()}
    bits = {layer: (3 if layer == upper else 1,) * experts for layer in shares}
    plan = plan_artifact(load_model_spec(source), "tr3", 2, "mcg", shards, expert_bits=bits)
    assert {f.path: f.size for f in plan.files} == {e["path"]: e["bytes"] for e in manifest["files"]}


def test_verify_catches_a_wrong_layer_count(tiered: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiered, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    block = config["quantization_config"][LAYER_TIERS_KEY]
    first, second = sorted(block)
    block[first], block[second] = block[second], block[first]
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    report = verify_artifact(copy, fast=True)
    assert not report.ok and LAYER_TIERS_KEY in report.failure_summary()


def test_runtime_serves_each_layer_at_its_k(tiered: Path) -> None:
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.options import RuntimeOptions

    loaded = load_model(tiered, RuntimeOptions(dtype="float32"))
    widths = {
        layer: {loaded.artifact.read_expert(layer, v, "down_proj").bits for v in range(loaded.artifact.virtual_experts)}
        for layer in loaded.artifact.quantized_layers
    }
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    loaded.close()
    assert sorted(widths.values(), key=str) == [{1}, {3}] and torch.isfinite(logits).all()


def test_observations_without_energies_rank_by_depth_not_by_share(observed: Path, tmp_path: Path) -> None:
    """Observations written before the routed-output energies cannot rank layers by share: a clear error, not a
    guess; `depth` needs no statistics and puts the first MoE layer first."""
    old = shutil.copytree(observed, tmp_path / "old")
    for path in stats_files(old).values():
        stats = LayerStats.load(path)
        LayerStats(stats.tokens, stats.top_k, stats.count, stats.max_norm, stats.sums).save(path)
    with pytest.raises(UsageError, match="no routed-output energies"):
        write_tier_plan(old, TierSpec.parse(SPEC), path=tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()
    write_tier_plan(old, TierSpec.parse("reap:K2=rest"), path=tmp_path / "plan.json")  # REAP tiers still plan
    depth = json.loads(write_tier_plan(old, TierSpec.parse("depth:K3=1,K2=rest,K1=1"), path=tmp_path / "d").read_text())
    first, last = sorted(depth["layers"], key=int)
    assert (set(depth["layers"][first]), set(depth["layers"][last])) == ({3}, {1})
    assert depth["criterion"] == "depth" and depth["mean_bits"] == 2.0


def test_plan_predicts_depth_tiers_from_the_config_alone(source: Path, observed: Path, tmp_path: Path) -> None:
    """`plan --tiers depth:...` needs no observations and predicts what the depth tier plan's artifact holds;
    tiers that need observations are refused by name."""
    spec = "depth:K3=1,K2=rest,K1=1"
    written = write_tier_plan(observed, TierSpec.parse(spec), path=tmp_path / "depth.json")
    common = ["plan", str(source), "--source-index", str(source / "model.safetensors.index.json"), "--json"]
    runs = [CliRunner().invoke(app, [*common, *extra]) for extra in (["--tiers", spec], ["--tier-plan", str(written)])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    from_config, from_plan = (json.loads(r.output) for r in runs)
    assert from_config == from_plan
    assert from_config["tier_bitmap_sha256"] == json.loads(written.read_text())["bitmap_sha256"]
    trellises = [t for f in from_config["files"] for t in f["tensors"] if t["name"].endswith(".trellis")]
    assert {t["shape"][-1] // 16 for t in trellises if ".experts." in t["name"]} == {1, 3}  # K1 and K3 experts
    refused = CliRunner().invoke(app, [*common, "--tiers", SPEC])
    assert refused.exit_code == 2 and "need observations" in refused.output
    both = CliRunner().invoke(app, [*common, "--tiers", spec, "--tier-plan", str(written)])
    assert both.exit_code == 2 and "not both" in both.output


def test_layers_tiers_give_each_layer_its_named_k(source: Path, observed: Path, tmp_path: Path) -> None:
    """`--tiers layers:K1,K3` gives the first MoE layer K1 and the second K3, against the order of depth: the encode
    writes those widths, `plan` predicts its files from the config alone, and a spec of the wrong length is refused."""
    spec = load_model_spec(source)
    first, second = spec.moe_layers
    artifact = encode_tiered(source, observed, tmp_path / "artifact", "layers:K1,K3")
    with SourceCheckpoint.open(artifact) as art:
        for layer, k in ((first, 1), (second, 3)):
            for e in range(spec.n_routed_experts):
                name = f"model.language_model.layers.{layer}.mlp.experts.{e}.gate_proj.rank0.trellis"
                assert art.spec(name).shape[-1] == 16 * k
    manifest = json.loads((artifact / MANIFEST_NAME).read_text())
    common = ["plan", str(source), "--source-index", str(source / "model.safetensors.index.json"), "--json"]
    planned = CliRunner().invoke(app, [*common, "--tiers", "layers:K1,K3"])
    assert planned.exit_code == 0, planned.output
    assert {f["path"]: f["bytes"] for f in json.loads(planned.output)["files"]} == {
        e["path"]: e["bytes"] for e in manifest["files"]
    }
    refused = CliRunner().invoke(app, [*common, "--tiers", "layers:K1,K3,K2"])
    assert refused.exit_code == 2 and "3 widths, the model has 2 MoE layers" in refused.output
