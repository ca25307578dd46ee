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


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_cuda_device_none_is_visible_is_refused_before_out_is_made(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "source").mkdir()
    result = CliRunner().invoke(
        app, ["observe", str(tmp_path / "source"), "--out", str(tmp_path / "obs"), "--device", "cuda"]
    )
    assert result.exit_code == 2 and "--device cuda: no CUDA device is visible here" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize(
    "out,message",
    [
        ("work/source", "holds the source"),
        ("work", "holds the source"),
        ("work/source/obs", "is inside the source"),
        ("work/source/sub/obs", "is inside the source"),
    ],
)
def test_out_apart_from_the_source(app: typer.Typer, tmp_path: Path, out: str, message: str) -> None:
    """Observations are never written into the source checkpoint (nor it into theirs), as encode refuses for its
    artifact: one usage line naming --out, and the source's files untouched."""
    source = tmp_path / "work" / "source"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text('{"model_type": "glm5_next"}\n')
    (source / "model.safetensors.index.json").write_text("{}\n")
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(app, ["observe", str(source), "--out", str(tmp_path / out)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--out {tmp_path / out} {message} {source}" in output, output
    assert "Traceback" not in output and _snapshot(tmp_path) == before
    assert sorted(p.name for p in source.iterdir()) == ["config.json", "model.safetensors.index.json", "sub"]
