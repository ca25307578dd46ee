"""The scale rehearsal runs end to end on CPU at tiny widths (the same code path the H200 runs at real widths)
and writes the report with the full-model extrapolation; a stage past the time limit fails loudly."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_scale.py"

pytestmark = pytest.mark.slow


def _run(source: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        str(SCRIPT),
        "--device",
        "cpu",
        "--config",
        str(source / "config.json"),
        "--layers",
        "3",
        "--experts",
        "4",
        "--encode-experts",
        "2",
        "--rows",
        "2",
        "--tokens",
        "16",
        "--batch-rows",
        "1",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "2",
        "--work",
        str(tmp_path / "work"),
        "--results",
        str(tmp_path / "scale.json"),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def test_rehearsal_runs_end_to_end_on_cpu(tiny_source: Path, tmp_path: Path) -> None:
    """Device streams, as the GPU rehearsal runs: the resume stage then times a killed run's worst recompute."""
    run = _run(tiny_source, tmp_path, "--device-streams-every", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "scale.json").read_text())
    assert set(record["stages"]) == {"fixture", "build", "verify", "runtime", "resume"} and "failed" not in record
    resume = record["stages"]["resume"]  # every layer's plain forward from the embeddings, each layer loaded
    assert [layer["layer"] for layer in resume["layers"]] == [0, 1, 2]
    costs = [layer["cost"] for layer in resume["layers"]]
    assert all(c["recomputed_chunks"] == c["chunks"] > 0 and c["parts_bytes"]["advance.load"] for c in costs)
    assert resume["recompute_s"] >= sum(c["advance_s"] for c in costs)
    assert not (tmp_path / "work" / "resume-state").exists()
    assert record["extrapolation"]["resume_recompute_at_most_s"]["inputs"]["measured"] == "resume stage"
    build = record["stages"]["build"]
    assert [layer["layer"] for layer in build["encode_layers"]] == [1, 2]
    assert all(layer["cost"]["observe_s"] > 0 for layer in build["observation"]["layers"] if layer["mlp"] == "moe")
    assert build["observation_disk_peak_bytes"] > 0 and record["stages"]["verify"]["ok"]
    assert len(record["stages"]["runtime"]["tokens"]) == 2
    full = record["full_model"]
    assert {"observe_h", "encode_h", "peak_host_rss_gb", "peak_gpu_gb", "observation_disk_gb"} <= set(full)
    assert all(fig["formula"] for fig in record["extrapolation"].values())
    tokens = record["extrapolation"]["tokens"]["value"]
    assert tokens == 600 * 2048 + 4 * 128 * 1024  # the full recipe's token count
    # extrapolated again from the record alone: its shape, not this command's (--tokens 999), the same figures
    again = _run(tiny_source, tmp_path / "again", "--extrapolate-only", str(tmp_path / "scale.json"), "--tokens", "999")
    assert again.returncode == 0, again.stderr[-3000:]
    redone = json.loads((tmp_path / "again" / "scale.json").read_text())
    assert redone["full_model"] == full and redone["stages"] == record["stages"]
    assert redone["extrapolated_again"]["from"] == str(tmp_path / "scale.json")
    assert not (tmp_path / "again" / "work").exists()  # nothing ran


def test_a_stage_past_the_time_limit_fails_loudly(tiny_source: Path, tmp_path: Path) -> None:
    run = _run(tiny_source, tmp_path, "--time-limit-s", "2")
    assert run.returncode != 0 and re.search(r"stage '\w+' (did not finish within|no time left)", run.stderr)
    assert json.loads((tmp_path / "scale.json").read_text())["failed"]["stage"] in ("fixture", "build")


def test_fewer_experts_than_the_router_needs_are_refused_before_any_stage(tiny_source: Path, tmp_path: Path) -> None:
    """One expert per layer: the router scores its group by its two best experts, so the runtime stage would crash
    after the whole build; the preflight refuses it, naming the option and the least it takes."""
    run = _run(tiny_source, tmp_path, "--encode-experts", "1")
    assert run.returncode != 0 and "--encode-experts: 1 kept experts per layer; the router needs 2 to 4" in run.stderr
    assert not (tmp_path / "work").exists()


def _bench_scale():
    sys.path.insert(0, str(ROOT / "scripts"))  # its helpers (bench_common), as when run as a script
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench_scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_scale)
    return bench_scale


def test_a_resume_stage_that_does_not_finish_is_recorded_and_the_rest_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume stage measures beside the build: its overrun is recorded, not a failed rehearsal; any other
    stage's ends the run."""
    bench_scale = _bench_scale()
    ran: list[str] = []

    def run_stage(args, record, stage, child_argv, left):
        ran.append(stage)
        if stage in fails:
            return "did not finish within 1 s"
        record["stages"][stage] = {"wall_s": 1.0}
        return None

    monkeypatch.setattr(bench_scale, "run_stage", run_stage)
    args = bench_scale.parse_args(["--device-streams-every", "2", "--results", str(tmp_path / "scale.json")])
    fails = {"resume"}
    record: dict = {"stages": {}}
    bench_scale.run_stages(args, record)
    assert ran == list(bench_scale.STAGES) and set(record["stages"]) == set(bench_scale.STAGES) - {"resume"}
    assert record["resume_not_measured"] == "did not finish within 1 s" and "failed" not in record
    fails, ran[:] = {"verify"}, []
    with pytest.raises(SystemExit, match="stage 'verify' did not finish"):
        bench_scale.run_stages(args, {"stages": {}})
    assert ran == ["fixture", "build", "verify"]
    args = bench_scale.parse_args(["--results", str(tmp_path / "disk.json")])  # disk streams: no resume stage
    fails, ran[:] = set(), []
    bench_scale.run_stages(args, {"stages": {}})
    assert "resume" not in ran


def test_extrapolate_only_never_writes_over_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--extrapolate-only writes neither into the record it reads nor into the default record of a run."""
    bench_scale = _bench_scale()
    record = str(tmp_path / "scale.json")
    for extra, message in (([], "needs --results"), (["--results", record], "is the record")):
        with pytest.raises(SystemExit) as refused:
            bench_scale.parse_args(["--extrapolate-only", record, *extra])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    args = bench_scale.parse_args(["--extrapolate-only", record, "--results", str(tmp_path / "again.json")])
    assert args.results == tmp_path / "again.json"
    assert bench_scale.parse_args([]).results == bench_scale.DEFAULT_RESULTS
