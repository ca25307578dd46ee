"""The `glmquant` command: one module per verb, each registering itself on the app."""

from __future__ import annotations

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
    app()
