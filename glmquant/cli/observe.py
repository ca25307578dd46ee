"""`glmquant observe SOURCE --out OBS`: layer-streamed calibration, REAP statistics, expert Hessians."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.checkpoint.hub import resolve_source
from glmquant.cli.common import DeviceStreamsEvery, HessianWeightingOption, HubRevision, StreamBudgetGb, guarded, out
from glmquant.observe.config import DEFAULT_RECIPE, ObserveConfig
from glmquant.observe.hessians import HessianMode, HessianWeighting
from glmquant.observe.report import build_report, expert_table, layer_table
from glmquant.observe.run import observe as run_observe


def register(app: typer.Typer) -> None:
    app.command("observe")(observe)


@guarded
def observe(
    source: Annotated[str, typer.Argument(help="BF16 source checkpoint: a directory or a Hub repo id")],
    out_dir: Annotated[Path, typer.Option("--out", help="observations directory (rerun to resume)")],
    recipe: Annotated[Path, typer.Option(help="calibration recipe (YAML)")] = DEFAULT_RECIPE,
    rows: Annotated[int | None, typer.Option(help="rows per lane (overrides the recipe)")] = None,
    tokens: Annotated[int | None, typer.Option(help="tokens per row (overrides the recipe)")] = None,
    hessians: Annotated[HessianMode, typer.Option(help="routed-expert Hessian coverage")] = HessianMode.NATURAL,
    dense_hessians: Annotated[
        bool, typer.Option(help="also capture attention/shared-expert/dense and lm_head Hessians")
    ] = False,
    hessian_weighting: HessianWeightingOption = HessianWeighting.TOKEN,
    keep: Annotated[int | None, typer.Option(help="write prune_plan.json keeping N experts per layer")] = None,
    tiers: Annotated[
        str | None,
        typer.Option(
            help="write tier_plan.json: per-expert K by REAP saliency (reap:K3=32,K2=rest, of the kept experts) or per "
            "layer, the first MoE layers first (depth:K3=4,K2=rest,K1=4), by routed share (share:K3=4,K2=rest,K1=4) "
            "or named for each MoE layer (layers:K4,K2,K1,...)"
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    batch_rows: Annotated[int, typer.Option(help="calibration rows per forward step")] = 4,
    stream_budget_gb: StreamBudgetGb = None,
    device_streams_every: DeviceStreamsEvery = None,
    report: Annotated[bool, typer.Option(help="print per-layer tables and write the REAP heat map")] = False,
    report_layer: Annotated[list[int] | None, typer.Option(help="with --report: every expert of this layer")] = None,
    revision: HubRevision = None,
    tuning_tokens: Annotated[
        int,
        typer.Option(help="keep this many calibration tokens per MoE layer for `encode --tune-scales` (0: none)"),
    ] = 0,
) -> None:
    """Stream calibration rows through the model layer by layer; save REAP statistics and Hessians."""
    resolved = resolve_source(source, revision)
    if resolved.repo_id is not None:
        out.print(f"source {resolved.repo_id} at commit {resolved.revision} ({resolved.path})")
    config = ObserveConfig(
        resolved.path,
        out_dir,
        recipe,
        rows,
        tokens,
        hessians,
        dense_hessians,
        keep,
        device,
        batch_rows,
        stream_budget_gb,
        tiers,  # type: ignore[arg-type]  # ObserveConfig parses the text; a bad value is a UsageError
        device_streams_every,
        hessian_weighting,
        tuning_tokens,
    )
    summary = run_observe(config, progress=True)
    out.print(
        f"observed {len(summary.layers)} layers ({len(summary.moe_layers())} MoE) into {out_dir}; "
        f"token rows {summary.token_rows_sha256[:16]}…, peak RSS {summary.peak_rss_bytes / 2**20:,.0f} MiB"
    )
    if summary.prune_plan:
        out.print(f"prune plan: {out_dir / summary.prune_plan}")
    if summary.tier_plan:
        out.print(f"tier plan: {out_dir / summary.tier_plan}")
    if report:
        result = build_report(out_dir)
        out.print(layer_table(result))
        for layer in report_layer or []:
            out.print(expert_table(result, layer))
        if result.heatmap:
            out.print(f"heat map: {result.heatmap}")
