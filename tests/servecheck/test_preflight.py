"""serve-check refuses, before any gate runs, what would only fail at the end of a long run: a report directory it
cannot write (`--out` a file, under a file, read-only) and a `--bf16-source` of another model than the artifact's
(while the source of a pruned artifact, which keeps fewer experts, is accepted)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner, Result

from glmquant.arch import load_model_spec
from glmquant.checkpoint.artifact_writer import finalize_artifact, write_artifact_files
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.provenance import Provenance
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.cli.serve_check import register
from glmquant.encode.provenance import selection_sha256
from glmquant.fixtures.random_artifact import build_artifact, random_experts
from glmquant.servecheck import run as run_module
from glmquant.servecheck.config import REPORT_JSON, REPORT_MD
from glmquant.servecheck.fidelity import FidelityResult


def cli(args: list[str]) -> Result:
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `serve-check` a subcommand
    return CliRunner().invoke(app, ["serve-check", *args])


def one_line(result: Result) -> str:
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tr3 artifact of the tiny model (4 routed experts, none pruned)."""
    return build_artifact(tiny_source, tmp_path_factory.mktemp("preflight") / "tiny-tr3", "tr3")


@pytest.fixture(scope="module")
def pruned(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tr3 artifact of the tiny model that kept 3 of its 4 routed experts (as `encode --keep 3` writes one)."""
    spec = load_model_spec(tiny_source)
    keep = {layer: [0, 1, 3] for layer in spec.moe_layers + spec.mtp_layers}
    out = tmp_path_factory.mktemp("preflight-pruned") / "tiny-tr3-keep3"
    with SourceCheckpoint.open(tiny_source) as ckpt:
        plan = plan_artifact(spec, "tr3", source_shards=ckpt.locations, keep=keep)
        write_artifact_files(plan, ckpt, random_experts, out)
        provenance = Provenance(source_repo="glmquant/tiny", selection_sha256=selection_sha256(keep))  # as encode's
        finalize_artifact(plan, ckpt, out, provenance, verified_at="2026-01-01T00:00:00Z")
    return out


@pytest.fixture
def no_gate_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if serve-check starts its server or the fidelity gate."""

    def started(*args: Any, **kwargs: Any) -> Any:
        pytest.fail("a gate ran before the bad input was refused")

    monkeypatch.setattr(run_module, "_server", started)
    monkeypatch.setattr(run_module, "measure_fidelity", started)


def other_model(source: Path, out: Path, **changes: Any) -> Path:
    """A checkpoint directory whose config is the source's with `changes` to its text config (the refusal reads
    configs only, so no weights are needed)."""
    config = json.loads((source / "config.json").read_text())
    config["text_config"].update(changes)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_out_that_is_a_file_is_refused_before_any_gate(artifact: Path, tmp_path: Path, no_gate_runs: None) -> None:
    taken = tmp_path / "report"
    taken.write_text("mine")
    result = cli([str(artifact), "--gates", "speed", "--out", str(taken)])
    assert result.exit_code == 2, result.output
    assert f"--out {taken} is a file" in one_line(result) and "Traceback" not in result.output
    assert taken.read_text() == "mine"
    under = cli([str(artifact), "--gates", "speed", "--out", str(taken / "sub")])
    assert under.exit_code == 2 and f"--out {taken / 'sub'} cannot be made: {taken} is a file" in one_line(under)
    assert not (artifact / REPORT_JSON).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_out_is_refused_before_any_gate(artifact: Path, tmp_path: Path, no_gate_runs: None) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = cli([str(artifact), "--gates", "speed", "--out", str(locked)])
        made = cli([str(artifact), "--gates", "speed", "--out", str(locked / "new")])
    finally:
        locked.chmod(0o755)
    assert result.exit_code == 2 and f"--out {locked} is not writable" in one_line(result)
    assert made.exit_code == 2 and f"cannot be made: {locked} is not writable" in one_line(made)
    assert list(locked.iterdir()) == []


def test_unwritable_out_is_refused_even_for_root(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_gate_runs: None
) -> None:
    """What a read-only mount answers (root passes the permission bits, not a read-only file system)."""
    locked = tmp_path / "mounted-ro"
    locked.mkdir()
    real_access: Callable[..., bool] = os.access

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        return not (Path(path) == locked and mode & os.W_OK) and real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    result = cli([str(artifact), "--gates", "speed", "--out", str(locked)])
    assert result.exit_code == 2 and f"--out {locked} is not writable" in one_line(result)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"n_routed_experts": 8}, "n_routed_experts 8 vs 4"),
        ({"vocab_size": 512}, "vocab_size 512 vs 320"),
        ({"hidden_size": 256}, "hidden_size 256 vs 128"),
    ],
)
def test_bf16_source_of_another_model_is_refused_before_any_gate(
    artifact: Path,
    tiny_source: Path,
    tmp_path: Path,
    no_gate_runs: None,
    changes: dict[str, int],
    field: str,
) -> None:
    source = other_model(tiny_source, tmp_path / "other", **changes)
    out = tmp_path / "reports"
    result = cli([str(artifact), "--gates", "fidelity", "--bf16-source", str(source), "--out", str(out)])
    assert result.exit_code == 2, result.output
    message = one_line(result)
    assert f"--bf16-source {source / 'config.json'} vs ARTIFACT {artifact / 'config.json'}" in message
    assert f"not the same model ({field}" in message and "Traceback" not in result.output
    assert not out.exists() and not (artifact / REPORT_JSON).exists()


def test_the_source_of_a_pruned_artifact_is_accepted(
    pruned: Path, tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pruned artifact's config says 3 routed experts, its source's 4: its manifest's expert selection says why,
    so the gate runs (stubbed here: the refusal is what is tested) and the reports land in a new --out."""
    ran = []

    def measured(artifact: Path, source: Path, ids: Any, device: str = "cpu") -> FidelityResult:
        ran.append((artifact, source))
        return FidelityResult(16, 0.01, 0.99, 10.0, 10.1)

    monkeypatch.setattr(run_module, "measure_fidelity", measured)
    assert load_model_spec(pruned).n_routed_experts == 3
    out = tmp_path / "new" / "reports"
    args = ["--gates", "fidelity", "--panel-rows", "1", "--panel-tokens", "16", "--out", str(out)]
    result = cli([str(pruned), "--bf16-source", str(tiny_source), *args])
    assert result.exit_code == 0, result.output
    assert ran == [(pruned, tiny_source)] and (out / REPORT_JSON).is_file() and (out / REPORT_MD).is_file()
    # fewer experts than the pruned artifact kept: not its source
    fewer = other_model(tiny_source, tmp_path / "two-experts", n_routed_experts=2)
    refused = cli([str(pruned), "--bf16-source", str(fewer), *args])
    assert refused.exit_code == 2 and "n_routed_experts 2 vs 3; a pruned artifact keeps fewer" in one_line(refused)
    # the same config without the manifest that records the pruning: 4 vs 3 is another model
    unrecorded = tmp_path / "unrecorded"
    unrecorded.mkdir()
    shutil.copy(pruned / "config.json", unrecorded / "config.json")
    refused = cli([str(unrecorded), "--bf16-source", str(tiny_source), *args])
    assert refused.exit_code == 2 and "n_routed_experts 4 vs 3; its EXL3_MANIFEST.json records no" in one_line(refused)
    assert ran == [(pruned, tiny_source)]


def test_a_missing_bf16_source_is_named(artifact: Path, tmp_path: Path, no_gate_runs: None) -> None:
    result = cli([str(artifact), "--gates", "fidelity", "--bf16-source", str(tmp_path / "absent")])
    assert result.exit_code == 2 and f"--bf16-source {tmp_path / 'absent'} is not a directory" in one_line(result)
