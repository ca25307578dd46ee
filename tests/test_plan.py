"""`plan` predicts the artifact exactly: the reference release's structure, and real writes of the tiny model."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from glmquant.arch import TensorRole, load_model_spec, source_tensors
from glmquant.checkpoint import layouts
from glmquant.checkpoint.layouts import plan_artifact, predicted_source_shards, quantizable_retained
from glmquant.cli import app
from glmquant.errors import UsageError
from glmquant.plan import load_source_shards, summarize

_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "I16": torch.int16, "I32": torch.int32}


@pytest.mark.slow
def test_reference_release_structure(reference_config: Path) -> None:
    spec = load_model_spec(reference_config)
    plan = plan_artifact(spec, "tr3", bits=2, codebook="mcg")
    summary = summarize(plan)
    assert summary.indexed_tensor_count == 583_090
    assert summary.expert_file_count == 84
    assert (summary.mtp_tensors, summary.mtp_bytes) == (889, 14_865_185_408)
    assert round(summary.decode_bytes_per_token / 1e9, 1) == 18.7
    part0 = next(f for f in plan.files if f.path == "layer-03-part-tail-0.safetensors")
    assert len(part0.tensors) == 6912 and {t.expert_slice.expert % 2 for t in part0.tensors} == {0}
    shapes = {t.name.split(".experts.0.")[1]: t.shape for t in part0.tensors if ".experts.0." in t.name}
    assert shapes["gate_proj.rank0.trellis"] == (256, 32, 32) and shapes["down_proj.rank3.trellis"] == (32, 256, 32)
    assert shapes["gate_proj.rank2.suh"] == (4096,) and shapes["down_proj.rank1.svh"] == (4096,)
    assert shapes["up_proj.rank1.mcg"] == ()
    slice_bytes = sum(t.spec.nbytes for t in part0.tensors if ".experts.0.up_proj.rank1." in t.name)
    assert slice_bytes == 533_508
    names = [t.name for f in plan.files for t in f.tensors]
    routed_weight = re.compile(r"layers\.(\d+)\.mlp\.experts\.\d+\.\w+_proj\.weight$")
    assert {int(m.group(1)) for n in names if (m := routed_weight.search(n))} == {45}


@pytest.mark.slow
def test_reference_files_from_the_config_alone(reference_config: Path) -> None:
    """Without the source's index, its sharding is predicted: 120 source shards of which 49 hold retained
    tensors, so the release's 133 files (84 expert + 49 retained) come out of the config alone."""
    spec = load_model_spec(reference_config)
    shards = predicted_source_shards(spec)
    assert len(shards) == 38_770 and len(set(shards.values())) == 120
    plan = plan_artifact(spec, "tr3")
    retained = [f for f in plan.files if f.kind == "retained"]
    assert len(plan.files) == 133 and len(retained) == 49 and summarize(plan).file_count == 133
    assert all(re.fullmatch(r"retained-\d{5}-of-00120\.safetensors", f.path) for f in retained)
    assert all(shards[t.source_name] == f.source_shard for f in retained for t in f.tensors)
    assert plan.files == plan_artifact(spec, "tr3", source_shards=shards).files


def test_source_index_numbering(tiny_source: Path) -> None:
    spec = load_model_spec(tiny_source)
    shards = load_source_shards(tiny_source / "model.safetensors.index.json")
    plan = plan_artifact(spec, "tr3", source_shards=shards)
    retained = [f for f in plan.files if f.kind == "retained"]
    for f in retained:
        assert f.source_shard is not None and f.path == f.source_shard.replace("model-", "retained-")
        assert all(shards[t.source_name] == f.source_shard for t in f.tensors)
    expert_only = set(shards.values()) - {f.source_shard for f in retained}
    assert expert_only  # source shards that held only quantized experts produce no retained file


def _write_plan(plan, source: Path, out: Path) -> None:
    """Write every planned file with the safetensors library itself (placeholder EXL3 parts)."""
    shards = load_source_shards(source / "model.safetensors.index.json")
    for f in plan.files:
        tensors = {}
        for t in f.tensors:
            if t.source is not None:
                with safe_open(source / shards[t.source], "pt") as src:
                    value = src.get_tensor(t.source)
                tensors[t.name] = value[list(t.rows)] if t.rows else value
            else:
                tensors[t.name] = torch.zeros(t.shape, dtype=_TORCH[t.dtype])
        save_file(tensors, str(out / f.path))


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_predicted_files_equal_written(tiny_source: Path, tmp_path: Path, layout: str) -> None:
    spec = load_model_spec(tiny_source)
    keep = dict.fromkeys(spec.moe_layers + spec.mtp_layers, (3, 0, 2)) if layout == "exllamav3" else None
    plan = plan_artifact(
        spec,
        layout,
        source_shards=load_source_shards(tiny_source / "model.safetensors.index.json"),
        keep=keep,
        shard_bytes=1 << 20,
    )
    _write_plan(plan, tiny_source, tmp_path)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(f.path for f in plan.files)
    for f in plan.files:
        path = tmp_path / f.path
        assert path.stat().st_size == f.size, f.path
        with safe_open(path, "pt") as sf:
            assert {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()} == {t.name: t.shape for t in f.tensors}  # noqa: SIM118 - safe_open has keys() but no __iter__
    if keep:
        router = next(t for f in plan.files for t in f.tensors if t.name.endswith("layers.1.mlp.gate.weight"))
        assert router.shape[0] == 3 and router.rows == (3, 0, 2)


def test_plan_cli_json(tiny_source: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            str(tiny_source),
            "--layout",
            "tr3",
            "--json",
            "--source-index",
            str(tiny_source / "model.safetensors.index.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["indexed_tensor_count"] == sum(f["tensor_count"] for f in data["files"])
    assert data["expert_file_count"] == 4


def test_plan_cli_bad_layout(tiny_source: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(tiny_source), "--layout", "tp8"])
    assert result.exit_code == 2 and "unknown layout" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_reference_plan_matches_pinned_manifest(reference_config: Path, layout: str) -> None:
    """manifests/ pins what `plan` predicts for the reference config; a layout change must update it knowingly."""
    pinned = Path(__file__).resolve().parents[1] / "manifests" / f"glm-5.3-flash.{layout}-k2-mcg.plan.json"
    result = CliRunner().invoke(app, ["plan", str(reference_config), "--layout", layout, "--json", "--no-tensors"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(pinned.read_text())


def test_retained_bits_plan(tiny_source: Path, tmp_path: Path) -> None:
    """--retained-bits K: every quantizable retained linear of the decoder layers becomes one EXL3 tensor at K in the
    file that held it; norms, routers, embeddings, hyper-connections, F32 tensors, vision and the MTP layer stay
    exact; the written files equal the prediction."""
    spec = load_model_spec(tiny_source)
    shards = load_source_shards(tiny_source / "model.safetensors.index.json")
    exact = plan_artifact(spec, "tr3", source_shards=shards)
    fast = plan_artifact(spec, "tr3", source_shards=shards, retained_bits=5)
    linears = {t.name.removesuffix(".weight"): t for t in quantizable_retained(spec)}
    roles = {t.role.value for t in linears.values()}
    assert roles == {"kda_linear_attention", "mla_attention", "dsa_indexer", "shared_expert", "dense_mlp"}
    assert all(t.layer is not None and t.layer < spec.num_hidden_layers for t in linears.values())
    assert [f.path for f in fast.files] == [f.path for f in exact.files]  # same files, same grouping
    for before, after in zip(exact.files, fast.files, strict=True):
        kept = [t for t in before.tensors if t.name.removesuffix(".weight") not in linears]
        assert [t for t in after.tensors if t.linear is None] == kept
        encoded = {t.name.rpartition(".")[0] for t in after.tensors if t.linear is not None}
        assert encoded == {t.name.removesuffix(".weight") for t in before.tensors} & set(linears)
    parts = {t.name: t for f in fast.files for t in f.tensors if t.linear is not None}
    assert len(parts) == 4 * len(linears)  # trellis, suh, svh, mcg
    q = parts["model.language_model.layers.0.self_attn.q_proj.trellis"]  # 128 -> 64, padded to 128 x 128
    assert (q.dtype, q.shape) == ("I16", (8, 8, 80))
    assert all(t.dtype != "F32" and t.role.value not in ("norm", "router_weight") for t in parts.values())
    assert fast.bits == exact.bits == 2 and fast.retained_bits == 5
    _write_plan(fast, tiny_source, tmp_path)
    for f in fast.files:
        assert (tmp_path / f.path).stat().st_size == f.size, f.path
    result = CliRunner().invoke(
        app,
        [
            "plan",
            str(tiny_source),
            "--json",
            "--retained-bits",
            "5",
            "--source-index",
            str(tiny_source / "model.safetensors.index.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["retained_bits"] == 5
    assert [(f["path"], f["bytes"]) for f in data["files"]] == [(f.path, f.size) for f in fast.files]
    with pytest.raises(UsageError, match="--retained-bits must be 2..8"):
        plan_artifact(spec, "tr3", source_shards=shards, retained_bits=9)


def test_retained_exact_layers_plan(tiny_source: Path) -> None:
    """--retained-exact-layers N: the retained linears of the first N decoder layers stay exact, byte-for-byte copies
    in the same files; the later layers' are EXL3 as with --retained-bits alone; `plan --json` states N; N must
    come with --retained-bits and leave a layer encoded."""
    spec = load_model_spec(tiny_source)
    shards = load_source_shards(tiny_source / "model.safetensors.index.json")
    exact = plan_artifact(spec, "tr3", source_shards=shards)
    fast = plan_artifact(spec, "tr3", source_shards=shards, retained_bits=4)
    first = plan_artifact(spec, "tr3", source_shards=shards, retained_bits=4, retained_exact_layers=1)
    layer = {t.name.removesuffix(".weight"): t.layer for t in quantizable_retained(spec)}
    encoded = {t.linear.key for f in first.files for t in f.tensors if t.linear is not None}
    assert encoded == {k for k, n in layer.items() if n is not None and n >= 1} and 0 < len(encoded) < len(layer)
    before = {t.name: t for f in exact.files for t in f.tensors}
    after = {t.name: t for f in first.files for t in f.tensors}
    layer0 = [k + ".weight" for k, n in layer.items() if n == 0]
    assert layer0 and all(after[n] == before[n] for n in layer0)  # the exact copies the faithful layout has
    assert [f.path for f in first.files] == [f.path for f in fast.files] and first.retained_exact_layers == 1
    assert sum(f.size for f in exact.files) > sum(f.size for f in first.files) > sum(f.size for f in fast.files)
    argv = ["plan", str(tiny_source), "--json", "--retained-bits", "4", "--retained-exact-layers", "1"]
    result = CliRunner().invoke(app, [*argv, "--source-index", str(tiny_source / "model.safetensors.index.json")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["retained_bits"], data["retained_exact_layers"]) == (4, 1)
    assert [(f["path"], f["bytes"]) for f in data["files"]] == [(f.path, f.size) for f in first.files]
    with pytest.raises(UsageError, match="it needs --retained-bits"):
        plan_artifact(spec, "tr3", source_shards=shards, retained_exact_layers=1)
    with pytest.raises(UsageError, match=f"must be 0..{spec.num_hidden_layers - 1}"):
        plan_artifact(spec, "tr3", source_shards=shards, retained_bits=4, retained_exact_layers=spec.num_hidden_layers)


def test_retained_layer_bits_plan(tiny_source: Path) -> None:
    """--retained-layer-bits: each decoder layer's retained linears at its own K (`exact`: byte copies); `exact,K4,..`
    plans the files --retained-bits 4 --retained-exact-layers 1 plans, tensor for tensor; `plan --json` states the
    widths; one entry per layer, refused otherwise, naming the model's layer count."""
    spec = load_model_spec(tiny_source)
    shards = load_source_shards(tiny_source / "model.safetensors.index.json")
    n = spec.num_hidden_layers
    assert n >= 3
    first = plan_artifact(spec, "tr3", source_shards=shards, retained_bits=4, retained_exact_layers=1)
    same = plan_artifact(spec, "tr3", source_shards=shards, retained_layer_bits=(None,) + (4,) * (n - 1))
    assert same.files == first.files and same.retained_bits is None and first.retained_layer_bits is None
    widths = (6, None) + (3,) * (n - 2)
    mixed = plan_artifact(spec, "tr3", source_shards=shards, retained_layer_bits=widths)
    stored = {t.linear.key: t for f in mixed.files for t in f.tensors if t.linear is not None and t.part == "trellis"}
    linears = quantizable_retained(spec)
    for t in linears:
        assert t.layer is not None
        k = widths[t.layer]
        assert (t.name.removesuffix(".weight") in stored) == (k is not None), t.name
        if k is not None:
            assert stored[t.name.removesuffix(".weight")].shape[-1] == 16 * k
    assert {t.layer for t in linears} >= {0, 1, 2} and mixed.retained_widths == "K6,exact," + ",".join(
        ["K3"] * (n - 2)
    ) + " by layer"
    text = ",".join("exact" if k is None else f"K{k}" for k in widths)
    argv = ["plan", str(tiny_source), "--json", "--retained-layer-bits", text]
    result = CliRunner().invoke(app, [*argv, "--source-index", str(tiny_source / "model.safetensors.index.json")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["retained_layer_bits"] == list(widths) and "retained_bits" not in data
    assert [(f["path"], f["bytes"]) for f in data["files"]] == [(f.path, f.size) for f in mixed.files]
    with pytest.raises(UsageError, match=f"names {n - 1} layers; .* has {n} decoder layers"):
        plan_artifact(spec, "tr3", source_shards=shards, retained_layer_bits=(4,) * (n - 1))
    result = CliRunner().invoke(app, ["plan", str(tiny_source), "--retained-layer-bits", "K4,K4,K4,K4,K4,K4,K4,K4,K4"])
    assert result.exit_code == 2 and f"has {n} decoder layers" in result.output


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_head_bits_plan(tiny_source: Path, tmp_path: Path, layout: str) -> None:
    """--head-bits K: lm_head becomes one EXL3 tensor at K where lm_head.weight was (same files, same grouping), with
    or without --retained-bits; the written files equal the prediction; plan --head-bits reports it."""
    spec = load_model_spec(tiny_source)
    shards = load_source_shards(tiny_source / "model.safetensors.index.json") if layout == "tr3" else None
    exact = plan_artifact(spec, layout, source_shards=shards)
    head = plan_artifact(spec, layout, source_shards=shards, head_bits=6)
    both = plan_artifact(spec, layout, source_shards=shards, retained_bits=4, head_bits=6)
    retained = plan_artifact(spec, layout, source_shards=shards, retained_bits=4)
    assert (head.head_bits, head.retained_bits, both.head_bits, both.retained_bits) == (6, None, 6, 4)
    parts = ("trellis", "suh", "svh", "mcg")
    for before, after in zip(exact.files, head.files, strict=True):
        assert before.path == after.path
        names = [t.name for t in before.tensors]
        if "lm_head.weight" in names:  # the head's parts in its place, in the same file
            at = names.index("lm_head.weight")
            names[at : at + 1] = [f"lm_head.{p}" for p in parts]
        assert [t.name for t in after.tensors] == names
    encoded = {t.name: t for f in head.files for t in f.tensors if t.linear is not None}
    assert set(encoded) == {f"lm_head.{p}" for p in parts}
    trellis = encoded["lm_head.trellis"]
    assert (trellis.shape, trellis.role.value) == (
        (128 // 16, 384 // 16, 96),
        "lm_head",
    )  # in 128; out 320 (vocab), padded to 384
    assert trellis.linear is not None and (trellis.linear.layer, trellis.linear.bits) == (None, 6)
    assert {t.name for f in both.files for t in f.tensors if t.linear is not None} == set(encoded) | {
        t.name for f in retained.files for t in f.tensors if t.linear is not None
    }
    _write_plan(both, tiny_source, tmp_path)
    for f in both.files:
        assert (tmp_path / f.path).stat().st_size == f.size, f.path
    args = ["plan", str(tiny_source), "--layout", layout, "--json", "--head-bits", "6"]
    if shards:
        args += ["--source-index", str(tiny_source / "model.safetensors.index.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["head_bits"] == 6 and "retained_bits" not in data
    assert [(f["path"], f["bytes"]) for f in data["files"]] == [(f.path, f.size) for f in head.files]
    with pytest.raises(UsageError, match="--head-bits must be 2..8"):
        plan_artifact(spec, layout, source_shards=shards, head_bits=1)


def test_head_bits_need_one_bf16_head_weight(tiny_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An architecture table without lm_head's weight, or with one the codec does not take (not a 2-D BF16
    `.weight`), is refused naming the lm_head tensors it has, as the retained linears' filter leaves such tensors
    exact."""
    spec = load_model_spec(tiny_source)
    tensors = source_tensors(spec)
    without = [t for t in tensors if t.role is not TensorRole.LM_HEAD]
    f32 = [replace(t, dtype="F32") if t.role is TensorRole.LM_HEAD else t for t in tensors]
    for table, named in ((without, "none"), (f32, r"lm_head\.weight \(F32 \[320, 128\]\)")):
        monkeypatch.setattr(layouts, "source_tensors", lambda spec, table=table: table)
        with pytest.raises(UsageError, match=rf"--head-bits: .* 0 2-D BF16 lm_head weights.*: {named}\)"):
            plan_artifact(spec, "tr3", head_bits=6)
