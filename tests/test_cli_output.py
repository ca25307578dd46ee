"""What a person reads at the end of a run: whole lines outside a terminal, hashes unbroken, the demo's summary."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from glmquant.checkpoint.provenance import build_timestamp
from glmquant.cli import app
from glmquant.demo import DEMO_EPOCH, DemoResult


@pytest.mark.slow
def test_output_outside_a_terminal_is_not_cut_at_80_columns(reference_config: Path) -> None:
    result = CliRunner().invoke(app, ["plan", str(reference_config)])
    assert result.exit_code == 0, result.output
    summary = [line for line in result.output.splitlines() if line.startswith("files: ")]
    assert len(summary) == 1 and "decode reads 18,7" in summary[0] and len(summary[0]) > 80


def test_demo_ends_with_a_readable_summary_and_a_reproducible_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert build_timestamp(DEMO_EPOCH) == "2026-01-01T00:00:00Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "0")
    assert build_timestamp(DEMO_EPOCH) == "1970-01-01T00:00:00Z"
    sha = "ab" * 32
    lines = DemoResult(Path("out/tiny/artifact"), sha, "2026-01-01T00:00:00Z", Path("out/tiny/artifact/sc.md"))
    text = "\n".join(lines.summary_lines())
    assert f"structural manifest SHA-256: {sha}" in text and "DemoResult(" not in text
    assert f"glmquant verify-manifest out/tiny/artifact --expect-sha256 {sha}" in text


def test_after_an_interrupted_command_a_second_ctrl_c_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`glmquant` exits 130 after Ctrl-C, and until the process is gone (threads finishing their step, as an
    encode's read-ahead) a second Ctrl-C leaves at once with os._exit(130), instead of raising inside the
    interpreter's shutdown (a traceback, then a crash)."""
    import signal

    import glmquant.cli as cli

    def interrupted() -> None:
        raise SystemExit(cli.INTERRUPTED)

    exits: list[int] = []
    monkeypatch.setattr(cli, "app", interrupted)
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as done:
            cli.main()
        assert done.value.code == 130 and signal.getsignal(signal.SIGINT) is cli._leave_now
        cli._leave_now(signal.SIGINT, None)  # the second Ctrl-C
        assert exits == [130]
    finally:
        signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(cli, "app", lambda: None)  # a command that finished leaves SIGINT alone
    cli.main()
    assert signal.getsignal(signal.SIGINT) is before
