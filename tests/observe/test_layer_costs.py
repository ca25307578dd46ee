"""`glmquant layer-costs`: each MoE layer's KL alone from one artifact, scaled to K1-K4 by sampled experts' output
errors, and the widths of least summed cost, which `plan --tiers` then lays out (tiny model, two MoE layers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from glmquant.arch import PROJECTIONS
from glmquant.calibration import TokenRows
from glmquant.cli import app
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.hessians import HessianSource
from glmquant.errors import UsageError
from glmquant.fixtures import UNTIED_INDEX_TOPK, TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.layer_costs import LayerCosts, layer_kl_alone, measure_layer_costs, output_error_by_bits
from glmquant.observe.run import observe
from glmquant.observe.streaming import TextModel
from glmquant.observe.tiers import TierSpec, allocate_layer_widths
from glmquant.runtime.artifact import open_artifact

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("layer-costs")]


@pytest.fixture(scope="module")
def narrow_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with experts 128 wide: each projection one EXL3 block in the ExLlamaV3 layout, a quarter of the
    default's encodes (which are most of these tests' time); layer costs read any layout."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("narrow-src"), TinyModelConfig(moe_intermediate_size=128))


@pytest.fixture(scope="module")
def observed(narrow_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("layer-costs-obs")
    observe(ObserveConfig(source=narrow_source, out=out, rows=4, tokens=64, tuning_tokens=128))
    return out


@pytest.fixture(scope="module")
def uniform_k2(narrow_source: Path, observed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("layer-costs-art") / "k2"
    encode_artifact(
        EncodeConfig(
            source=narrow_source,
            out=out,
            observations=observed,
            layout="exllamav3",
            verified_at="2026-01-01T00:00:00Z",
        ),
        Console(quiet=True),
    )
    return out


def test_kl_alone_is_the_whole_models_with_only_that_layers_experts_quantized(
    narrow_source: Path, observed: Path, uniform_k2: Path
) -> None:
    """The streamed pass (the source's streams and one fork per MoE layer) gives, for each layer, transformers' whole
    model with that layer's experts decoded from the artifact, against the whole model as it is."""
    from transformers import Glm5NextForConditionalGeneration

    ids = TokenRows.load(observed).lanes[0].ids.long()[:2]
    model = TextModel.open(narrow_source, "cpu", torch.float32)
    artifact = open_artifact(uniform_k2)
    layers = list(artifact.quantized_layers)
    assert layers == [1, 2]
    with model.ckpt:
        streamed = layer_kl_alone(model, artifact, layers, ids, batch_rows=1)

    whole = Glm5NextForConditionalGeneration.from_pretrained(str(narrow_source), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = F.log_softmax(whole(input_ids=ids).logits.float(), -1)
        for layer in layers:
            experts = whole.model.language_model.layers[layer].mlp.experts
            kept = experts.gate_up_proj.clone(), experts.down_proj.clone()
            for e in range(artifact.spec.n_routed_experts):
                w = {p: artifact.decode_expert(layer, e, p) for p in PROJECTIONS}
                experts.gate_up_proj[e] = torch.cat((w["gate_proj"], w["up_proj"]))
                experts.down_proj[e] = w["down_proj"]
            got = F.log_softmax(whole(input_ids=ids).logits.float(), -1)
            expected = float((reference.exp() * (reference - got)).sum(-1).mean())
            experts.gate_up_proj.copy_(kept[0])
            experts.down_proj.copy_(kept[1])
            assert expected > 0
            assert streamed[layer] == pytest.approx(expected, rel=1e-3, abs=1e-9), (layer, streamed, expected)
    artifact.checkpoint.close()


def test_cli_writes_costs_whose_tiers_plan_the_widths(
    narrow_source: Path, observed: Path, uniform_k2: Path, tmp_path: Path
) -> None:
    """The error falls with every added bit, the cost at the artifact's own K is the measured KL, the widths are the
    knapsack's over the costs at the artifact's mean K, and its `--tiers` text plans them (`plan`, whose structure
    is `encode --tiers`' own: tests/encode/test_layer_tiers.py)."""
    out = tmp_path / "costs.json"
    result = CliRunner().invoke(
        app,
        [
            "layer-costs",
            str(narrow_source),
            "--observations",
            str(observed),
            "--artifact",
            str(uniform_k2),
            "--out",
            str(out),
            "--rows",
            "2",
            "--experts",
            "1",
            "--dtype",
            "float32",
        ],
    )
    assert result.exit_code == 0, result.output
    costs = LayerCosts.load(out)
    assert costs.artifact_bits == {1: 2, 2: 2} and costs.mean_bits == 2.0 and costs.rows == 2
    assert costs.experts_sampled == {1: 1, 2: 1}
    for layer, error in costs.error.items():
        assert error[1] > error[2] > error[3] > error[4] > 0, error  # each added bit lowers the output error
        assert costs.cost[layer] == pytest.approx({k: costs.kl_alone[layer] * e / error[2] for k, e in error.items()})
    assert costs.widths == allocate_layer_widths(costs.cost, 2.0)
    assert costs.tiers == TierSpec.of_widths([costs.widths[1], costs.widths[2]]).text
    assert f"--tiers {costs.tiers}" in result.output
    assert json.loads(out.read_text())["format"] == "glmquant.layer_costs.v1"
    # `layer-widths`: the widths chosen again from these costs, without measuring again
    again = tmp_path / "again.json"
    assert CliRunner().invoke(app, ["layer-widths", str(out), "--out", str(again)]).exit_code == 0
    assert again.read_text() == out.read_text()  # the artifact's mean K again: the same file
    wider = tmp_path / "mean3.json"
    chosen = CliRunner().invoke(app, ["layer-widths", str(out), "--out", str(wider), "--mean-bits", "3"])
    rechosen = LayerCosts.load(wider)
    assert chosen.exit_code == 0 and rechosen.widths == allocate_layer_widths(costs.cost, 3.0)
    assert rechosen.mean_bits == 3.0 and f"--tiers {rechosen.tiers}" in chosen.output
    assert (rechosen.cost, rechosen.kl_alone, rechosen.error) == (costs.cost, costs.kl_alone, costs.error)
    torn = tmp_path / "torn.json"  # a layer missing from one table: refused, not a KeyError mid-choice
    torn.write_text(json.dumps({**json.loads(out.read_text()), "error": {"1": costs.error[1]}}))
    refused = CliRunner().invoke(app, ["layer-widths", str(torn), "--out", str(tmp_path / "t.json")])
    assert refused.exit_code == 2 and "its tables name different layers" in " ".join(refused.output.split())

    index = str(narrow_source / "model.safetensors.index.json")
    planned = CliRunner().invoke(
        app, ["plan", str(narrow_source), "--source-index", index, "--tiers", costs.tiers, "--json"]
    )
    assert planned.exit_code == 0, planned.output
    widths: dict[int, set[int]] = {}
    for f in json.loads(planned.output)["files"]:
        for t in f["tensors"]:
            if ".mlp.experts." in t["name"] and t["name"].endswith(".trellis"):
                widths.setdefault(int(t["name"].split(".layers.")[1].split(".")[0]), set()).add(t["shape"][-1] // 16)
    assert widths == {layer: {k} for layer, k in costs.widths.items()}


def test_experts_are_picked_across_the_sample_and_all_when_fewer_than_asked(
    narrow_source: Path, observed: Path, uniform_k2: Path
) -> None:
    """Sampled experts spread over the tuning sample's token counts, the most- and least-routed among them; every
    expert with sampled tokens when --experts asks for more (no K swept here: the picking alone)."""
    model = TextModel.open(narrow_source, "cpu", torch.float32)
    artifact = open_artifact(uniform_k2)
    hessians = HessianSource(observed, "natural")
    with model.ckpt:
        sample = hessians.layer(1).sample()
        assert sample is not None
        tokens = torch.bincount(sample.expert_ids.flatten(), minlength=model.spec.n_routed_experts)
        routed = [e for e in range(model.spec.n_routed_experts) if tokens[e] > 0]
        everyone, none_swept = output_error_by_bits(model, artifact, hessians, 1, 8, (), "cpu")
        assert everyone == routed and none_swept == {}
        ends, _ = output_error_by_bits(model, artifact, hessians, 1, 2, (), "cpu")
        assert (
            len(ends) == 2 and tokens[ends].max() == tokens[routed].max() and tokens[ends].min() == tokens[routed].min()
        )
    artifact.checkpoint.close()


def _with_one_k3_trellis(artifact: Path, out: Path) -> Path:
    """A copy of `artifact` whose layer 1 expert 0 down_proj trellis has K3's width: a layer of mixed K as its tensor
    headers show it (which is where layer costs read K from), without encoding a tiered artifact."""
    shutil.copytree(artifact, out)
    opened = open_artifact(out)
    name = opened.expert_prefix(1, 0, "down_proj") + ".trellis"
    opened.checkpoint.close()
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(shard), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(shard))
    k2 = tensors[name]
    tensors[name] = torch.zeros((*k2.shape[:-1], 48), dtype=k2.dtype)  # 16 x K int16 words per tile
    save_file(tensors, str(shard), metadata=metadata)
    return out


def test_bad_inputs_are_named(narrow_source: Path, observed: Path, uniform_k2: Path, tmp_path: Path) -> None:
    """Observations without a tuning sample, more rows than observed, a half-written artifact and one whose layers
    mix K are refused before the streamed pass, each with what to do."""
    plain = tmp_path / "plain-obs"
    observe(ObserveConfig(source=narrow_source, out=plain, rows=2, tokens=32))
    with pytest.raises(UsageError, match="--tuning-tokens"):
        measure_layer_costs(narrow_source, plain, uniform_k2, rows=1, experts=1)
    with pytest.raises(UsageError, match="fewer than --rows 99"):
        measure_layer_costs(narrow_source, observed, uniform_k2, rows=99)
    for mean_bits in (9.0, 0.5, float("nan")):  # refused before the pass, not after it
        with pytest.raises(UsageError, match=r"--mean-bits must be within K1..K4"):
            measure_layer_costs(narrow_source, observed, uniform_k2, rows=1, experts=1, mean_bits=mean_bits)
    cli = ["layer-costs", str(narrow_source), "--observations", str(observed), "--artifact", str(uniform_k2)]
    result = CliRunner().invoke(app, [*cli, "--out", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in result.output, result.output
    costs_file = tmp_path / "costs.json"
    for text, message in (  # layer-widths: a file that is not a layer costs file, or a damaged one, named
        ("[]", "not a layer costs file (format 'list'"),
        ('{"format": "glmquant.retained_costs.v1"}', "not a layer costs file (format 'glmquant.retained_costs.v1'"),
        ('{"format": "glmquant.layer_costs.v1", "kl_alone": {}}', "a damaged layer costs file (KeyError"),
    ):
        costs_file.write_text(text)
        bad = CliRunner().invoke(app, ["layer-widths", str(costs_file), "--out", str(tmp_path / "w.json")])
        assert bad.exit_code == 2 and message in " ".join(bad.output.split()) and costs_file.name in bad.output
    assert not (tmp_path / "w.json").exists()
    unfinished = tmp_path / "unfinished"
    shutil.copytree(uniform_k2, unfinished)
    (unfinished / "EXL3_MANIFEST.json").unlink()
    with pytest.raises(UsageError, match="EXL3_MANIFEST.json is missing"):
        measure_layer_costs(narrow_source, observed, unfinished, rows=1, experts=1)
    mixed = _with_one_k3_trellis(uniform_k2, tmp_path / "mixed")
    with pytest.raises(UsageError, match=r"layer 1's experts have K \[2, 3\]; layer costs need one K per layer"):
        measure_layer_costs(narrow_source, observed, mixed, rows=1, experts=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_costs_on_cuda_equal_the_cpus(tmp_path: Path) -> None:
    """The streamed pass on the GPU gives the CPU's KLs (float32); the sampled encodes its errors within the CUDA
    encoder's distance from the CPU's (the same quality, not the same codes). The tiny model's indexer keeps every
    pool here: the devices break its ties at ReLU's zero differently (glmquant/fixtures/tiny.py)."""
    source = build_tiny_checkpoint(tmp_path / "src", TinyModelConfig(index_topk=UNTIED_INDEX_TOPK))
    observe(ObserveConfig(source=source, out=tmp_path / "obs", rows=4, tokens=64, tuning_tokens=128))
    artifact, verified_at = tmp_path / "k2", "2026-01-01T00:00:00Z"
    config = EncodeConfig(source=source, out=artifact, observations=tmp_path / "obs", verified_at=verified_at)
    encode_artifact(config, Console(quiet=True))
    cpu, gpu = (
        measure_layer_costs(source, tmp_path / "obs", artifact, rows=2, experts=4, dtype="float32", device=device)
        for device in ("cpu", "cuda")
    )
    for layer, kl in cpu.kl_alone.items():
        assert gpu.kl_alone[layer] == pytest.approx(kl, rel=1e-3)
        assert gpu.error[layer] == pytest.approx(cpu.error[layer], rel=0.1)
