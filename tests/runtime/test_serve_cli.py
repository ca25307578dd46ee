"""`glmquant serve`: vLLM's option names reach the library, a busy port or a bad host fails before the model
loads, and Ctrl-C ends an open stream cleanly (its final chunk and `[DONE]`) before the process exits 0."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import typer
from typer.testing import CliRunner

from glmquant.cli import serve
from glmquant.runtime import server as server_module
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.service import ServiceOptions
from glmquant.runtime.speculative import SpeculativeConfig


def _app() -> typer.Typer:
    app = typer.Typer()
    serve.register(app)
    app.command("other")(lambda: None)  # two commands, so `serve` stays a named subcommand
    return app


def test_vllm_option_names_reach_run_server(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: calls.append(args))
    result = CliRunner().invoke(
        _app(),
        [
            "serve",
            str(tmp_path),
            "--port",
            "9001",
            "--max-num-seqs",
            "2",
            "--expert-cache",
            "8",
            "--dtype",
            "half",
            "--served-model-name",
            "glm",
            "--max-model-len",
            "2048",
            "--api-key",
            "sesame",
        ],
    )
    assert result.exit_code == 0, result.output
    assert calls == [
        (
            tmp_path,
            "127.0.0.1",
            9001,
            RuntimeOptions(device="cpu", dtype="half", expert_cache=8),
            ServiceOptions(served_model_name="glm", max_num_seqs=2, max_model_len=2048),
            "sesame",
        )
    ]
    calls.clear()
    assert CliRunner().invoke(_app(), ["serve", str(tmp_path)]).exit_code == 0
    assert calls[0][3].dtype == "auto" and calls[0][5] is None  # the checkpoint's dtype, no key


def test_dummy_weights_and_the_runtime_engine_are_options(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: calls.append(args))
    result = CliRunner().invoke(
        _app(),
        [
            "serve",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--model-impl",
            "glmquant",
            "--device",
            "cuda",
            "--backend",
            "triton",
        ],
    )
    assert result.exit_code == 0, result.output
    assert calls[0][3] == RuntimeOptions(
        device="cuda", dtype="auto", backend="triton", load_format="dummy", model_impl="glmquant"
    )


def test_speculative_config_is_vllms_json(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: calls.append(args))
    config = '{"method": "mtp", "num_speculative_tokens": 3}'
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--speculative-config", config])
    assert result.exit_code == 0, result.output
    assert calls[0][3] == RuntimeOptions(dtype="auto", speculative_config=SpeculativeConfig("mtp", 3))
    result = CliRunner().invoke(
        _app(), ["serve", str(tmp_path), "--speculative-config", config, "--model-impl", "glmquant"]
    )
    assert result.exit_code == 0, result.output
    assert calls[1][3] == RuntimeOptions(
        dtype="auto", model_impl="glmquant", speculative_config=SpeculativeConfig("mtp", 3)
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}'], "integer in 1..3"),
        (["--speculative-config", '{"method": "ngram"}'], "method must be one of mtp"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--dtype", "int8"], "--dtype must be one of auto, bfloat16, float16, half, float32, float"),
        (["--load-format", "safetensors"], "--load-format must be one of auto, dummy"),
        (["--model-impl", "vllm"], "--model-impl must be one of transformers, glmquant"),
        (["--compile-decode"], "--compile-decode compiles the runtime's own forward: it needs --model-impl glmquant"),
        (["--dense-linear-max-weights", "-1"], "--dense-linear-max-weights must be >= 0, got -1"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(monkeypatch, tmp_path, args, message):
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: None)
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.output


def test_dtype_auto_is_the_checkpoints_own():
    assert RuntimeOptions(dtype="auto").resolved_for({"dtype": "bfloat16"}).dtype == "bfloat16"
    assert RuntimeOptions(dtype="auto").resolved_for({"text_config": {"dtype": "float16"}}).dtype == "float16"
    assert RuntimeOptions(dtype="auto").resolved_for({"dtype": "float32"}).dtype == "bfloat16"  # as vLLM
    assert RuntimeOptions(dtype="half").resolved_for({}).dtype == "float16"


def test_busy_port_and_bad_host_fail_before_the_model_loads(monkeypatch, artifacts):
    monkeypatch.setattr(server_module, "ModelService", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(_app(), ["serve", str(artifacts["tr3"]), "--port", str(port)])
    assert result.exit_code == 2 and f"127.0.0.1:{port}: address already in use" in result.output
    result = CliRunner().invoke(_app(), ["serve", str(artifacts["tr3"]), "--host", "no-such-host.invalid"])
    assert result.exit_code == 2 and "--host 'no-such-host.invalid' is not an address" in result.output


@pytest.mark.slow
def test_ctrl_c_ends_an_open_stream_cleanly_and_exits_0(artifacts):
    """SIGINT to `glmquant serve` while a long stream runs: the stream gets a final chunk (finish reason
    "abort") and `[DONE]`, a request waiting for the one slot is answered 503, and the process exits 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = "from glmquant.cli import main; main()"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            str(artifacts["tr3"]),
            "--port",
            str(port),
            "--max-model-len",
            "4096",
            "--expert-cache",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for(lambda: proc.poll() is not None or _health(port) is not None, 120)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        body = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 4000, "temperature": 1.0, "seed": 1}
        stream = _send(port, {**body, "stream": True})
        assert stream.status == 200 and stream.readline().startswith(b"data:")  # the stream is open
        # its first chunk precedes its generation: until the stream holds the slot, the second request could take it
        _wait_for(lambda: (_health(port) or {}).get("requests_running") == 1)
        queued: list[tuple[int, dict]] = []
        waiter = threading.Thread(target=lambda: queued.append(_answer(_send(port, body))))
        waiter.start()
        _wait_for(lambda: (_health(port) or {}).get("requests_waiting") == 1)
        proc.send_signal(signal.SIGINT)
        events = [line.decode().strip().removeprefix("data: ") for line in stream if line.startswith(b"data:")]
        waiter.join(60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert queued[0][0] == 503 and queued[0][1]["error"]["code"] == 503
        output = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _send(port: int, body: dict) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn.getresponse()


def _answer(response: http.client.HTTPResponse) -> tuple[int, dict]:
    return response.status, json.loads(response.read())


def _health(port: int) -> dict | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    except OSError:
        return None


def _wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_compile_decode_reaches_the_engine(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: calls.append(args))
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--model-impl", "glmquant", "--compile-decode"])
    assert result.exit_code == 0, result.output
    assert calls[0][3] == RuntimeOptions(dtype="auto", model_impl="glmquant", compile_decode=True)
    calls.clear()
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--dense-linear-max-weights", "0"])
    assert result.exit_code == 0, result.output
    assert calls[0][3].dense_linear_max_weights == 0
