"""`glmquant fixture OUT`: write the embedded tiny GLM-5.3-Flash-architecture source checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.cli.common import guarded, out
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint


def register(app: typer.Typer) -> None:
    app.command("fixture")(fixture)


@guarded
def fixture(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the tiny BF16 checkpoint into")],
    seed: Annotated[int, typer.Option(help="random seed of the weights")] = 0,
    experts: Annotated[int, typer.Option(help="routed experts per MoE layer")] = TinyModelConfig.n_routed_experts,
) -> None:
    """Build the deterministic tiny source checkpoint (same seed, same bytes)."""
    path = build_tiny_checkpoint(out_dir, TinyModelConfig(n_routed_experts=experts), seed)
    out.print(f"tiny checkpoint written to {path}")
