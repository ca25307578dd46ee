"""The client -> scoring -> report path over real HTTP against the scripted server (tests/servecheck/conftest.py)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from glmquant.cli.serve_check import register
from glmquant.errors import UsageError
from glmquant.runtime.speculative import SpeculativeConfig
from glmquant.servecheck import ServeCheckConfig, serve_check
from glmquant.servecheck.chat import ChatRequest
from glmquant.servecheck.client import ChatClient

CHAT = ("text", "tools", "multilingual", "images", "video", "needle", "speed")


def config(url: str, tokenizer: Path, out: Path, **overrides) -> ServeCheckConfig:
    return ServeCheckConfig(
        endpoint=url,
        tokenizer=tokenizer,
        out=out,
        needle_tokens=2500,
        speed_inputs=(600, 900),
        concurrency=2,
        seed=1,
        timeout_s=30,
        **overrides,
    )


def test_stream_is_collected_with_usage_reasoning_and_timings(scripted) -> None:
    client = ChatClient(scripted.url, timeout_s=30)
    assert client.first_model() == "scripted-glm"
    prompt = "Return exactly FINAL_BASELINE_OK as your final answer, with no punctuation or surrounding text."
    result = client.complete("scripted-glm", ChatRequest(({"role": "user", "content": prompt},), thinking=True))
    assert result.content == "FINAL_BASELINE_OK" and result.reasoning.startswith("The user wants")
    assert result.finish_reason == "stop" and result.error is None
    assert result.usage is not None and result.usage.cached_tokens == 0
    assert result.usage.prompt_tokens == scripted.tokenizer.count([{"role": "user", "content": prompt}])
    t = result.timings
    assert t is not None and t.first_token is not None and t.last_token is not None
    assert t.start < t.first_token < t.last_token <= t.end
    assert result.decode_tps is not None and result.decode_tps > 0
    sent = scripted.requests[-1]
    assert sent["temperature"] == 0 and sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and "max_tokens" not in sent


def test_a_dead_endpoint_is_a_recorded_failure_not_a_crash() -> None:
    dead = ChatClient("http://127.0.0.1:9/v1", timeout_s=5)
    result = dead.complete("m", ChatRequest(({"role": "user", "content": "hi"},)))
    assert result.error is not None and result.error.startswith("APIConnectionError")
    with pytest.raises(UsageError, match="cannot list the served models"):
        dead.first_model()


def test_every_gate_passes_against_a_correct_server(scripted, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    report = serve_check(config(scripted.url, tiny_tokenizer_dir, tmp_path))
    assert [g.name for g in report.gates] == list(CHAT)
    assert report.passed, [g.summary for g in report.gates]
    needle = report.gates[5].cases[0]
    assert needle.metrics["server_prompt_tokens"] == needle.metrics["local_prompt_tokens"]
    assert abs(needle.metrics["local_prompt_tokens"] - 2500) <= 3 and needle.metrics["cached_tokens"] == 0
    speed = report.gates[6].cases
    assert [c.name for c in speed] == ["600 in x2", "900 in x2"] and all(len(c.responses) == 2 for c in speed)
    assert all(c.metrics["decode_tps"] > 0 and c.metrics["ttft_s"] > 0 for c in speed)
    # usage.speculative of both streams: 12 of 16 drafts accepted in 8 verify steps
    assert all(c.metrics["acceptance_rate"] == 0.75 and c.metrics["tokens_per_step"] == 2.5 for c in speed)
    assert speed[0].responses[0].usage is not None and speed[0].responses[0].usage.speculative is not None
    assert report.gates[0].cases[0].responses[0].usage.speculative is None  # type: ignore[union-attr]
    tools = [r for r in scripted.requests if r.get("tools")]
    assert tools[0]["tools"][0]["function"]["parameters"]["additionalProperties"] is False
    saved = json.loads((tmp_path / "serve-check.json").read_text())
    assert saved["passed"] is True and saved["target"] == scripted.url and saved["seed"] == 1
    assert "api_key" not in saved["settings"] and saved["settings"]["needle_tokens"] == 2500
    identity = saved["gates"][0]["cases"][0]["responses"][0]
    assert identity["content"] == "FINAL_BASELINE_OK" and identity["usage"]["completion_tokens"] > 0
    markdown = (tmp_path / "serve-check.md").read_text()
    assert (
        markdown.startswith("# serve-check: PASS") and "acceptance_rate" in markdown and "tokens_per_step" in markdown
    )


def test_every_gate_fails_for_its_own_reason_against_a_flawed_server(
    scripted, tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    scripted.flawed = True
    report = serve_check(config(scripted.url, tiny_tokenizer_dir, tmp_path))
    assert not report.passed
    reasons = {g.name: [c.reason for c in g.cases if not c.passed] for g in report.gates}
    assert all(not g.passed for g in report.gates)
    assert reasons["text"] == ["truncated (finish_reason 'length'), thinking-only: no final content"]
    assert reasons["tools"][0].startswith("raw GLM <tool_call> markup left in content")
    assert reasons["multilingual"] == ["answered '你好世界', expected '你好，世界'"]
    assert len(reasons["images"]) == 4
    assert all(r.startswith("final content is not valid JSON") for r in reasons["images"])
    assert all("direction" in r for r in reasons["video"]) and len(reasons["video"]) == 2
    needle = reasons["needle"][0]
    assert needle.startswith("3/4 values right") and "server counted" in needle and "prefix-cache hit: 1024" in needle
    assert all("sent no usage" in r for r in reasons["speed"])
    assert (tmp_path / "serve-check.md").read_text().startswith("# serve-check: FAIL")


def cli(args: list[str]):
    import typer

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps `serve-check` a subcommand
    return CliRunner().invoke(app, ["serve-check", *args])


def test_cli_exit_codes(scripted, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    common = [
        "--endpoint",
        scripted.url.removesuffix("/v1"),
        "--tokenizer",
        str(tiny_tokenizer_dir),
        "--out",
        str(tmp_path),
        "--seed",
        "3",
        "--gates",
        "text,multilingual,needle",
        "--needle-tokens",
        "2000",
    ]
    ok = cli(common)
    assert ok.exit_code == 0, ok.output
    assert "serve-check" in ok.output and "PASS" in ok.output
    scripted.flawed = True
    assert cli(common).exit_code == 1
    assert cli(["--gates", "text"]).exit_code == 2  # neither ARTIFACT nor --endpoint
    assert cli(["--endpoint", scripted.url, "--gates", "txt"]).exit_code == 2
    no_tokenizer = cli(["--endpoint", scripted.url, "--gates", "needle", "--out", str(tmp_path)])
    assert no_tokenizer.exit_code == 1 and "no usable /tokenize" in " ".join(no_tokenizer.output.split())
    assert cli(["--endpoint", scripted.url, "--speed-inputs", "1k"]).exit_code == 2


def test_cli_hands_the_library_the_exact_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = {}

    def fake(config, observer=None):
        seen["config"] = config
        raise UsageError("stop here")

    monkeypatch.setattr("glmquant.cli.serve_check.serve_check", fake)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = cli(
        [
            str(tmp_path),
            "--gates",
            "needle,speed,fidelity",
            "--needle-tokens",
            "4096",
            "--speed-inputs",
            "512,2048",
            "--concurrency",
            "4",
            "--bf16-source",
            str(tmp_path),
            "--kl-max",
            "0.3",
            "--top1-min",
            "0.8",
            "--max-tokens",
            "64",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 2}',
        ]
    )
    assert result.exit_code == 2
    assert seen["config"] == ServeCheckConfig(
        artifact=tmp_path,
        gates=("needle", "speed", "fidelity"),
        needle_tokens=4096,
        speed_inputs=(512, 2048),
        concurrency=4,
        bf16_source=tmp_path,
        kl_max=0.3,
        top1_min=0.8,
        max_tokens=64,
        speculative_config=SpeculativeConfig("mtp", 2),
    )
    with pytest.raises(UsageError, match="configures the embedded server"):
        ServeCheckConfig(endpoint="http://127.0.0.1:9/v1", speculative_config=SpeculativeConfig())


def test_skipped_gates_and_thresholds_are_listed(scripted, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """The console and both reports name every gate that did not run and why, and what each gate passed on."""
    result = cli(
        [
            "--endpoint",
            scripted.url,
            "--tokenizer",
            str(tiny_tokenizer_dir),
            "--out",
            str(tmp_path),
            "--gates",
            "text,speed",
            "--speed-inputs",
            "600",
            "--min-decode-tps",
            "2",
            "--seed",
            "1",
        ]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 0, output
    for gate in ("tools", "multilingual", "images", "video", "needle", "fidelity"):
        assert re.search(rf"{gate} │ SKIP │ not selected \(--gates\)", output), gate
    assert "mean decode >= 2 tok/s" in output and "content exactly FINAL_BASELINE_OK" in output
    saved = json.loads((tmp_path / "serve-check.json").read_text())
    assert saved["skipped_gates"]["video"] == "not selected (--gates)"
    assert saved["thresholds"]["speed"].endswith("mean decode >= 2 tok/s")
    markdown = (tmp_path / "serve-check.md").read_text()
    assert "| fidelity | SKIP | not selected (--gates) | - |" in markdown and "mean decode >= 2 tok/s" in markdown
    default = ServeCheckConfig(endpoint=scripted.url)
    assert default.skipped_gates == {
        "fidelity": "needs --bf16-source DIR and ARTIFACT (it runs the artifact in-process)"
    }
    assert (
        "mean KL <= 0.5 nats and top-1 agreement >= 0.75"
        in ServeCheckConfig(artifact=tmp_path, bf16_source=tmp_path).thresholds["fidelity"]
    )


def test_speed_has_a_threshold(scripted, tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    report = serve_check(config(scripted.url, tiny_tokenizer_dir, tmp_path, gates=("speed",), min_decode_tps=1e9))
    assert not report.passed
    assert all("below the 1e+09 tok/s threshold" in c.reason for c in report.gates[0].cases)


def test_max_model_len_and_the_servers_tokenizer(scripted, tmp_path: Path) -> None:
    """Without --tokenizer the endpoint's /tokenize sizes the prompts; cells that cannot fit its max_model_len are
    resized (needle) or skipped (speed), and the report says so."""
    scripted.max_model_len, scripted.offers_tokenize = 2000, True
    report = serve_check(
        ServeCheckConfig(
            endpoint=scripted.url,
            out=tmp_path,
            gates=("needle", "speed"),
            needle_tokens=2500,
            speed_inputs=(600, 3000),
            max_tokens=64,
            seed=1,
            timeout_s=30,
            min_decode_tps=0,
        )
    )
    needle, speed = report.gates
    assert report.passed, [g.summary for g in report.gates]
    assert [c.name for c in needle.cases] == ["1936 tokens"]
    assert abs(needle.cases[0].metrics["local_prompt_tokens"] - 1936) <= 3
    assert needle.cases[0].metrics["server_prompt_tokens"] == needle.cases[0].metrics["local_prompt_tokens"]
    assert needle.notes == (
        "2500-token prompt sized to 1936: the endpoint's max_model_len is 2000, 64 tokens kept for the answer",
    )
    assert [c.name for c in speed.cases] == ["600 in x1"]
    assert speed.notes[0].startswith("3000-token prompt skipped: the endpoint's max_model_len is 2000")
    assert "- 3000-token prompt skipped" in (tmp_path / "serve-check.md").read_text()


MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}]}
# what a server that is not an OpenAI endpoint answers: (content type, body) of GET /models and of the chat route
GARBAGE = {
    "html everywhere": (("text/html", b"<html>hello</html>"), None),
    "models not JSON": (("application/json", b"not json{"), None),
    "models of another shape": (("application/json", b'{"data": 5}'), None),
    "model without an id": (("application/json", b'{"data": [7]}'), None),
    "chat stream not JSON": (None, ("text/event-stream", b"data: {garbage\n\ndata: [DONE]\n\n")),
    "chat chunks of another shape": (None, ("text/event-stream", b'data: {"choices": 7}\n\ndata: [DONE]\n\n')),
    "chat answers HTML": (None, ("text/html", b"<html>busy</html>")),
}


@pytest.fixture
def garbage() -> Iterator[tuple[str, dict[str, Any]]]:
    """An HTTP server answering what `routes` says: {"models": (type, body) or None, "chat": ...}; None: the real
    OpenAI answer for models, an empty stream for chat."""
    routes: dict[str, Any] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            models = ("application/json", json.dumps(MODELS).encode())
            kind, body = (
                routes.get("models") or models
                if self.path.endswith("/models")
                else routes.get("chat") or ("text/event-stream", b"data: [DONE]\n\n")
            )
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", routes
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("case", list(GARBAGE))
def test_an_endpoint_answering_garbage_is_a_clear_error_not_a_traceback(garbage, case: str, tmp_path: Path) -> None:
    """An endpoint that answers something else than the OpenAI API: a listing that is not one is a usage error (exit
    2) naming the endpoint; a chat answer that is not one fails the gate with the reason. Each used to end in a
    Python traceback (JSONDecodeError, TypeError, AttributeError from inside the openai client)."""
    url, routes = garbage
    routes["models"], routes["chat"] = GARBAGE[case]
    client = ChatClient(f"{url}/v1", timeout_s=10)
    result = cli(["--endpoint", url, "--gates", "text", "--out", str(tmp_path)])
    output = " ".join(result.output.split())
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), output
    if routes["models"] is not None:
        with pytest.raises(UsageError, match="GET /models is not an OpenAI API answer"):
            client.first_model()
        assert client.max_model_len("m") is None
        assert result.exit_code == 2 and f"error: {url}/v1: GET /models is not an OpenAI API answer" in output
    else:
        assert client.first_model() == "m"
        answer = client.complete("m", ChatRequest(({"role": "user", "content": "hi"},)))
        assert answer.content == "" and answer.finish_reason is None
        if case != "chat answers HTML":  # no event in it: an empty stream, which the gate fails as such
            assert answer.error is not None and answer.error.startswith("the chat completion stream is not an OpenAI")
        assert result.exit_code == 1 and "FAIL" in output
        assert json.loads((tmp_path / "serve-check.json").read_text())  # the reports are written
