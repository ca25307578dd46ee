"""`glmquant build SOURCE --observations OBS --out ARTIFACT`: observe and encode one layer at a time (fused)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.build import BuildConfig, build_artifact
from glmquant.cli.common import DeviceStreamsEvery, HessianWeightingOption, StreamBudgetGb, console, guarded, out
from glmquant.encode import EncodeConfig
from glmquant.encode.summary import summary_table
from glmquant.observe.config import DEFAULT_RECIPE, ObserveConfig
from glmquant.observe.hessians import HessianMode, HessianWeighting


def register(app: typer.Typer) -> None:
    app.command("build")(build)


@guarded
def build(
    source: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="BF16 source checkpoint directory")],
    observations: Annotated[Path, typer.Option(help="observations directory: statistics, token rows, resume state")],
    out_dir: Annotated[Path, typer.Option("--out", help="artifact directory to write")],
    recipe: Annotated[Path, typer.Option(help="calibration recipe (YAML)")] = DEFAULT_RECIPE,
    rows: Annotated[int | None, typer.Option(help="rows per lane (overrides the recipe)")] = None,
    tokens: Annotated[int | None, typer.Option(help="tokens per row (overrides the recipe)")] = None,
    hessians: Annotated[
        HessianMode, typer.Option(help="Hessians to observe; 'all' encodes with all-token Hessians, else natural ones")
    ] = HessianMode.NATURAL,
    hessian_weighting: HessianWeightingOption = HessianWeighting.TOKEN,
    keep: Annotated[int | None, typer.Option(help="also write OBS/prune_plan.json keeping N experts per layer")] = None,
    prune_plan: Annotated[Path | None, typer.Option(help="encode only the experts this prune_plan.json keeps")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda (observation and encoding)")] = "cpu",
    batch_rows: Annotated[int, typer.Option(help="calibration rows per forward step")] = 4,
    stream_budget_gb: StreamBudgetGb = None,
    device_streams_every: DeviceStreamsEvery = None,
    bits: Annotated[int, typer.Option(help="bits per routed-expert weight (K)")] = 2,
    tiers: Annotated[
        str | None,
        typer.Option(
            help="per-layer K by depth (depth:K3=4,K2=rest,K1=4) or named for each MoE layer (layers:K3,K2,...,K1), "
            "as encode --tiers; replaces --bits"
        ),
    ] = None,
    codebook: Annotated[str, typer.Option(help="mcg, mul1 or 3inst")] = "mcg",
    layout: Annotated[str, typer.Option(help="tr3 or exllamav3")] = "tr3",
    work_dir: Annotated[Path | None, typer.Option(help="resumable encode state (default: ARTIFACT.work)")] = None,
    seed: Annotated[int, typer.Option(help="base seed of the EXL3 sign flips")] = 0,
    source_repo: Annotated[str | None, typer.Option(help="source repo id recorded in the provenance")] = None,
    tuning_tokens: Annotated[
        int, typer.Option(help="calibration tokens kept per MoE layer for --tune-scales (as observe's)")
    ] = 0,
    tune_scales: Annotated[
        int,
        typer.Option(help="Adam steps tuning each unit's routed experts' stored scales on those tokens (as encode's)"),
    ] = 0,
) -> None:
    """Observe and encode layer by layer: the same artifact as observe + encode, without Hessians on disk."""
    config = BuildConfig(
        ObserveConfig(
            source,
            observations,
            recipe,
            rows,
            tokens,
            hessians,
            False,
            keep,
            device,
            batch_rows,
            stream_budget_gb,
            device_streams_every=device_streams_every,
            hessian_weighting=hessian_weighting,
            tuning_tokens=tuning_tokens,
        ),
        EncodeConfig(
            source=source,
            out=out_dir,
            observations=observations,
            bits=bits,
            tiers=tiers,  # type: ignore[arg-type]  # EncodeConfig parses option text
            codebook=codebook,
            layout=layout,
            hessians=HessianMode.ALL if hessians is HessianMode.ALL else HessianMode.NATURAL,
            prune_plan=prune_plan,
            device=device,
            work_dir=work_dir,
            seed=seed,
            source_repo=source_repo,
            tune_scales=tune_scales,
        ),
    )
    result = build_artifact(config, console, progress=True)
    out.print(summary_table(result.encode.layers))
    out.print(f"observations: {observations} (peak RSS {result.observation.peak_rss_bytes / 2**20:,.0f} MiB)")
    out.print(f"[bold]structural manifest SHA-256:[/] {result.encode.artifact.manifest_sha256}")
