"""`glmquant demo OUT`: the main job on the embedded tiny model, end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.cli.common import guarded, out
from glmquant.demo import run_demo


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


@guarded
def demo(
    out_dir: Annotated[Path, typer.Argument(help="working directory for the tiny source, observations and artifact")],
) -> None:
    """Build the tiny GLM-5.3-Flash-architecture model and run every stage on it."""
    result = run_demo(out_dir, out)
    out.print("[bold green]demo finished[/]")
    for line in result.summary_lines():
        out.print(line, highlight=False, soft_wrap=True)
