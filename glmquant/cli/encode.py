"""`glmquant encode SOURCE --out ARTIFACT`: the full build, resumable, ending with verification."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from glmquant.checkpoint.hub import resolve_source
from glmquant.cli.common import HubRevision, console, guarded, out
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.summary import summary_table


def register(app: typer.Typer) -> None:
    app.command("encode")(encode)


@guarded
def encode(
    source: Annotated[str, typer.Argument(help="BF16 source checkpoint: a directory or a Hub repo id")],
    out_dir: Annotated[Path, typer.Option("--out", help="artifact directory to write")],
    observations: Annotated[Path | None, typer.Option(help="output directory of `glmquant observe`")] = None,
    uncalibrated: Annotated[bool, typer.Option(help="encode without observations (identity Hessians)")] = False,
    bits: Annotated[int, typer.Option(help="bits per routed-expert weight (K)")] = 2,
    tiers: Annotated[
        str | None,
        typer.Option(
            help="per-expert K by REAP saliency (reap:K3=32,K2=rest) or per layer, the first MoE layers first "
            "(depth:K3=4,K2=rest,K1=4), by routed share (share:K3=4,K2=rest,K1=4) or named for each MoE layer "
            "(layers:K4,K2,K1,...); replaces --bits; needs --observations"
        ),
    ] = None,
    tier_plan: Annotated[Path | None, typer.Option(help="explicit tier_plan.json (observe --tiers)")] = None,
    codebook: Annotated[str, typer.Option(help="mcg, mul1 or 3inst")] = "mcg",
    layout: Annotated[str, typer.Option(help="tr3 or exllamav3")] = "tr3",
    hessians: Annotated[str, typer.Option(help="natural or all")] = "natural",
    blend: Annotated[
        float | None,
        typer.Option(
            help="with --hessians natural: natural share S of S*natural + (1-S)*all-token (observe --hessians both)"
        ),
    ] = None,
    keep: Annotated[int | None, typer.Option(help="REAP-prune to N experts per layer")] = None,
    prune_plan: Annotated[Path | None, typer.Option(help="explicit prune_plan.json")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    work_dir: Annotated[Path | None, typer.Option(help="resumable job state (default: ARTIFACT.work)")] = None,
    seed: Annotated[int, typer.Option(help="base seed of the EXL3 sign flips")] = 0,
    experts_per_unit: Annotated[
        int, typer.Option(help="experts encoded together in one work unit (GPU batch)")
    ] = EncodeConfig.experts_per_unit,
    source_repo: Annotated[
        str | None,
        typer.Option(help="source repo id recorded in the provenance (default: the Hub repo id given as SOURCE)"),
    ] = None,
    retained_bits: Annotated[
        int | None,
        typer.Option(
            help="speed tier: EXL3-encode the retained linears (attention, shared experts, dense MLPs) at this K "
            "(4..6 advised) with their dense Hessians (observe --dense-hessians); norms, routers, embeddings, F32 "
            "tensors and the MTP layer stay exact, lm_head unless --head-bits"
        ),
    ] = None,
    retained_exact_layers: Annotated[
        int,
        typer.Option(
            help="with --retained-bits: keep the retained linears of the first N decoder layers exact (where the "
            "speed tier costs most KL)"
        ),
    ] = 0,
    retained_layer_bits: Annotated[
        str | None,
        typer.Option(
            help="speed tier, K by decoder layer instead of --retained-bits and --retained-exact-layers: one entry "
            "per layer, the first first (K6,K6,K3,exact,...), WxN for N layers in a row (K5x11,K3x7,K2x27)"
        ),
    ] = None,
    head_bits: Annotated[
        int | None,
        typer.Option(
            help="EXL3-encode lm_head at this K (2..8; ExLlamaV3's converter defaults to 6) with the Hessian of its "
            "input (observe --dense-hessians); with or without --retained-bits; refused for tied embeddings"
        ),
    ] = None,
    retained_uncalibrated_fallback: Annotated[
        bool,
        typer.Option(
            help="with --retained-bits, --retained-layer-bits or --head-bits: encode a linear that has no dense "
            "Hessian uncalibrated"
        ),
    ] = False,
    tune_scales: Annotated[
        int,
        typer.Option(
            help="tune the stored scales of each unit's routed experts together on their share of the sampled "
            "calibration tokens' MoE output (observe --tuning-tokens) for this many Adam steps (the recipe: 50), the "
            "codes fixed; 0: the encoder's own scales"
        ),
    ] = 0,
    revision: HubRevision = None,
) -> None:
    """EXL3-encode the routed experts (and with --retained-bits / --head-bits the retained linears / lm_head), copy
    everything else byte-for-byte, write and verify the artifact.

    On N GPUs: torchrun --nproc-per-node N -m glmquant encode ... --device cuda (shared storage for --out).
    """
    # options checked before a Hub source is fetched
    cfg = EncodeConfig(
        source=Path(source),
        out=out_dir,
        observations=observations,
        uncalibrated=uncalibrated,
        bits=bits,
        codebook=codebook,
        layout=layout,
        hessians=hessians,  # type: ignore[arg-type]  # EncodeConfig parses the text; a bad value is a UsageError
        blend=blend,
        keep=keep,
        prune_plan=prune_plan,
        tiers=tiers,  # type: ignore[arg-type]  # parsed by EncodeConfig too
        tier_plan=tier_plan,
        device=device,
        work_dir=work_dir,
        seed=seed,
        source_repo=source_repo,
        experts_per_unit=experts_per_unit,
        retained_bits=retained_bits,
        retained_exact_layers=retained_exact_layers,
        retained_layer_bits=retained_layer_bits,  # type: ignore[arg-type]  # parsed by EncodeConfig
        head_bits=head_bits,
        retained_fallback_identity=retained_uncalibrated_fallback,
        tune_scales=tune_scales,
    )
    resolved = resolve_source(source, revision)
    cfg = replace(
        cfg, source=resolved.path, source_repo=source_repo or resolved.repo_id, source_revision=resolved.revision
    )
    result = encode_artifact(cfg, console)
    if result is None:  # a rank other than 0 of a torchrun job: rank 0 writes and reports the artifact
        return
    out.print(summary_table(result.layers))
    out.print(f"summary: {result.summary_path}")
    out.print(f"[bold]structural manifest SHA-256:[/] {result.artifact.manifest_sha256}")
