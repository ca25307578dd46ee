"""`glmquant encode` on a tiny model: decodes back at K2 quality, copies retained bytes, verifies, resumes."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from encode_fixtures import EPOCH, QUIET, digests
from rich.console import Console

import glmquant.encode.layer as encode_layer
from glmquant.arch import load_model_spec, table_for
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.exl3 import EXL3Tensor, decode_weight
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessian_reader import load_layer_hessians
from glmquant.observe.run import observe
from glmquant.observe.summary import ObservationSummary

# under pytest-xdist (`make test`) these tests and test_distributed.py's run on one worker, which encodes
# `small_artifact` (the encode tests' slowest step) once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("small-artifact")]


def test_experts_decode_back_at_k2_quality(small_artifact: Path, small_source: Path) -> None:
    spec = load_model_spec(small_source)
    table = table_for(spec)
    with SourceCheckpoint.open(small_source) as src, SourceCheckpoint.open(small_artifact) as art:
        for layer in spec.moe_layers:
            for e in range(spec.n_routed_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    prefix = f"{table.layer_prefix(layer)}mlp.experts.{e}.{proj}"
                    slices = []
                    for r in range(4):
                        key = f"{prefix}.rank{r}"
                        parts = {n: art.read_tensor(n) for n in art.names() if n.startswith(key + ".")}
                        i = parts[f"{key}.suh"].numel()
                        o = parts[f"{key}.svh"].numel()
                        slices.append(decode_weight(EXL3Tensor.from_tensors(parts, key, i, o), torch.float32))
                    decoded = torch.cat(slices, dim=1 if proj == "down_proj" else 0)
                    source = src.read_tensor(f"{prefix}.weight").float()
                    rel = ((decoded - source).norm() / source.norm()).item()
                    assert 0.1 < rel < 0.45, (prefix, rel)  # K2: about 0.3


def test_retained_bytes_identical_and_plan_exact(small_artifact: Path, small_source: Path) -> None:
    spec = load_model_spec(small_source)
    with SourceCheckpoint.open(small_source) as src, SourceCheckpoint.open(small_artifact) as art:
        plan = plan_artifact(spec, "tr3", source_shards={n: src.shard_of(n) for n in src.names()})
        retained = [n for n in art.names() if not n.endswith((".trellis", ".suh", ".svh", ".mcg"))]
        assert len(retained) > 100
        for name in retained:
            assert art.read_raw(name) == src.read_raw(name), name
    for f in plan.files:
        assert (small_artifact / f.path).stat().st_size == f.size
    weight_files = {p.name for p in small_artifact.glob("*.safetensors")}
    assert weight_files == {f.path for f in plan.files}


def test_manifest_verifies(small_artifact: Path) -> None:
    report = verify_artifact(small_artifact, fast=False, show_progress=False)
    assert report.ok, report.failure_summary()
    assert not any(c.warning for c in report.checks)  # every file the encoder wrote is listed


def test_killed_job_resumes_to_identical_bytes(
    small_artifact: Path,
    small_source: Path,
    small_observations: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed between layers, in the middle of writing a retained shard, and inside the final verification:
    each rerun of the same command resumes, and the finished artifact is byte-identical to an uninterrupted one. (Its
    encodes may be read back from the suite's encode memo: what is tested here is the job's resume; the encoder's own
    repeatability is tests/exl3's and test_distributed.py's, which compute every encode.)"""
    import glmquant.checkpoint.artifact_writer as artifact_writer

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)  # small_artifact's

    out = tmp_path / "artifact"
    cfg = EncodeConfig(source=small_source, out=out, observations=small_observations)
    state_file = cfg.state_dir / "encode-state.json"

    def no_leftovers() -> None:
        assert not (out / "EXL3_MANIFEST.json").exists()
        assert not [p for p in out.iterdir() if ".tmp" in p.name]

    real_encode_unit = encode_layer.encode_unit
    calls = {"n": 0}

    def dies_on_second_layer(*args, **kwargs):  # the tiny model's layers are one work unit each
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_encode_unit(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(encode_layer, "encode_unit", dies_on_second_layer)
        with pytest.raises(KeyboardInterrupt):
            encode_artifact(cfg, QUIET)
    no_leftovers()
    assert list(json.loads(state_file.read_text())["layers"]) == ["1"]

    real_write = artifact_writer.write_safetensors

    def dies_mid_file(path, specs, provide):
        if not path.name.startswith("retained-"):
            return real_write(path, specs, provide)

        def dying(spec):
            if spec.name == specs[-1].name:
                raise KeyboardInterrupt
            return provide(spec)

        return real_write(path, specs, dying)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifact_writer, "write_safetensors", dies_mid_file)
        with pytest.raises(KeyboardInterrupt):
            encode_artifact(cfg, QUIET)
    no_leftovers()
    assert not list(out.glob("retained-*"))
    state = json.loads(state_file.read_text())
    assert sorted(state["layers"]) == ["1", "2"] and not state["retained_done"]

    def dies_verifying(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(artifact_writer, "verify_artifact", dies_verifying)
        with pytest.raises(KeyboardInterrupt):
            encode_artifact(cfg, QUIET)
    no_leftovers()
    # a kill -9 inside a write leaves its temporary file (no handler runs): the rerun sweeps it
    (out / ".layer-01-part-tail-0.safetensors.tmp-999999").write_bytes(b"half a file")
    (cfg.state_dir / ".encode-state.json.tmp-999999").write_text("{")
    encode_artifact(cfg, QUIET)
    assert digests(out) == digests(small_artifact)
    assert not [p for p in cfg.state_dir.iterdir() if ".tmp" in p.name]


def test_natural_hessians_and_documented_fallbacks(
    small_artifact: Path, small_source: Path, small_observations: Path
) -> None:
    """Experts the calibration never routed to are encoded uncalibrated and reported; the others use their Hessians."""
    spec = load_model_spec(small_source)
    summary = json.loads((small_artifact.with_name("artifact.work") / "encode-summary.json").read_text())
    manifest = json.loads((small_artifact / "EXL3_MANIFEST.json").read_text())
    assert manifest["calibration"]["token_rows_sha256"] == ObservationSummary.load(small_observations).token_rows_sha256
    for layer in summary["layers"]:
        h = load_layer_hessians(small_observations, layer["layer"], "natural")
        unrouted = [
            e for e in range(spec.n_routed_experts) if int(h.gate_up_counts[e]) == 0 or int(h.down_counts[e]) == 0
        ]
        prefix = f"{table_for(spec).layer_prefix(layer['layer'])}mlp.experts."
        expected = sorted(
            f"{prefix}{e}.{p}.rank{r}"
            for e in unrouted
            for p in ("gate_proj", "up_proj", "down_proj")
            for r in range(4)
        )
        assert layer["fallback_tensors"] == expected
        assert layer["fallbacks"] == ({"no_tokens:identity": len(expected)} if expected else {})
        assert layer["mean_proxy_error"] < 0.1


def test_changed_options_do_not_resume(small_source: Path, small_artifact: Path, tmp_path: Path) -> None:
    from glmquant.errors import UsageError

    work = tmp_path / "work"
    (work).mkdir()
    (work / "encode-state.json").write_text(json.dumps({"fingerprint": "other", "layers": {}}))
    with pytest.raises(UsageError, match="other inputs or options"):
        encode_artifact(EncodeConfig(source=small_source, out=tmp_path / "a", work_dir=work, uncalibrated=True), QUIET)


def test_another_artifact_in_out_is_refused_before_any_work(
    small_source: Path, small_artifact: Path, tmp_path: Path
) -> None:
    """An --out holding another layout's artifact (tensor files this plan does not write) is refused before any
    work and left as it was; the same encode into it again would only replace its own files."""
    import shutil

    from glmquant.errors import UsageError

    out = tmp_path / "art"
    shutil.copytree(small_artifact, out)
    before = digests(out)
    config = EncodeConfig(source=small_source, out=out, uncalibrated=True, layout="exllamav3")
    with pytest.raises(UsageError, match=r"holds \d+ tensor file\(s\) this artifact would not write \(e\.g\. layer-"):
        encode_artifact(config, QUIET)
    assert digests(out) == before and not (tmp_path / "art.work").exists()


@pytest.mark.slow
def test_keep_from_the_observations_into_a_new_out(
    small_source: Path, small_observations: Path, tmp_path: Path
) -> None:
    """`encode --keep N` ranks experts by the observations and writes the plan into the job's work directory, which
    a fresh --out does not have yet (it once failed there: prune_plan.json: No such file or directory)."""
    out = tmp_path / "new" / "artifact"
    result = encode_artifact(EncodeConfig(source=small_source, out=out, observations=small_observations, keep=2), QUIET)
    assert result is not None and (out / "EXL3_MANIFEST.json").is_file()


def test_exllamav3_layout_with_pruning(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """One EXL3 tensor per projection, modules packed into model-* shards, REAP-style pruning of one MoE layer's four
    experts to 1 and 3 (two: the fewest its router can route over), renumbered 0 and 1."""
    tiny_source = build_tiny_checkpoint(tmp_path_factory.mktemp("prune-src"), TinyModelConfig(num_hidden_layers=2))
    spec = load_model_spec(tiny_source)
    plan_file = tmp_path / "prune_plan.json"
    plan_file.write_text(json.dumps({"keep": 2, "layers": {str(layer): [1, 3] for layer in spec.moe_layers}}))
    out = tmp_path / "artifact"
    encode_artifact(
        EncodeConfig(source=tiny_source, out=out, layout="exllamav3", prune_plan=plan_file, uncalibrated=True), QUIET
    )
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["n_routed_experts"] == 2
    table = table_for(spec)
    h = spec.hidden_size
    with SourceCheckpoint.open(tiny_source) as src, SourceCheckpoint.open(out) as art:
        names = set(art.names())
        for layer in spec.moe_layers:
            prefix = table.layer_prefix(layer)
            assert not any(f"{prefix}mlp.experts.2." in n for n in names)
            for new_id, source_id in ((0, 1), (1, 3)):
                key = f"{prefix}mlp.experts.{new_id}.gate_proj"
                assert {f"{key}.trellis", f"{key}.suh", f"{key}.svh", f"{key}.mcg"} <= names
                parts = {n: art.read_tensor(n) for n in names if n.startswith(key + ".")}
                decoded = decode_weight(
                    EXL3Tensor.from_tensors(parts, key, spec.hidden_size, spec.moe_intermediate_size), torch.float32
                )
                source = src.read_tensor(f"{prefix}mlp.experts.{source_id}.gate_proj.weight").float()
                assert ((decoded - source).norm() / source.norm()).item() < 0.45
            router = src.read_raw(f"{prefix}mlp.gate.weight")  # rows 1 and 3 of the BF16 router
            kept_rows = router[h * 2 : h * 4] + router[h * 6 : h * 8]
            assert art.read_raw(f"{prefix}mlp.gate.weight") == kept_rows
        mtp = spec.mtp_layers[0]  # no statistics for the MTP layer: it keeps the last MoE layer's experts
        assert art.read_raw(f"{table.layer_prefix(mtp)}mlp.experts.1.up_proj.weight") == src.read_raw(
            f"{table.layer_prefix(mtp)}mlp.experts.3.up_proj.weight"
        )
    assert verify_artifact(out, fast=False, show_progress=False).ok


def _copy_source(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_nan_weight_is_named_and_nothing_is_left_half_written(small_source: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from glmquant.errors import NumericalError

    source = _copy_source(small_source, tmp_path / "src")
    spec = load_model_spec(source)
    name = f"{table_for(spec).layer_prefix(spec.moe_layers[-1])}mlp.experts.1.down_proj.weight"
    shard = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(source / shard)
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(source / shard), metadata={"format": "pt"})
    out = tmp_path / "artifact"
    with pytest.raises(NumericalError, match=re.escape(name)) as err:
        encode_artifact(EncodeConfig(source=source, out=out, uncalibrated=True), QUIET)
    assert shard in str(err.value)
    assert not (out / "EXL3_MANIFEST.json").exists() and not list(out.glob("*.tmp*"))


def test_nan_in_a_retained_tensor_is_named_and_the_fixed_source_resumes(
    small_source: Path, small_observations: Path, small_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN in a tensor the artifact copies byte for byte (an attention weight, the embedding) stops the encode with
    an error naming the source file and tensor and saying the expert layers are kept, leaving no file that holds it;
    once the source is mended the same command resumes (the expert layers stay done) to small_artifact's bytes. The
    copy used to carry the NaN into a verified artifact, exit 0."""
    import shutil

    from typer.testing import CliRunner

    from glmquant.cli import app

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)  # small_artifact's
    source = _copy_source(small_source, tmp_path / small_source.name)  # the folder's name is the card's repo_id
    out = tmp_path / "artifact"
    out.mkdir()
    for expert_file in small_artifact.glob("layer-*.safetensors"):  # the expert layers, as a finished earlier run
        shutil.copy(expert_file, out / expert_file.name)
    (tmp_path / "artifact.work").mkdir()
    shutil.copy(small_artifact.with_name("artifact.work") / "encode-state.json", tmp_path / "artifact.work")
    spec = load_model_spec(source)
    name = f"{table_for(spec).layer_prefix(0)}self_attn.o_proj.weight"
    with SourceCheckpoint.open(source) as ckpt:
        shard = source / ckpt.shard_of(name)
        begin, _ = ckpt.headers[ckpt.shard_of(name)].span(name)
        assert ckpt.spec(name).dtype == "BF16"
    good = shard.read_bytes()
    shard.write_bytes(good[: begin + 6] + b"\xc0\x7f" + good[begin + 8 :])  # element 3: a BF16 NaN

    command = ["encode", str(source), "--observations", str(small_observations), "--out", str(out)]
    experts = {f: f.stat().st_mtime_ns for f in out.glob("layer-*")}
    failed = CliRunner().invoke(app, command)
    output = " ".join(failed.output.split())
    assert failed.exit_code == 1 and f"error: {shard}: tensor {name} has 1 non-finite value(s) (NaN/Inf)" in output
    assert f"the routed experts' files in {out} are kept: mend the source and rerun the same command" in output
    assert {f: f.stat().st_mtime_ns for f in out.glob("layer-*")} == experts  # the expert layers were not redone
    assert not (out / shard.name.replace("model-", "retained-")).exists()  # the shard that would carry the NaN
    assert not list(out.glob(".*")) and not (out / "EXL3_MANIFEST.json").exists()  # nor a temporary file of it

    shard.write_bytes(good)
    assert CliRunner().invoke(app, command).exit_code == 0
    assert digests(out) == digests(small_artifact)


def test_truncated_source_shard_fails_before_any_work(small_source: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from glmquant.cli import app

    source = _copy_source(small_source, tmp_path / "src")
    shard = (
        source
        / sorted(set(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    )
    shard.write_bytes(shard.read_bytes()[:-100])
    result = CliRunner().invoke(app, ["encode", str(source), "--out", str(tmp_path / "artifact"), "--uncalibrated"])
    assert result.exit_code in (1, 2)
    assert shard.name in result.output
    assert not (tmp_path / "artifact").exists()


def test_expert_without_tokens_uses_the_all_token_fallback(one_moe_source: Path, tmp_path: Path) -> None:
    """A correction bias that keeps expert 0 of the (one) MoE layer from ever being selected: natural routing
    gives it no tokens, so it is encoded with the all-token Hessians and reported as such."""
    from safetensors.torch import load_file, save_file

    from glmquant.observe.hessians import HessianMode

    source = _copy_source(one_moe_source, tmp_path / "src")
    spec = load_model_spec(source)
    layer = spec.moe_layers[-1]
    bias = f"{table_for(spec).layer_prefix(layer)}mlp.gate.e_score_correction_bias"
    shard = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"][bias]
    tensors = load_file(source / shard)
    tensors[bias][0] = -1e4
    save_file(tensors, str(source / shard), metadata={"format": "pt"})
    obs = tmp_path / "obs"
    observe(ObserveConfig(source=source, out=obs, rows=2, tokens=32, hessians=HessianMode.BOTH))
    assert int(load_layer_hessians(obs, layer, "natural").gate_up_counts[0]) == 0
    out = tmp_path / "artifact"
    log = io.StringIO()
    result = encode_artifact(EncodeConfig(source=source, out=out, observations=obs), Console(file=log, width=400))
    assert result is not None
    last = next(summary for summary in result.layers if summary.layer == layer)
    assert last.fallbacks == {"no_tokens:all": 12}
    assert all(".experts.0." in name for name in last.fallback_tensors)
    warnings = [line for line in log.getvalue().splitlines() if line.startswith("warning: ")]
    assert sorted(warnings) == [
        f"warning: {name}: no_tokens:all (no calibration token was routed to this expert: "
        f"encoded with the all-token Hessian)"
        for name in sorted(last.fallback_tensors)
    ]


def test_an_interrupted_encode_does_not_wait_for_its_read_ahead(
    small_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or a failure) while a unit encodes leaves `encode_units` at once; the read of the next unit, under way
    on the reader thread, is not waited for there (only at the process exit, where a second Ctrl-C leaves at once)."""
    import threading
    import time

    from glmquant.checkpoint.layouts import ExpertSlice
    from glmquant.encode.hessians import LayerHessiansView

    released, reading_ahead = threading.Event(), threading.Event()
    read_calls: list[int] = []

    def read_unit(plan, layer, unit, source, hessians, tune_steps):
        read_calls.append(layer)
        if len(read_calls) > 1:
            reading_ahead.set()
            released.wait(30)  # the read-ahead of the second unit: slow
        return layer

    def encode_unit(inputs, *args):
        assert reading_ahead.wait(30)
        raise KeyboardInterrupt  # Ctrl-C while the first unit encodes and the second is being read

    monkeypatch.setattr(encode_layer, "read_unit", read_unit)
    monkeypatch.setattr(encode_layer, "encode_unit", encode_unit)
    spec = load_model_spec(small_source)
    plan = plan_artifact(spec, "tr3", 2)
    no_slices: list[ExpertSlice] = []  # read_unit is the stub above
    units = [(layer, no_slices) for layer in spec.moe_layers][:2]
    assert len(units) == 2
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt), SourceCheckpoint.open(small_source) as source:
            list(encode_layer.encode_units(plan, units, source, lambda _: LayerHessiansView(None, None), 0, "cpu"))
        assert time.monotonic() - started < 10  # not the 30 s the read-ahead would take
        assert read_calls == [units[0][0], units[1][0]]
    finally:
        released.set()
