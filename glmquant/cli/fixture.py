"""`glmquant fixture OUT`: the embedded tiny source checkpoint, or with `--layers N` a synthetic one at a real
config's widths (the reference GLM-5.3-Flash config unless --config says otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from glmquant.cli.common import guarded, out
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.fixtures.synthetic import (
    DEFAULT_SHARD_BYTES,
    REFERENCE_CONFIG,
    SyntheticOptions,
    build_synthetic_checkpoint,
    synthetic_layout,
)


def register(app: typer.Typer) -> None:
    app.command("fixture")(fixture)


@guarded
def fixture(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the BF16 checkpoint into")],
    seed: Annotated[int, typer.Option(help="random seed of the weights")] = 0,
    experts: Annotated[
        int | None,
        typer.Option(
            help=f"routed experts per MoE layer (tiny: {TinyModelConfig.n_routed_experts}; with --layers: the config's)"
        ),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option(
            help="build a real-width checkpoint of the first N decoder layers of --config (plus its MTP layer)"
        ),
    ] = None,
    config: Annotated[
        Path, typer.Option(help="with --layers: the config.json to take widths and layer kinds from")
    ] = REFERENCE_CONFIG,
    device: Annotated[str, typer.Option(help="with --layers: where the weights are generated (cpu or cuda)")] = "cpu",
    shard_gb: Annotated[float, typer.Option(help="with --layers: shard size cap in GiB")] = DEFAULT_SHARD_BYTES
    / 1024**3,
    dry_run: Annotated[bool, typer.Option(help="with --layers: list the shards, write nothing")] = False,
) -> None:
    """Build a deterministic source checkpoint (same options, same bytes); rerun to finish an interrupted one."""
    if layers is None:
        tiny = TinyModelConfig(n_routed_experts=experts or TinyModelConfig.n_routed_experts)
        path = build_tiny_checkpoint(out_dir, tiny, seed)
        out.print(f"tiny checkpoint written to {path}")
        return
    options = SyntheticOptions(layers, config, experts, seed, device, int(shard_gb * 1024**3))
    layout = synthetic_layout(options)
    if dry_run:
        table = Table(
            title=f"{out_dir}: {layout.spec.num_hidden_layers} layers + MTP, "
            f"{layout.spec.n_routed_experts} experts per MoE layer"
        )
        for column in ("shard", "tensors", "bytes"):
            table.add_column(column, justify="left" if column == "shard" else "right")
        for shard in layout.shards:
            table.add_row(shard.name, f"{len(shard.tensors):,}", f"{shard.size:,}")
        out.print(table)
        out.print(f"total {sum(s.size for s in layout.shards):,} bytes in {len(layout.shards)} shards")
        return
    path = build_synthetic_checkpoint(out_dir, options, progress=True)
    out.print(f"synthetic checkpoint ({layout.tensor_bytes / 1e9:,.2f} GB of tensors) written to {path}")
