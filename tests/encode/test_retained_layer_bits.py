"""The speed tier with a K per decoder layer (`encode --retained-layer-bits K3,K5` on the ONE_MOE model): each layer's
retained linears are stored at their own K, the artifact is what `plan` predicts, its manifest and config block state
the widths, verify-manifest checks the files against them, and the runtime runs each linear at its K.
One K for every layer (`--retained-bits`, `--retained-exact-layers`): test_retained_bits.py. `glmquant
retained-costs` measures on this build the costs it chooses such widths from."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from encode_fixtures import ONE_MOE, QUIET, another_checkpoint, assert_verify_manifest_cli, observed, tiny_source
from safetensors.torch import save_file
from typer.testing import CliRunner

from glmquant.arch import load_model_spec, table_for
from glmquant.calibration import TokenRows
from glmquant.checkpoint.layouts import check_layer_bits, parse_layer_bits, plan_artifact, quantizable_retained
from glmquant.checkpoint.manifest import MANIFEST_NAME, manifest_text
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.checkpoint.verify_report import MAX_SHOWN
from glmquant.cli import app
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.run import EncodeResult
from glmquant.errors import UsageError
from glmquant.exl3 import decode_weight
from glmquant.fixtures import UNTIED_INDEX_TOPK
from glmquant.observe.retained_costs import RetainedCosts, choose_retained_widths, measure_retained_costs
from glmquant.observe.streaming import TextModel, run_layer
from glmquant.runtime.artifact import Artifact, open_artifact
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear

# one encode of the ONE_MOE model with its retained linears at K3 and K5, on one pytest-xdist worker (not one per
# worker that runs a test of this module)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("retained-layer-bits")]

WIDTHS = (3, 5)  # layer 0 (dense MLP) at K3, layer 1 (MoE: attention, shared expert) at K5
PROMPT = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]])
# measured 0.00061 on the CPU (K3 dense MLP, K5 attention and shared expert); a broken linear costs orders more
KL_BOUND = 0.01


@pytest.fixture(scope="module")
def by_layer(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path_factory: pytest.TempPathFactory
) -> EncodeResult:
    cfg = EncodeConfig(
        source=one_moe_source,
        out=tmp_path_factory.mktemp("layer-bits") / "art",
        observations=one_moe_dense_observations,
        retained_layer_bits="K3,K5",  # type: ignore[arg-type]  # the CLI's text, parsed by EncodeConfig
        verified_at="2026-01-01T00:00:00Z",
    )
    result = encode_artifact(cfg, QUIET)
    assert result is not None
    return result


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """ONE_MOE with an indexer that keeps every pool (UNTIED_INDEX_TOPK), its dense observations and its artifact at
    K3,K5: (source, observations, artifact), for comparing the CPU with CUDA."""
    source = tiny_source(tmp_path_factory, "untied-src", replace(ONE_MOE, index_topk=UNTIED_INDEX_TOPK))
    observations = observed(source, tmp_path_factory, "untied-obs", dense_hessians=True)
    out = tmp_path_factory.mktemp("untied-art") / "art"
    config = EncodeConfig(
        source=source,
        out=out,
        observations=observations,
        retained_layer_bits="K3,K5",  # type: ignore[arg-type]  # the CLI's text, parsed by EncodeConfig
        verified_at="2026-01-01T00:00:00Z",
    )
    encode_artifact(config, QUIET)
    return source, observations, out


def test_each_layer_is_stored_at_its_k_as_planned(one_moe_source: Path, by_layer: EncodeResult) -> None:
    art = by_layer.artifact.directory
    with SourceCheckpoint.open(one_moe_source) as source:
        shards = {n: source.shard_of(n) for n in source.names()}
    spec = load_model_spec(one_moe_source)
    plan = plan_artifact(spec, "tr3", 2, "mcg", shards, retained_layer_bits=WIDTHS)
    assert sorted(p.name for p in art.glob("*.safetensors")) == sorted(f.path for f in plan.files)
    stored: dict[str, tuple[int, ...]] = {}
    for f in plan.files:
        with SourceCheckpoint.open(art / f.path) as ckpt:
            found = {n: (ckpt.spec(n).dtype, tuple(ckpt.spec(n).shape)) for n in ckpt.names()}
        assert found == {t.name: (t.dtype, t.shape) for t in f.tensors}, f.path
        stored.update((n, shape) for n, (_, shape) in found.items())
    linears = quantizable_retained(spec)
    assert {t.layer for t in linears} == {0, 1}
    for t in linears:  # every retained linear of layer L is an EXL3 tensor of K WIDTHS[L], no exact copy left
        assert t.layer is not None and t.name not in stored
        assert stored[t.name.removesuffix(".weight") + ".trellis"][-1] == 16 * WIDTHS[t.layer], t.name
    assert "lm_head.weight" in stored  # no --head-bits: the head stays exact
    manifest = json.loads((art / MANIFEST_NAME).read_text())
    block = json.loads((art / "config.json").read_text())["quantization_config"]
    for declared in (manifest["layout"], block):
        assert declared["retained_layer_bits"] == list(WIDTHS)
        assert not {"retained_bits", "retained_exact_layers", "head_bits"} & set(declared)


def test_verify_manifest_passes(by_layer: EncodeResult) -> None:
    assert_verify_manifest_cli(by_layer)


def test_verify_catches_widths_the_files_do_not_hold(by_layer: EncodeResult, tmp_path: Path) -> None:
    """A manifest stating layer 1 at K4 calls for K4 trellises where the files hold K5 ones: verify-manifest names
    them, and counts the config block that disagrees with the manifest among them."""
    copy = shutil.copytree(by_layer.artifact.directory, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    manifest["layout"]["retained_layer_bits"] = [3, 4]
    (copy / MANIFEST_NAME).write_text(manifest_text(manifest))
    report = verify_artifact(copy, fast=True)
    detail = next(c.detail for c in report.checks if c.name == "config geometry")
    assert report.failed == ["config geometry"]
    assert "layers.1.self_attn.o_proj.trellis: I16 [8, 8, 80], config implies I16 [8, 8, 64]" in detail
    layer1 = [t for t in quantizable_retained(load_model_spec(copy)) if t.layer == 1]
    assert f"(+{len(layer1) + 1 - MAX_SHOWN} more)" in detail  # each layer-1 trellis, and the config's block


def test_runtime_runs_each_linear_at_its_layers_k(one_moe_source: Path, by_layer: EncodeResult) -> None:
    """The runtime reads each linear's K from its tensors: layer 0's at K3, layer 1's at K5; a prompt's logits stay
    close to those of the same artifact with the exact source weights put back (K3-K5 error, not a broken linear)."""
    art = by_layer.artifact.directory
    options = RuntimeOptions(dtype="float32")
    runs = []
    for exact in (False, True):
        loaded = load_model(art, options)
        modules = [m for m in loaded.model.modules() if isinstance(m, Exl3Linear)]
        assert {(m.source, m.bits) for m in modules} == {
            (t.name, WIDTHS[t.layer]) for t in quantizable_retained(loaded.artifact.spec) if t.layer is not None
        }
        if exact:
            with SourceCheckpoint.open(one_moe_source) as source:
                for m in modules:
                    m.weight = source.read_tensor(m.source).float()
        with torch.no_grad():
            runs.append(loaded.model(input_ids=PROMPT).logits[0].float().log_softmax(-1))
    fast, exact_logits = runs
    kl = float((exact_logits.exp() * (exact_logits - fast)).sum(-1).mean())
    assert 0 < kl < KL_BOUND, kl


def _kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    got = logits.float().log_softmax(-1)
    return float((reference.exp() * (reference - got)).sum(-1).mean())


def test_retained_costs_measure_each_layers_kl_alone_and_choose_within_the_budget(
    one_moe_source: Path, one_moe_dense_observations: Path, by_layer: EncodeResult, tmp_path: Path
) -> None:
    """`glmquant retained-costs` on this K3,K5 build: each layer's KL alone is transformers' whole model with only
    that layer's retained linears decoded from the artifact; costs fall with K to exact's 0, equal the KL alone at
    the artifact's K at every K measured, and with `--widths K2,K4,exact` the widths are the cheapest choice of those
    within the artifact's bytes."""
    from transformers import Glm5NextForConditionalGeneration

    art = by_layer.artifact.directory
    out = tmp_path / "costs.json"
    args = ["retained-costs", str(one_moe_source), "--observations", str(one_moe_dense_observations)]
    args += ["--artifact", str(art), "--out", str(out), "--rows", "2", "--dtype", "float32", "--batch-rows", "1"]
    # output rows per linear: fewer pad to one 128-wide EXL3 block all the same, and a linear of 128 outputs or fewer
    # is then encoded whole, as the build encoded it at its layer's K (the suite's encode memo reads that one back)
    args += ["--outputs", "128"]
    result = CliRunner().invoke(app, [*args, "--widths", "K2,K4,exact"])
    assert result.exit_code == 0, result.output
    costs = json.loads(out.read_text())
    assert costs["artifact_bits"] == {"0": 3, "1": 5}
    assert f"--retained-layer-bits {costs['retained_layer_bits']}" in " ".join(result.output.split())
    assert costs["offered"] == ["K2", "K4", "exact"]  # every width measured, these alone chosen among
    for widths, message in (
        ("K2,K9", "--widths takes K2..K6 and exact, got K2,K9"),
        ("K2,4", "entry 1 ('4') is neither"),
    ):
        bad = CliRunner().invoke(app, [*args[:6], "--out", str(tmp_path / "bad.json"), "--widths", widths])
        assert bad.exit_code == 2 and message in " ".join(bad.output.split()), bad.output

    ids = TokenRows.load(one_moe_dense_observations).lanes[0].ids.long()[:2]
    whole = Glm5NextForConditionalGeneration.from_pretrained(str(one_moe_source), dtype=torch.float32).eval()
    artifact = open_artifact(art)
    try:
        _check_against_transformers(costs, artifact, whole, ids)
        stored: dict[str, dict[str, int]] = {}  # the options' bytes: what the artifact stores, BF16 for exact
        for linear in artifact.retained_linears.values():
            if linear.layer is not None:
                tensors = artifact.read_linear(linear).tensors(linear.key).values()
                layer = stored.setdefault(str(linear.layer), {"stored": 0, "exact": 0})
                layer["stored"] += sum(t.numel() * t.element_size() for t in tensors)
                layer["exact"] += 2 * linear.in_features * linear.out_features
    finally:
        artifact.checkpoint.close()
    for layer, k in costs["artifact_bits"].items():
        assert costs["nbytes"][layer][f"K{k}"] == stored[layer]["stored"]
        assert costs["nbytes"][layer]["exact"] == stored[layer]["exact"]

    options = ["K2", "K3", "K4", "K5", "K6", "exact"]
    for layer, k in costs["artifact_bits"].items():
        by_option = costs["cost"][layer]
        assert by_option[f"K{k}"] == pytest.approx(costs["kl_alone"][layer])
        error = costs["error"][layer]  # cost = KL alone x (error ratio) ** g, g the default 0.5
        assert costs["error_exponent"] == 0.5
        for option in options[:-1]:
            ratio = error[option] / error[f"K{k}"]
            assert by_option[option] == pytest.approx(costs["kl_alone"][layer] * ratio**0.5)
        assert [by_option[o] for o in options] == sorted((by_option[o] for o in options), reverse=True)
        assert len({by_option[o] for o in options}) == len(options) and by_option["exact"] == 0
    nbytes = costs["nbytes"]
    assert costs["budget_bytes"] == nbytes["0"]["K3"] + nbytes["1"]["K5"]
    choices = [
        (costs["cost"]["0"][a] + costs["cost"]["1"][b], (a, b))
        for a in costs["offered"]
        for b in costs["offered"]
        if nbytes["0"][a] + nbytes["1"][b] <= costs["budget_bytes"]
    ]
    best = min(choices)[0]
    assert costs["predicted_kl"] == pytest.approx(best)
    assert costs["retained_layer_bits"] == ",".join(costs["widths"][layer] for layer in ("0", "1"))
    check_layer_bits(None, 0, parse_layer_bits(costs["retained_layer_bits"]), load_model_spec(one_moe_source))

    # `retained-widths`: other choices from these costs, without measuring again
    again = tmp_path / "again.json"
    chosen = CliRunner().invoke(app, ["retained-widths", str(out), "--out", str(again), "--widths", "K2,K4,exact"])
    assert chosen.exit_code == 0 and f"--retained-layer-bits {costs['retained_layer_bits']}" in chosen.output
    assert json.loads(again.read_text()) == costs  # the same settings choose the same widths, the file unchanged
    wider = tmp_path / "mean45.json"  # --mean-bits 4.5: halfway between uniform K4's and K5's bytes, all options
    assert (
        CliRunner().invoke(app, ["retained-widths", str(out), "--out", str(wider), "--mean-bits", "4.5"]).exit_code == 0
    )
    loaded = RetainedCosts.load(wider)
    uniform = {k: sum(by_option[k] for by_option in loaded.nbytes.values()) for k in (4, 5)}
    assert loaded.budget_bytes == round((uniform[4] + uniform[5]) / 2) and loaded.offered == (2, 3, 4, 5, 6, None)
    within = [
        (loaded.cost[0][a] + loaded.cost[1][b], (a, b))
        for a in loaded.offered
        for b in loaded.offered
        if loaded.nbytes[0][a] + loaded.nbytes[1][b] <= loaded.budget_bytes
    ]
    assert (
        loaded.predicted_kl == pytest.approx(min(within)[0]) and (loaded.widths[0], loaded.widths[1]) == min(within)[1]
    )
    torn = tmp_path / "torn.json"  # a layer missing from one table: refused, not a KeyError mid-choice
    torn.write_text(json.dumps({**costs, "kl_alone": {"0": costs["kl_alone"]["0"]}}))
    refused = CliRunner().invoke(app, ["retained-widths", str(torn), "--out", str(tmp_path / "t.json")])
    assert refused.exit_code == 2 and "its tables name different layers" in " ".join(refused.output.split())
    steeper = choose_retained_widths(loaded, error_exponent=1.0)  # g = 1: each cost the KL alone x the error ratio
    for index, built in loaded.artifact_bits.items():
        ratio = loaded.error[index][2] / loaded.error[index][built]
        assert steeper.cost[index][2] == pytest.approx(loaded.kl_alone[index] * ratio)


def test_retained_costs_bad_inputs(
    one_moe_source: Path, one_moe_dense_observations: Path, by_layer: EncodeResult, tmp_path: Path
) -> None:
    """A width outside K2-K6 and exact, a mean outside K2-K6, observations without a layer's dense Hessians and an
    artifact of another model are refused before the pass, naming what is wrong; `retained-widths` refuses a file
    that is not a costs file, or a damaged one, naming it."""
    art = by_layer.artifact.directory
    for bad in ([7], [], [1, None]):
        with pytest.raises(UsageError, match="--widths takes K2..K6 and exact"):
            measure_retained_costs(one_moe_source, one_moe_dense_observations, art, offered=bad)
    with pytest.raises(UsageError, match=r"--error-exponent must be in \(0, 2\], got 0"):
        measure_retained_costs(one_moe_source, one_moe_dense_observations, art, error_exponent=0)
    with pytest.raises(UsageError, match="--mean-bits must be within K2..K6"):
        measure_retained_costs(one_moe_source, one_moe_dense_observations, art, mean_bits=1.5)
    stripped = tmp_path / "obs"
    shutil.copytree(one_moe_dense_observations, stripped)
    save_file({"unrelated": torch.zeros(1)}, str(stripped / "layer-01.hessians.safetensors"))
    with pytest.raises(UsageError, match=r"layer-01\.hessians\.safetensors lacks the dense Hessians of .*layers\.1\."):
        measure_retained_costs(one_moe_source, stripped, art)
    wider = tmp_path / "wider"  # the artifact of another model: its config a wider dense MLP
    shutil.copytree(art, wider)
    config = json.loads((wider / "config.json").read_text())
    config["text_config"]["intermediate_size"] *= 2
    (wider / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="does not match the source .*intermediate_size"):
        measure_retained_costs(one_moe_source, one_moe_dense_observations, wider)
    with pytest.raises(UsageError, match=r"--device must be cpu or cuda"):
        measure_retained_costs(one_moe_source, one_moe_dense_observations, art, device="tpu")
    norm = "model.language_model.layers.1.post_attention_layernorm.weight"
    other = another_checkpoint(one_moe_source, tmp_path / "other-source", norm)
    with pytest.raises(UsageError, match=rf"was not built from this source: its copy of {norm} differs"):
        measure_retained_costs(other, one_moe_dense_observations, art)
    costs_file = tmp_path / "costs.json"
    for text, message in (
        ("{", "not a readable retained costs file"),
        ('{"format": "glmquant.layer_costs.v1"}', "not a retained costs file (format 'glmquant.layer_costs.v1'"),
        ('{"format": "glmquant.retained_costs.v1", "kl_alone": {}}', "a damaged retained costs file (KeyError"),
    ):
        costs_file.write_text(text)
        result = CliRunner().invoke(app, ["retained-widths", str(costs_file), "--out", str(tmp_path / "w.json")])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
        assert costs_file.name in result.output  # the file named
    assert not (tmp_path / "w.json").exists()


def _check_against_transformers(
    costs: dict[str, Any], artifact: Artifact, whole: torch.nn.Module, ids: torch.Tensor
) -> None:
    """Each layer's KL alone equals transformers' whole model with only that layer's retained linears decoded."""
    with torch.no_grad():
        reference = whole(input_ids=ids).logits.float().log_softmax(-1)
        for layer in (0, 1):
            params = {
                whole.get_parameter(f"{path}.weight"): linear
                for path, linear in artifact.retained_linear_modules().items()
                if linear.layer == layer
            }
            kept = {p: p.clone() for p in params}
            for p, linear in params.items():
                p.copy_(decode_weight(artifact.read_linear(linear), torch.float32))
            expected = _kl(reference, whole(input_ids=ids).logits)
            for p, original in kept.items():
                p.copy_(original)
            assert expected > 0
            assert costs["kl_alone"][str(layer)] == pytest.approx(expected, rel=1e-3, abs=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retained_costs_on_cuda_equal_the_cpus(untied: tuple[Path, Path, Path]) -> None:
    """The streamed pass on the GPU gives the CPU's KLs (float32, within 1 %: fla's TF32 KDA moves layer 1's KL at K5,
    4.5e-6, by 0.36 % on an H100); the sampled encodes its errors within the CUDA encoder's distance from the CPU's
    (the same quality, not the same codes)."""
    source, observations, art = untied
    cpu, gpu = (
        measure_retained_costs(source, observations, art, rows=2, dtype="float32", device=d) for d in ("cpu", "cuda")
    )
    for layer, kl in cpu.kl_alone.items():
        assert gpu.kl_alone[layer] == pytest.approx(kl, rel=1e-2)
        assert gpu.error[layer] == pytest.approx(cpu.error[layer], rel=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_retained_pass_steps_on_cuda_equal_the_cpus(untied: tuple[Path, Path, Path]) -> None:
    """Each step of the KL pass on the GPU against the CPU's (float32), so that a difference in the KLs is found where
    it begins: the decoded retained linears, then each layer's output from the source's and from layer 0's decoded
    weights (tolerance: fla's KDA kernel computes in TF32 on CUDA, 3.4e-4 of layer 0's output on an H100)."""
    one_moe_source, _, art = untied
    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(0))
    steps: dict[str, dict[str, torch.Tensor]] = {}
    for device in ("cpu", "cuda"):
        model = TextModel.open(one_moe_source, device, torch.float32)
        artifact = open_artifact(art)
        with model.ckpt, torch.no_grad():
            paths = {p: lin for p, lin in artifact.retained_linear_modules().items() if lin.layer == 0}
            decoded = {p: decode_weight(artifact.read_linear(lin, device), torch.float32) for p, lin in paths.items()}
            source = next(model.embed([ids]))
            first = model.layer(0)
            out = {"source 0": run_layer(first, source)}
            prefix = table_for(model.spec).layer_prefix(0)
            for path, weight in decoded.items():
                held: Any = first.get_submodule(path.removeprefix(prefix))
                held.weight.copy_(weight)
            out["decoded 0"] = run_layer(first, source)
            second = model.layer(1)
            out["source 1"], out["decoded 1"] = run_layer(second, out["source 0"]), run_layer(second, out["decoded 0"])
            out |= {f"weight {p}": w for p, w in decoded.items()}
            steps[device] = {name: value.cpu() for name, value in out.items()}
        artifact.checkpoint.close()
    difference = {
        name: float((steps["cuda"][name] - on_cpu).norm() / on_cpu.norm()) for name, on_cpu in steps["cpu"].items()
    }
    apart = {name: d for name, d in difference.items() if d > (1e-6 if name.startswith("weight") else 2e-3)}
    assert not apart, f"the GPU's steps differ from the CPU's (relative): {difference}"
