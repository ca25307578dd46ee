"""`--load-format dummy`: the dummy artifact holds exactly `plan`'s tensors (names, shapes, dtypes) with finite,
reproducible values; loading it reads every text-model tensor and nothing else; the tiny dummy model decodes to
finite logits; generated expert stacks equal those the generic loader builds from the same tensors."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from glmquant.arch import TensorRole, table_for
from glmquant.checkpoint.dummy import DummyCheckpoint
from glmquant.checkpoint.layouts import plan_artifact, quantizable_retained
from glmquant.checkpoint.tensor_bytes import TORCH_DTYPES
from glmquant.errors import UsageError
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.dummy import dummy_artifact
from glmquant.runtime.engine import Engine
from glmquant.runtime.engine.experts import resident_layer
from glmquant.runtime.engine.loaded import load_engine
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.kernels.backend import load_layer
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_dummy_artifact_holds_exactly_the_planned_tensors(tiny_source: Path, layout: str) -> None:
    artifact = dummy_artifact(tiny_source / "config.json", layout)
    planned = {t.name: t for f in plan_artifact(artifact.spec, layout).files for t in f.tensors}
    ckpt = artifact.checkpoint
    assert sorted(ckpt.names()) == sorted(planned)
    for name, t in planned.items():
        value = ckpt.read_tensor(name)
        assert (value.dtype, tuple(value.shape)) == (TORCH_DTYPES[t.dtype], t.shape), name
        assert bool(torch.isfinite(value.float()).all()), name
    assert artifact.ranks == (4 if layout == "tr3" else 1)
    assert artifact.quantized_layers == tuple(artifact.spec.moe_layers)
    assert artifact.config["quantization_config"]["bits"] == 2


def _checkpoint(artifact: Artifact) -> DummyCheckpoint:
    assert isinstance(artifact.checkpoint, DummyCheckpoint)
    return artifact.checkpoint


def test_dummy_values_are_reproducible_and_stack_like_single_reads(tiny_source: Path) -> None:
    ckpt = _checkpoint(dummy_artifact(tiny_source))
    names = [n for n in ckpt.names() if n.endswith(".svh") and ".gate_proj." in n]
    stacked = ckpt.read_stack(names)
    for i, name in enumerate(names):
        assert torch.equal(stacked[i], ckpt.read_tensor(name))
    assert not torch.equal(stacked[0], stacked[1])  # each tensor its own values
    assert torch.equal(_checkpoint(dummy_artifact(tiny_source)).read_stack(names), stacked)
    assert not torch.equal(_checkpoint(dummy_artifact(tiny_source, seed=1)).read_stack(names), stacked)


def test_dummy_load_reads_every_text_model_tensor_and_decodes_finite_logits(tiny_source: Path) -> None:
    artifact = dummy_artifact(tiny_source)
    spec, table = artifact.spec, table_for(artifact.spec)
    engine = Engine.load(artifact, RuntimeOptions(), max_len=64)  # bf16, torch experts read on use
    for layer in artifact.quantized_layers:  # the GPU path's stacks, read all at once
        cpu = torch.device("cpu")
        ours, generic = resident_layer(artifact, layer, cpu), load_layer(artifact, layer, cpu)
        for stack in ("gate_up", "down"):
            for f in fields(getattr(ours, stack)):
                a, b = getattr(getattr(ours, stack), f.name), getattr(getattr(generic, stack), f.name)
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (layer, stack, f.name)
    mtp = tuple(table.layer_prefix(layer) for layer in spec.mtp_layers)
    text = {n for n in artifact.checkpoint.names() if not n.startswith(mtp)} - {
        t.name for t in table.top_level(spec) if t.role is TensorRole.VISION
    }
    assert _checkpoint(artifact).reads == text
    logits = engine.prefill(0, torch.arange(20))
    for position in range(20, 26):
        assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
        logits = engine.decode(logits.argmax().view(1), torch.tensor([position]), position + 1)[0]
    assert bool(torch.isfinite(logits).all()) and logits.float().std() > 0


@pytest.mark.slow
def test_dummy_artifact_of_the_reference_config_plans_the_release(reference_config: Path) -> None:
    """583,090 indexed tensors, as `plan` pins for GLM-5.3-Flash; a few small ones read with their planned specs."""
    ckpt = dummy_artifact(reference_config).checkpoint
    assert len(ckpt.names()) == 583_090
    for name in (
        "model.language_model.layers.3.mlp.experts.0.down_proj.rank3.suh",
        "model.language_model.layers.3.self_attn.indexer.k_norm.weight",
    ):
        spec = ckpt.spec(name)
        assert (tuple(ckpt.read_tensor(name).shape), ckpt.read_tensor(name).dtype) == (
            spec.shape,
            TORCH_DTYPES[spec.dtype],
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("impl", ["glmquant", "transformers"])
def test_cuda_asked_without_cuda_is_a_usage_error(tiny_source: Path, impl: str) -> None:
    options = RuntimeOptions(device="cuda", load_format="dummy", model_impl=impl)
    artifact = dummy_artifact(tiny_source / "config.json", "tr3")
    with pytest.raises(UsageError, match="--device cuda: no CUDA device is visible"):
        if impl == "glmquant":
            load_engine(artifact, options, max_seqs=1, max_len=64)
        else:
            load_model(artifact, options)


def test_dummy_speed_tier_holds_the_planned_tensors_and_decodes_finite_logits(
    tiny_source: Path, tmp_path: Path
) -> None:
    """retained_bits=4: the retained linears are EXL3 tensors as `plan` predicts them, declared in the config's
    quantization block (a dummy load of that config takes it from there), and the runtime decodes finite logits."""
    artifact = dummy_artifact(tiny_source / "config.json", "tr3", retained_bits=4)
    plan = plan_artifact(artifact.spec, "tr3", retained_bits=4)
    planned = {t.name: t for f in plan.files for t in f.tensors}
    ckpt = _checkpoint(artifact)
    assert ckpt.plan.retained_bits == 4 and sorted(ckpt.names()) == sorted(planned)
    linears = [t for t in planned.values() if t.linear is not None]
    assert {t.linear.source for t in linears if t.linear} == {t.name for t in quantizable_retained(artifact.spec)}
    for name, t in planned.items():
        value = ckpt.read_tensor(name)
        assert (value.dtype, tuple(value.shape)) == (TORCH_DTYPES[t.dtype], t.shape), name
        assert bool(torch.isfinite(value.float()).all()), name
    assert artifact.config["quantization_config"]["retained_bits"] == 4
    assert set(artifact.retained_linears) == {t.linear.key for t in linears if t.linear}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(artifact.config))
    assert _checkpoint(dummy_artifact(config)).plan.retained_bits == 4
    # --retained-exact-layers 1, declared in the block the same way: layer 0's linears exact, the rest EXL3
    first_exact = dummy_artifact(tiny_source / "config.json", "tr3", retained_bits=4, retained_exact_layers=1)
    assert {lin.layer for lin in first_exact.retained_linears.values()} == set(
        range(1, artifact.spec.num_hidden_layers)
    )
    config.write_text(json.dumps(first_exact.config))
    assert _checkpoint(dummy_artifact(config)).plan.retained_exact_layers == 1
    loaded = load_model(artifact, RuntimeOptions(dtype="float32"))
    assert sum(isinstance(m, Exl3Linear) for m in loaded.model.modules()) == len(artifact.retained_linears)
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.arange(20).view(1, -1)).logits[0]
    assert bool(torch.isfinite(logits).all()) and logits.std() > 0
    params = SamplingParams(max_tokens=4)
    assert (
        len(generate(loaded.model, PromptInputs(torch.arange(20).view(1, -1)), params, lambda ids: "").token_ids) == 4
    )


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_dummy_head_bits_are_planned_declared_and_read_back(tiny_source: Path, tmp_path: Path, layout: str) -> None:
    """head_bits=6: lm_head is an EXL3 tensor as `plan` predicts, the config's block declares it (a dummy load of that
    config takes it from there; ExLlamaV3's head_bits of 16 means an exact head), and both runtimes load it."""
    artifact = dummy_artifact(tiny_source / "config.json", layout, head_bits=6)
    ckpt = _checkpoint(artifact)
    assert (ckpt.plan.head_bits, ckpt.plan.retained_bits) == (6, None)
    assert sorted(ckpt.names()) == sorted(
        t.name for f in plan_artifact(artifact.spec, layout, head_bits=6).files for t in f.tensors
    )
    assert list(artifact.retained_linears) == ["lm_head"] and artifact.config["quantization_config"]["head_bits"] == 6
    config = tmp_path / "config.json"
    config.write_text(json.dumps(artifact.config))
    assert _checkpoint(dummy_artifact(config)).plan.head_bits == 6
    exact = dummy_artifact(tiny_source / "config.json", layout)
    config.write_text(json.dumps(exact.config))
    assert _checkpoint(dummy_artifact(config)).plan.head_bits is None
    assert isinstance(load_model(artifact, RuntimeOptions(dtype="float32")).model.get_submodule("lm_head"), Exl3Linear)
