"""`glmquant serve --port`: only 0..65535 (0: any free port). The OS would take 70000 modulo 65536 and serve on 4464,
and answer -1 with an error that blames the host, so both are refused by name before anything binds or loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from glmquant.cli import serve
from glmquant.errors import UsageError
from glmquant.runtime import server as server_module


def _app() -> typer.Typer:
    app = typer.Typer()
    serve.register(app)
    app.command("other")(lambda: None)  # two commands, so `serve` stays a named subcommand
    return app


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_port_out_of_range_is_a_usage_error_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, port: str
) -> None:
    monkeypatch.setattr(serve, "run_server", lambda *a, **k: pytest.fail("the server was started (bind, load)"))
    result = CliRunner().invoke(_app(), ["serve", str(tmp_path), "--port", port])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: --port must be in 0..65535 (0: any free port), got {port}"


def test_the_library_refuses_the_same_ports_and_binds_the_edges() -> None:
    for port in (70000, -1):
        with pytest.raises(UsageError, match=rf"--port must be in 0\.\.65535 .*got {port}$"):
            server_module.bind_socket("127.0.0.1", port)
    with server_module.bind_socket("127.0.0.1", 0) as sock:
        assert 0 < sock.getsockname()[1] <= 65535
    server_module.check_port(65535)


@pytest.mark.slow  # a fresh interpreter imports the whole CLI (torch, transformers): seconds
def test_the_command_exits_2_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from glmquant.cli import main; main()", "serve", str(tmp_path), "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: --port must be in 0..65535 (0: any free port), got 70000"
    assert "serving" not in done.stdout
