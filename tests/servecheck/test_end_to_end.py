"""The whole path on a tiny artifact: glmquant's own server -> openai client -> scoring -> report, and the
fidelity gate against BF16 checkpoints. A random tiny model cannot answer the gates; what is asserted is
what is checkable: token counts, needle placement, usage fields, finish reasons, fidelity numbers, files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip(
    "glmquant.runtime.server", reason="the runtime's embedded server (glmquant.runtime.server) is not importable here"
)

from glmquant.cli import app
from glmquant.fixtures.random_artifact import build_artifact, write_reference
from glmquant.runtime.service import served_model_name
from glmquant.runtime.speculative import SpeculativeConfig
from glmquant.servecheck import ServeCheckConfig, ServeCheckReport, serve_check
from glmquant.servecheck.tokens import PromptTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("servecheck-end-to-end")]  # pytest-xdist: module fixtures once

MAX_TOKENS = 6
SERVE_MAIN = "from glmquant.cli import main; main()"


@pytest.fixture(scope="module")
def artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tr3 artifact of the tiny model with random (valid) EXL3 experts."""
    return build_artifact(tiny_source, tmp_path_factory.mktemp("servecheck-artifact") / "tiny-tr3", "tr3")


@pytest.fixture(scope="module")
def embedded_report(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> ServeCheckReport:
    out = tmp_path_factory.mktemp("servecheck-embedded")
    return serve_check(
        ServeCheckConfig(
            artifact=artifact,
            out=out,
            gates=("text", "tools", "multilingual", "images", "needle", "speed"),
            needle_tokens=1500,
            speed_inputs=(200, 700),
            concurrency=2,
            max_tokens=MAX_TOKENS,
            seed=5,
            timeout_s=300,
            min_decode_tps=1.0,
        )
    )


def test_embedded_server_responses_are_complete_and_counted(embedded_report: ServeCheckReport, artifact: Path) -> None:
    responses = [(c, r) for g in embedded_report.gates for c in g.cases for r in c.responses]
    assert len(responses) == 1 + 1 + 3 + 4 + 1 + 2 * 2
    tokenizer = PromptTokenizer.from_dir(artifact)
    for case, r in responses:
        assert r.error is None, (case.name, r.error)
        assert r.usage is not None and r.finish_reason in ("stop", "length", "tool_calls")
        assert 0 < r.usage.completion_tokens <= MAX_TOKENS
        assert (r.finish_reason == "length") == (r.usage.completion_tokens == MAX_TOKENS)
        assert r.timings is not None and r.timings.ttft_s is not None and r.timings.ttft_s > 0
    identity = embedded_report.gates[0].cases[0].responses[0]
    prompt = "Return exactly FINAL_BASELINE_OK as your final answer, with no punctuation or surrounding text."
    assert identity.usage is not None
    assert identity.usage.prompt_tokens == tokenizer.count([{"role": "user", "content": prompt}])


def test_needle_is_placed_and_the_server_counts_the_same_prompt(embedded_report: ServeCheckReport) -> None:
    needle = embedded_report.gates[4].cases[0]
    m = needle.metrics
    assert 1497 <= m["local_prompt_tokens"] <= 1500
    assert m["server_prompt_tokens"] == m["local_prompt_tokens"]
    assert len(m["needle_positions"]) == 4 and m["needle_positions"] == sorted(m["needle_positions"])
    assert all(abs(d - want) < 0.06 for d, want in zip(m["needle_depths"], (0.05, 0.35, 0.65, 0.95)))
    assert not needle.passed  # a random model retrieves nothing


def test_speed_cells_pass_and_gates_a_random_model_cannot_answer_fail(embedded_report: ServeCheckReport) -> None:
    gates = {g.name: g for g in embedded_report.gates}
    assert gates["speed"].passed, gates["speed"].summary
    for cell, n in zip(gates["speed"].cases, (200, 700)):
        assert n - 3 <= cell.metrics["input_tokens"] <= n and cell.metrics["concurrency"] == 2
        assert cell.responses
        completion_tokens, wall_s = 0, 0.0
        for r in cell.responses:
            assert r.usage is not None and r.timings is not None
            completion_tokens, wall_s = completion_tokens + r.usage.completion_tokens, max(wall_s, r.timings.wall_s)
        assert cell.metrics["completion_tokens"] == completion_tokens
        assert cell.metrics["wall_s"] >= wall_s
    assert not gates["text"].passed and not gates["images"].passed and not embedded_report.passed


def test_report_files_hold_every_response(embedded_report: ServeCheckReport, artifact: Path) -> None:
    out = Path(embedded_report.settings["out"])
    data = json.loads((out / "serve-check.json").read_text())
    assert data["passed"] is False and data["model"] == served_model_name(artifact)  # the artifact's own name
    assert [g["name"] for g in data["gates"]] == ["text", "tools", "multilingual", "images", "needle", "speed"]
    speed = data["gates"][5]["cases"][0]
    assert len(speed["responses"]) == 2 and all(r["usage"]["prompt_tokens"] > 0 for r in speed["responses"])
    markdown = (out / "serve-check.md").read_text()
    assert markdown.startswith("# serve-check: FAIL") and "| speed | PASS |" in markdown


@pytest.fixture
def glmquant_serve(artifact: Path) -> Iterator[str]:
    """`glmquant serve ARTIFACT --port 0` in its own process; yields its base URL once it is serving."""
    command = [sys.executable, "-c", SERVE_MAIN, "serve", str(artifact), "--port", "0"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "COLUMNS": "400"}
    )  # wide: the URL must not be wrapped
    assert proc.stdout is not None
    try:
        deadline, url = time.monotonic() + 120, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"http://127\.0\.0\.1:\d+/v1", proc.stdout.readline())
            url = found.group(0) if found else None
        assert url is not None, "glmquant serve did not report a URL within 120 s"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()


@pytest.mark.skipif(
    "serve" not in {c.name for c in app.registered_commands},
    reason="the `serve` verb (glmquant/cli/serve.py) is not registered in glmquant.cli yet",
)
def test_glmquant_serve_as_an_external_endpoint(glmquant_serve: str, artifact: Path, tmp_path: Path) -> None:
    """No fakes: serve-check pointed at a separately running `glmquant serve` like at any endpoint."""
    result = CliRunner().invoke(
        app,
        [
            "serve-check",
            "--endpoint",
            glmquant_serve,
            "--tokenizer",
            str(artifact),
            "--out",
            str(tmp_path),
            "--gates",
            "speed,multilingual",
            "--speed-inputs",
            "300",
            "--max-tokens",
            "4",
            "--seed",
            "2",
            "--min-decode-tps",
            "1",
        ],
    )
    assert result.exit_code == 1, result.output  # multilingual cannot pass on a random model
    data = json.loads((tmp_path / "serve-check.json").read_text())
    assert data["target"] == glmquant_serve and data["model"] == served_model_name(artifact)
    assert [g["passed"] for g in data["gates"]] == [False, True]
    assert all(c["responses"][0]["usage"]["completion_tokens"] <= 4 for c in data["gates"][0]["cases"])


@pytest.fixture(scope="module")
def reference(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The artifact's own weights as a BF16-named checkpoint (experts decoded): fidelity must be ~perfect."""
    return write_reference(artifact, tmp_path_factory.mktemp("servecheck-reference") / "ref")


def fidelity(artifact: Path, source: Path, out: Path) -> dict:
    report = serve_check(
        ServeCheckConfig(
            artifact=artifact,
            bf16_source=source,
            gates=("fidelity",),
            out=out,
            panel_rows=2,
            panel_tokens=48,
            kl_max=0.01,
            top1_min=0.9,
            seed=0,
        )
    )
    return {"passed": report.passed, **report.gates[0].cases[0].metrics}


def test_fidelity_against_the_artifacts_own_weights_and_against_other_weights(
    artifact: Path, reference: Path, tiny_source: Path, tmp_path: Path
) -> None:
    same = fidelity(artifact, reference, tmp_path / "same")
    other = fidelity(artifact, tiny_source, tmp_path / "other")  # the tiny source's experts are not the artifact's
    assert same["positions"] == other["positions"] == 96
    assert 0 <= same["mean_kl"] < 1e-3 and same["top1_agreement"] >= 0.95 and same["passed"]
    assert other["mean_kl"] > 20 * max(same["mean_kl"], 1e-6)
    assert same["source_ppl"] == pytest.approx(same["artifact_ppl"], rel=0.01)
    saved = json.loads((tmp_path / "same" / "serve-check.json").read_text())
    assert saved["gates"][0]["cases"][0]["expected"] == {"mean_kl_max": 0.01, "top1_agreement_min": 0.9}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gates_and_fidelity_on_cuda(artifact: Path, reference: Path, tmp_path: Path) -> None:
    report = serve_check(
        ServeCheckConfig(
            artifact=artifact,
            bf16_source=reference,
            device="cuda",
            out=tmp_path,
            gates=("needle", "speed", "fidelity"),
            needle_tokens=1500,
            speed_inputs=(700,),
            max_tokens=MAX_TOKENS,
            panel_rows=2,
            panel_tokens=48,
            kl_max=0.01,
            top1_min=0.9,
            seed=3,
            timeout_s=300,
        )
    )
    gates = {g.name: g for g in report.gates}
    needle = gates["needle"].cases[0].metrics
    assert needle["server_prompt_tokens"] == needle["local_prompt_tokens"]
    assert gates["speed"].passed and gates["fidelity"].passed, (gates["speed"].summary, gates["fidelity"].summary)
    assert gates["fidelity"].cases[0].metrics["mean_kl"] < 1e-3


def test_speed_gate_reports_mtp_acceptance(artifact: Path, tmp_path: Path) -> None:
    """The embedded server with --speculative-config: each speed cell records the acceptance rate and tokens per
    verify step from the streams' usage (a random MTP layer accepts few drafts; every step still yields a token)."""
    report = serve_check(
        ServeCheckConfig(
            artifact=artifact,
            out=tmp_path,
            gates=("speed",),
            speed_inputs=(200,),
            max_tokens=MAX_TOKENS,
            seed=5,
            timeout_s=300,
            min_decode_tps=0.1,
            speculative_config=SpeculativeConfig(num_speculative_tokens=2),
        )
    )
    cell = report.gates[0].cases[0]
    assert cell.passed, cell.reason
    usage = cell.responses[0].usage
    assert usage is not None and usage.speculative is not None
    assert usage.speculative.num_draft_tokens == 2 * usage.speculative.num_drafts > 0
    assert 0 <= cell.metrics["acceptance_rate"] <= 1 and 1 <= cell.metrics["tokens_per_step"] <= 3
    assert report.settings["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert "tokens_per_step" in (tmp_path / "serve-check.md").read_text()
