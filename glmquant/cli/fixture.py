"""`glmquant fixture OUT`: the embedded tiny source checkpoint, or with `--layers N` a synthetic one at a real
config's widths (the reference GLM-5.3-Flash config unless --config says otherwise)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from glmquant.arch import ModelSpec, load_model_spec, read_config
from glmquant.cli.common import guarded, out
from glmquant.errors import UsageError
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.fixtures.synthetic import (
    CLAIM_FILE,
    DEFAULT_SHARD_BYTES,
    REFERENCE_CONFIG,
    SyntheticOptions,
    build_synthetic_checkpoint,
    claim_text,
    synthetic_layout,
)
from glmquant.fixtures.tiny import MARKER_FILE, fixture_marker


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
    """Build a deterministic source checkpoint (same options, same bytes); rerun to finish an interrupted one.

    OUT must be empty or new, or hold a checkpoint of this command with the same options (rebuilt, byte-identical)."""
    if experts is not None and experts < 1:
        raise UsageError(f"--experts must be a positive integer, got {experts}")
    if layers is None:
        _refuse_synthetic_only(config, device, shard_gb, dry_run)
        tiny = TinyModelConfig() if experts is None else TinyModelConfig(n_routed_experts=experts)
        if experts is not None:
            _check_router(_tiny_router(tiny), experts)
        marker = fixture_marker(tiny, seed)
        _check_out(out_dir, MARKER_FILE, marker)
        path = build_tiny_checkpoint(out_dir, tiny, seed)
        out.print(f"tiny checkpoint written to {path}")
        return
    if experts is not None:
        _check_router(load_model_spec(read_config(config)), experts)
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
    _check_out(out_dir, CLAIM_FILE, claim_text(options))
    path = build_synthetic_checkpoint(out_dir, options, progress=True)
    out.print(f"synthetic checkpoint ({layout.tensor_bytes / 1e9:,.2f} GB of tensors) written to {path}")


def _refuse_synthetic_only(config: Path, device: str, shard_gb: float, dry_run: bool) -> None:
    """The options that shape only a synthetic checkpoint, given without --layers, are refused instead of ignored
    (the tiny checkpoint is built on the CPU, in its own shards, and --dry-run would otherwise write it)."""
    given = [
        name
        for name, value, default in (
            ("--config", config, REFERENCE_CONFIG),
            ("--device", device, "cpu"),
            ("--shard-gb", shard_gb, DEFAULT_SHARD_BYTES / 1024**3),
            ("--dry-run", dry_run, False),
        )
        if value != default
    ]
    if given:
        raise UsageError(f"{', '.join(given)}: only with --layers N (a synthetic checkpoint); the tiny one takes none")


def _tiny_router(tiny: TinyModelConfig) -> ModelSpec:
    """The routing of a tiny checkpoint's config, without building it: its spec, with the special-token ids (which
    do not shape it) zero and at least top-k experts (the count the check is of; fewer fail the spec itself)."""
    text = tiny.text_config(defaultdict(int))
    text["n_routed_experts"] = max(tiny.n_routed_experts, tiny.num_experts_per_tok)
    return load_model_spec(
        {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text}
    )


def _check_router(spec: ModelSpec, experts: int) -> None:
    """--experts at least what the router routes over: the rule of a pruned layer (`observe.prune.check_keep`,
    `ModelSpec.min_kept_experts`), as fewer leave `observe` a config whose top-k exceeds its experts."""
    if experts < spec.min_kept_experts:
        raise UsageError(
            f"--experts {experts}: the router needs at least {spec.min_kept_experts} routed experts per MoE layer "
            f"(top-{spec.num_experts_per_tok} of {spec.n_group} group(s), each group scored by its two best experts)"
        )


def _check_out(out_dir: Path, marker: str, text: str) -> None:
    """OUT is new, empty, or a checkpoint this command wrote with the same options, recognised by the marker file
    every build writes first (`marker`, whose `text` records the options): rewriting that one is harmless (same
    bytes) and finishes an interrupted build; anything else (an artifact, observations, a fixture of another --seed
    or size) would be overwritten file by file, so it is refused before anything is written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"OUT {out_dir} is a file; give a directory for the checkpoint")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    claimed = out_dir / marker
    if claimed.is_file() and claimed.read_text() == text:
        return
    what = (
        f"holds a fixture built with other options (its {marker} differs)"
        if claimed.is_file()
        else f"is not empty and holds no fixture of these options (no {marker})"
    )
    raise UsageError(f"OUT {out_dir} {what}; give an empty or new directory, or delete it")
