"""The `glmquant` command: one module per verb, each registering itself on the app."""

from __future__ import annotations

import os
import signal
import sys

import typer

from glmquant.cli import (
    build,
    demo,
    draft_head,
    encode,
    fixture,
    layer_costs,
    observe,
    plan,
    serve,
    serve_check,
    upload,
    verify_manifest,
)
from glmquant.cli.common import guarded
from glmquant.environment import check_environment

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Build and prove 2-bit EXL3 checkpoints of huge GLM mixture-of-experts models.",
)


@app.callback()
@guarded
def _environment() -> None:
    """Refuse a bad GLMQUANT_* or SOURCE_DATE_EPOCH value before any verb starts work."""
    check_environment()


for verb in (
    demo,
    fixture,
    plan,
    observe,
    layer_costs,
    encode,
    draft_head,
    build,
    verify_manifest,
    serve,
    serve_check,
    upload,
):
    verb.register(app)


def main() -> None:
    try:
        app()
    except SystemExit as done:
        if done.code == INTERRUPTED:  # threads may still finish their step (an encode's read-ahead) before exit
            signal.signal(signal.SIGINT, _leave_now)
        raise


INTERRUPTED = 130  # `guarded`'s exit code after Ctrl-C


def _leave_now(_signum: int, _frame: object) -> None:
    """A second Ctrl-C while the interrupted command's threads finish: leave at once, rather than raise inside the
    interpreter's shutdown (a traceback, then a crash). Every output is written atomically, and a rerun sweeps the
    temporary files a write in progress leaves."""
    sys.stderr.write("interrupted again: exiting now\n")
    os._exit(INTERRUPTED)
