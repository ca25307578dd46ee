"""Per-expert bit widths (tiers) end to end on the tiny model: REAP tiers from the observations, each expert
encoded at its K, the artifact's manifest, config and files agreeing (verify-manifest), `plan` predicting the
same bytes, the runtime serving it, and serve-check's fidelity gate running on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from encode_fixtures import QUIET, encode_tiered, tiny_source
from encode_fixtures import observed as observe_source

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.manifest import MANIFEST_NAME, manifest_text
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.tiers import tier_bitmap_sha256
from glmquant.checkpoint.verify import verify_artifact
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.errors import UsageError
from glmquant.fixtures import TinyModelConfig
from glmquant.observe.hessians import HessianMode
from glmquant.observe.stats import LayerStats, stats_files
from glmquant.observe.tiers import TierSpec

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiers")]  # pytest-xdist: one worker builds the module fixtures

SPEC = "reap:K3=1,K2=rest,K1=1"
# the tiny model with one MoE layer (a dense KDA layer, then an MLA/DSA MoE layer) of its four 512-wide experts: SPEC's
# three tiers, with half the expert encodes of the three-layer tiny source's two MoE layers
ONE_MOE_FOUR_EXPERTS = TinyModelConfig(num_hidden_layers=2)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory, "tiers-src", ONE_MOE_FOUR_EXPERTS)


@pytest.fixture(scope="module")
def observed(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return observe_source(source, tmp_path_factory, "tiers-obs", hessians=HessianMode.BOTH, tiers=SPEC)


@pytest.fixture(scope="module")
def tiered(source: Path, observed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return encode_tiered(source, observed, tmp_path_factory.mktemp("tiers") / "artifact", SPEC, blend=0.5)


def test_spec_parsing_and_assignment() -> None:
    spec = TierSpec.parse("reap:K4=2,K3=25%,K2=rest,K1=1")
    assert spec.text == "reap:K4=2,K3=25%,K2=rest,K1=1" and spec.rest_bits == 2
    assert spec.counts(8) == [(4, 2), (3, 2), (2, 3), (1, 1)]
    assert spec.assign([0.1, 0.9, 0.5, 0.5, 0.2, 0.0, 0.7, 0.6]) == (2, 4, 3, 2, 2, 1, 4, 3)  # ties: lower id first
    for bad in ("reap:K3=1", "size:K2=rest", "reap:K2=rest,K2=1", "reap:K9=rest", "reap:K3=x,K2=rest"):
        with pytest.raises(UsageError):
            TierSpec.parse(bad)
    with pytest.raises(UsageError, match="take 9 experts"):
        TierSpec.parse("reap:K3=9,K2=rest").counts(8)


def test_experts_get_the_k_of_their_reap_rank(tiered: Path, observed: Path, source: Path) -> None:
    spec = load_model_spec(source)
    plan = json.loads((observed / "tier_plan.json").read_text())
    with SourceCheckpoint.open(tiered) as art:
        for layer, path in stats_files(observed).items():
            reap = LayerStats.load(path).reap
            ranked = sorted(range(spec.n_routed_experts), key=lambda e: (-float(reap[e]), e))
            want = {ranked[0]: 3, ranked[-1]: 1, ranked[1]: 2, ranked[2]: 2}
            assert plan["layers"][str(layer)] == [want[e] for e in range(4)]
            for e, k in want.items():
                name = f"model.language_model.layers.{layer}.mlp.experts.{e}.down_proj.rank0.trellis"
                assert art.spec(name).shape[-1] == 16 * k


def test_manifest_config_and_plan_agree(tiered: Path, source: Path, observed: Path) -> None:
    assert verify_artifact(tiered, fast=False).ok
    manifest = json.loads((tiered / MANIFEST_NAME).read_text())
    bits = {int(k): tuple(v) for k, v in json.loads((observed / "tier_plan.json").read_text())["layers"].items()}
    assert manifest["tier_bitmap_sha256"] == tier_bitmap_sha256(bits) and manifest["target_bpw"] == 2.0
    assert {e["tier"] for e in manifest["files"] if e["kind"] == "expert"} <= {
        "k1-k2",
        "k2-k3",
        "k1-k3",
        "k1-k2-k3",
        "k2",
    }
    assert manifest["layout"]["tier_experts_per_layer"] == {"k1": 1, "k2": 2, "k3": 1}
    assert manifest["calibration"]["routing"] == "blend:0.5"
    qc = json.loads((tiered / "config.json").read_text())["quantization_config"]
    assert (qc["k1_experts_per_layer"], qc["k2_experts_per_layer"], qc["k3_experts_per_layer"]) == (1, 2, 1)
    with SourceCheckpoint.open(source) as src:
        shards = {n: src.shard_of(n) for n in src.names()}
    plan = plan_artifact(load_model_spec(source), "tr3", 2, "mcg", shards, expert_bits=bits)
    assert {f.path: f.size for f in plan.files} == {e["path"]: e["bytes"] for e in manifest["files"]}


def test_verify_catches_a_wrong_tier_bitmap(tiered: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(tiered, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["tier_bitmap_sha256"] = "0" * 64
    (copy / MANIFEST_NAME).write_text(manifest_text(manifest))
    report = verify_artifact(copy, fast=True)
    assert not report.ok and "tier_bitmap_sha256" in report.failure_summary()


def test_runtime_serves_each_expert_at_its_k(tiered: Path) -> None:
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.options import RuntimeOptions

    loaded = load_model(tiered, RuntimeOptions(dtype="float32"))
    widths = {
        loaded.artifact.read_expert(layer, v, "gate_proj").bits
        for layer in loaded.artifact.quantized_layers
        for v in range(loaded.artifact.virtual_experts)
    }
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    loaded.close()
    assert widths == {1, 2, 3} and torch.isfinite(logits).all()


def test_serve_check_fidelity_gate_on_the_tiered_artifact(tiered: Path, source: Path, tmp_path: Path) -> None:
    from glmquant.servecheck import ServeCheckConfig, serve_check

    report = serve_check(
        ServeCheckConfig(
            artifact=tiered, bf16_source=source, gates=("fidelity",), out=tmp_path, panel_rows=1, panel_tokens=16
        )
    )
    metrics = report.gates[0].cases[0].metrics
    assert metrics["mean_kl"] >= 0 and 0 <= metrics["top1_agreement"] <= 1
    assert "mean KL <=" in json.loads((tmp_path / "serve-check.json").read_text())["thresholds"]["fidelity"]


def test_exllamav3_layout_with_tiers(source: Path, observed: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain"
    encode_artifact(
        EncodeConfig(
            source=source,
            out=out,
            observations=observed,
            layout="exllamav3",
            tier_plan=observed / "tier_plan.json",
        ),
        QUIET,
    )
    assert verify_artifact(out, fast=False).ok
    storage = json.loads((out / "quantization_config.json").read_text())["tensor_storage"]
    assert {m["bits_per_weight"] for m in storage.values() if "bits_per_weight" in m} == {1, 2, 3}


def test_tier_options_are_checked() -> None:
    with pytest.raises(UsageError, match="tr3 layout's tiers are K1..K4"):
        EncodeConfig(source=Path("s"), out=Path("o"), observations=Path("x"), tiers="reap:K5=1,K2=rest")  # type: ignore[arg-type]  # the config parses option text
    with pytest.raises(UsageError, match="needs --observations"):
        EncodeConfig(source=Path("s"), out=Path("o"), uncalibrated=True, tiers="reap:K3=1,K2=rest")  # type: ignore[arg-type]  # the config parses option text
    with pytest.raises(UsageError, match="--blend"):
        EncodeConfig(source=Path("s"), out=Path("o"), observations=Path("x"), hessians="all", blend=0.5)  # type: ignore[arg-type]  # the config parses option text


def test_plan_cli_predicts_the_tiered_files(source: Path, observed: Path, tiered: Path) -> None:
    from typer.testing import CliRunner

    from glmquant.cli import app

    run = CliRunner().invoke(
        app,
        [
            "plan",
            str(source),
            "--source-index",
            str(source / "model.safetensors.index.json"),
            "--tier-plan",
            str(observed / "tier_plan.json"),
            "--json",
            "--no-tensors",
        ],
    )
    assert run.exit_code == 0, run.output
    predicted = json.loads(run.output)
    manifest = json.loads((tiered / MANIFEST_NAME).read_text())
    assert {f["path"]: f["bytes"] for f in predicted["files"]} == {e["path"]: e["bytes"] for e in manifest["files"]}
    assert predicted["tier_bitmap_sha256"] == manifest["tier_bitmap_sha256"]


def test_gpu_backend_loads_one_stack_per_k(tiered: Path) -> None:
    pytest.importorskip("triton", reason="the GPU backend's stacks import triton")
    from glmquant.errors import CheckpointFormatError
    from glmquant.runtime.artifact import open_artifact
    from glmquant.runtime.kernels.backend import load_layer, load_tier_groups

    artifact = open_artifact(tiered)
    layer = artifact.quantized_layers[0]
    groups = load_tier_groups(artifact, layer, torch.device("cpu"))
    assert [g.weights.gate_up.bits for g in groups] == [1, 2, 3]
    local = torch.stack([g.local_id for g in groups])
    assert ((local >= 0).sum(0) == 1).all()  # every virtual expert in exactly one stack
    assert [int((g.local_id >= 0).sum()) for g in groups] == [4, 8, 4]  # 1, 2 and 1 experts x 4 rank slices
    with pytest.raises(CheckpointFormatError, match="several bit widths"):
        load_layer(artifact, layer, torch.device("cpu"))
    artifact.checkpoint.close()
