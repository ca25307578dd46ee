"""`glmquant observe`: options map to exactly one ObserveConfig; bad options are usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from glmquant.cli import observe as cli
from glmquant.observe.config import DEFAULT_RECIPE, ObserveConfig
from glmquant.observe.hessians import HessianMode
from glmquant.observe.summary import ObservationSummary


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    cli.register(app)
    app.command("other")(lambda: None)  # a second verb, so typer keeps the command name
    return app


def test_options_become_one_config(
    app: typer.Typer, observed: Path, tiny_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[ObserveConfig] = []

    def run_observe(config: ObserveConfig, progress: bool) -> ObservationSummary:
        seen.append(config)
        return _summary(observed)

    monkeypatch.setattr(cli, "run_observe", run_observe)
    result = CliRunner().invoke(
        app,
        [
            "observe",
            str(tiny_source),
            "--out",
            str(observed),
            "--rows",
            "8",
            "--tokens",
            "64",
            "--hessians",
            "all",
            "--dense-hessians",
            "--keep",
            "3",
            "--batch-rows",
            "2",
            "--report",
            "--report-layer",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen == [ObserveConfig(tiny_source, observed, DEFAULT_RECIPE, 8, 64, HessianMode.ALL, True, 3, "cpu", 2)]
    assert "REAP statistics" in result.output and "layer 2 experts" in result.output


def _summary(observed: Path) -> ObservationSummary:
    return ObservationSummary.load(observed)


def test_bad_options_exit_2(app: typer.Typer, tiny_source: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["observe", str(tiny_source), "--out", str(tmp_path), "--hessians", "some"])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["observe", str(tiny_source), "--out", str(tmp_path), "--batch-rows", "0"])
    assert result.exit_code == 2 and "--batch-rows must be a positive integer" in result.output
