"""`glmquant serve` hands the library exactly the options given (no server is started here)."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from glmquant.cli import serve
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.service import ServiceOptions


def _app() -> typer.Typer:
    app = typer.Typer()
    serve.register(app)
    app.command("other")(lambda: None)  # two commands, so `serve` stays a named subcommand
    return app


def test_options_reach_run_server(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: calls.append(args))
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--port", "9001", "--concurrency", "2",
                                         "--expert-cache", "8", "--dtype", "float32", "--model-id", "glm"])
    assert result.exit_code == 0, result.output
    assert calls == [(tmp_path, "127.0.0.1", 9001, RuntimeOptions(device="cpu", dtype="float32", expert_cache=8),
                      ServiceOptions(model_id="glm", concurrency=2))]


def test_bad_option_is_one_line_and_exit_2(monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "run_server", lambda *args, **kwargs: None)
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--concurrency", "0"])
    assert result.exit_code == 2 and "--concurrency must be >= 1" in result.output
