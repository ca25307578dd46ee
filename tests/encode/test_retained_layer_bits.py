"""The speed tier with a K per decoder layer (`encode --retained-layer-bits K3,K5` on the ONE_MOE model): each layer's
retained linears are stored at their own K, the artifact is what `plan` predicts, its manifest and config block state
the widths, verify-manifest checks the files against them, and the runtime runs each linear at its K.
One K for every layer (`--retained-bits`, `--retained-exact-layers`): test_retained_bits.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from encode_fixtures import QUIET, assert_verify_manifest_cli

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import plan_artifact, quantizable_retained
from glmquant.checkpoint.manifest import MANIFEST_NAME, manifest_text
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.checkpoint.verify_report import MAX_SHOWN
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.run import EncodeResult
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear

pytestmark = [pytest.mark.slow]  # one encode of the ONE_MOE model with its retained linears at K3 and K5

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
