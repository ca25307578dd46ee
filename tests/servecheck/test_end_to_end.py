"""The whole path on a tiny artifact: glmquant's own server -> openai client -> scoring -> report, and the
fidelity gate against BF16 checkpoints. A random tiny model cannot answer the gates; what is asserted is
what is checkable: token counts, needle placement, usage fields, finish reasons, fidelity numbers, files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("glmquant.runtime.server", reason="the runtime's embedded server (glmquant.runtime.server) "
                                                      "is not importable here")

from glmquant.runtime.server import serve_in_background
from glmquant.servecheck import ServeCheckConfig, ServeCheckReport, serve_check
from glmquant.servecheck.tokens import PromptTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the runtime tests' artifact builder
from artifact_builder import build_artifact, write_reference

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tr3 artifact of the tiny model with random (valid) EXL3 experts."""
    return build_artifact(tiny_source, tmp_path_factory.mktemp("servecheck-artifact") / "tiny-tr3", "tr3")


@pytest.fixture(scope="module")
def embedded_report(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> ServeCheckReport:
    out = tmp_path_factory.mktemp("servecheck-embedded")
    return serve_check(ServeCheckConfig(
        artifact=artifact, out=out, gates=("text", "tools", "multilingual", "images", "needle", "speed"),
        needle_tokens=1500, speed_inputs=(200, 700), concurrency=2, max_tokens=MAX_TOKENS, seed=5, timeout_s=300))


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
        assert cell.metrics["completion_tokens"] == sum(r.usage.completion_tokens for r in cell.responses)
        assert cell.metrics["wall_s"] >= max(r.timings.wall_s for r in cell.responses)
    assert not gates["text"].passed and not gates["images"].passed and not embedded_report.passed


def test_report_files_hold_every_response(embedded_report: ServeCheckReport, artifact: Path) -> None:
    out = Path(embedded_report.settings["out"])
    data = json.loads((out / "serve-check.json").read_text())
    assert data["passed"] is False and data["model"] == artifact.name
    assert [g["name"] for g in data["gates"]] == ["text", "tools", "multilingual", "images", "needle", "speed"]
    speed = data["gates"][5]["cases"][0]
    assert len(speed["responses"]) == 2 and all(r["usage"]["prompt_tokens"] > 0 for r in speed["responses"])
    markdown = (out / "serve-check.md").read_text()
    assert markdown.startswith("# serve-check: FAIL") and "| speed | PASS |" in markdown


def test_glmquant_serve_as_an_external_endpoint(artifact: Path, tmp_path: Path) -> None:
    """No fakes: the CLI is pointed at a running glmquant server as at any OpenAI-compatible endpoint."""
    import typer

    from glmquant.cli.serve_check import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    with serve_in_background(artifact) as server:
        result = CliRunner().invoke(app, [
            "serve-check", "--endpoint", server.base_url, "--tokenizer", str(artifact), "--out", str(tmp_path),
            "--gates", "speed,multilingual", "--speed-inputs", "300", "--max-tokens", "4", "--seed", "2"])
    assert result.exit_code == 1, result.output  # multilingual cannot pass on a random model
    data = json.loads((tmp_path / "serve-check.json").read_text())
    assert data["target"] == server.base_url and data["model"] == artifact.name
    assert [g["passed"] for g in data["gates"]] == [False, True]
    assert all(r["responses"][0]["usage"]["completion_tokens"] <= 4 for r in data["gates"][0]["cases"])


@pytest.fixture(scope="module")
def reference(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The artifact's own weights as a BF16-named checkpoint (experts decoded): fidelity must be ~perfect."""
    return write_reference(artifact, tmp_path_factory.mktemp("servecheck-reference") / "ref")


def fidelity(artifact: Path, source: Path, out: Path) -> dict:
    report = serve_check(ServeCheckConfig(artifact=artifact, bf16_source=source, gates=("fidelity",), out=out,
                                          panel_rows=2, panel_tokens=48, kl_max=0.01, top1_min=0.9, seed=0))
    return {"passed": report.passed, **report.gates[0].cases[0].metrics}


def test_fidelity_against_the_artifacts_own_weights_and_against_other_weights(
        artifact: Path, reference: Path, tiny_source: Path, tmp_path: Path) -> None:
    same = fidelity(artifact, reference, tmp_path / "same")
    other = fidelity(artifact, tiny_source, tmp_path / "other")  # the tiny source's experts are not the artifact's
    assert same["positions"] == other["positions"] == 96
    assert 0 <= same["mean_kl"] < 1e-3 and same["top1_agreement"] >= 0.95 and same["passed"]
    assert other["mean_kl"] > 20 * max(same["mean_kl"], 1e-6)
    assert same["source_ppl"] == pytest.approx(same["artifact_ppl"], rel=0.01)
    saved = json.loads((tmp_path / "same" / "serve-check.json").read_text())
    assert saved["gates"][0]["cases"][0]["expected"] == {"mean_kl_max": 0.01, "top1_agreement_min": 0.9}


@pytest.mark.gpu
def test_gates_and_fidelity_on_cuda(artifact: Path, reference: Path, tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    report = serve_check(ServeCheckConfig(
        artifact=artifact, bf16_source=reference, device="cuda", out=tmp_path, gates=("needle", "speed", "fidelity"),
        needle_tokens=1500, speed_inputs=(700,), max_tokens=MAX_TOKENS, panel_rows=2, panel_tokens=48,
        kl_max=0.01, top1_min=0.9, seed=3, timeout_s=300))
    gates = {g.name: g for g in report.gates}
    needle = gates["needle"].cases[0].metrics
    assert needle["server_prompt_tokens"] == needle["local_prompt_tokens"]
    assert gates["speed"].passed and gates["fidelity"].passed, (gates["speed"].summary, gates["fidelity"].summary)
    assert gates["fidelity"].cases[0].metrics["mean_kl"] < 1e-3
