"""What every CLI verb shares: one console, option aliases, and one formatter for expected failures."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from glmquant.errors import GlmquantError
from glmquant.observe.hessians import HessianWeighting

UNWRAPPED_WIDTH = 100_000  # outside a terminal: lines as long as they are


def _console(stderr: bool = False) -> Console:
    """A terminal keeps its width; logs, CI and pipes get whole lines (rich would cut them at 80 columns)."""
    made = Console(stderr=stderr)
    if not made.is_terminal:
        made.width = UNWRAPPED_WIDTH
    return made


console = _console(stderr=True)
out = _console()

P = ParamSpec("P")
R = TypeVar("R")

ExistingPath = Annotated[Path, typer.Argument(exists=True, help="an existing file or directory")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print machine-readable JSON instead of tables")]
StreamBudgetGb = Annotated[
    float | None,
    typer.Option(help="most disk (GB) the hidden streams between layers may take; chunks past it are recomputed"),
]
DeviceStreamsEvery = Annotated[
    int | None,
    typer.Option(
        help="hold the hidden streams on the device (one layer's worth plus a chunk) instead of disk files, "
        "writing them to disk every N layers where it has room (0: never); a killed run recomputes them from the "
        "newest such checkpoint, else from the embeddings"
    ),
]
HessianWeightingOption = Annotated[
    HessianWeighting,
    typer.Option(
        help="natural Hessians: each routed token counted once (token), or weighted by its routing weight over its "
        "token's mean (gate: the weight of its error in the layer's output)"
    ),
]
HubRevision = Annotated[
    str | None,
    typer.Option(
        help="with a Hub repo id: branch, tag or commit (default main); files come through the Hugging Face cache"
    ),
]


def print_json(data: Any) -> None:
    """JSON on stdout as plain text: rich's highlighter takes minutes on a plan's 583,090 tensor entries."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def guarded(fn: Callable[P, R]) -> Callable[P, R]:
    """Print a GlmquantError as one red line and exit with its code (1: the input fails, 2: usage)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except GlmquantError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:  # a path the checks did not foresee (a file where a directory goes, a read-only disk)
            where = f"{exc.filename}: " if exc.filename else ""
            console.print(f"[bold red]error:[/] {escape(where + (exc.strerror or str(exc)))}", highlight=False)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: nothing half-written was left behind; rerun to resume")
            raise typer.Exit(130) from None

    return wrapper
