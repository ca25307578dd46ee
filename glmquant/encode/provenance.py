"""The provenance record of a build: source structure hash, calibration hashes, method."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from glmquant.checkpoint.provenance import CalibrationInfo, MethodInfo, Provenance
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.tiers import tier_bitmap_sha256
from glmquant.encode.config import EncodeConfig
from glmquant.encode.scale_tuning import LEARNING_RATE
from glmquant.observe.summary import ObservationSummary


def source_manifest_sha256(source: SourceCheckpoint) -> str:
    """Hash of the source's structure (every tensor's name, dtype, shape and shard), from headers only."""
    rows = sorted([n, source.spec(n).dtype, list(source.spec(n).shape), source.shard_of(n)] for n in source.names())
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def selection_sha256(keep: Mapping[int, Sequence[int]] | None) -> str | None:
    """Hash of the kept experts per MoE layer (in output order); None when nothing was pruned."""
    if keep is None:
        return None
    rows = {str(layer): list(experts) for layer, experts in sorted(keep.items())}
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def build_provenance(
    cfg: EncodeConfig,
    source: SourceCheckpoint,
    keep: Mapping[int, Sequence[int]] | None,
    calibration: CalibrationInfo,
    tiers: Mapping[int, Sequence[int]] | None = None,
) -> Provenance:
    return Provenance(
        source_repo=cfg.source_repo or source.directory.name,
        source_revision=cfg.source_revision,
        source_manifest="model.safetensors.index.json",
        source_manifest_sha256=source_manifest_sha256(source),
        calibration=calibration,
        method=method_info(cfg),
        selection_sha256=selection_sha256(keep),
        tier_bitmap_sha256=tier_bitmap_sha256(tiers) if tiers else None,
    )


def method_info(cfg: EncodeConfig) -> MethodInfo:
    """The method the manifest states; `--tune-scales` is named in its claim."""
    if not cfg.tune_scales:
        return MethodInfo()
    return MethodInfo(
        claim=(
            "EXL3 trellis quantization of routed experts, the stored scales of each unit's experts then tuned together "
            f"on their share of the sampled calibration tokens' MoE output ({cfg.tune_scales} Adam steps at lr "
            f"{LEARNING_RATE:g}, codes fixed); all other tensors retained byte-for-byte"
        )
    )


def job_inputs(
    cfg: EncodeConfig,
    source: SourceCheckpoint,
    keep: Mapping[int, Sequence[int]] | None,
    calibration: CalibrationInfo,
    tiers: Mapping[int, Sequence[int]] | None = None,
) -> dict[str, str | None]:
    """Content hashes of what an encode reads, for its resume fingerprint (the tiers only when there are some, so
    the fingerprints of one-K jobs stay as they were; the routing only when gate-weighted, likewise)."""
    inputs = {
        "source": source_manifest_sha256(source),
        "token_rows": calibration.token_rows_sha256,
        "recipe": calibration.manifest_sha256,
        "selection": selection_sha256(keep),
    }
    if calibration.routing.endswith("-weighted"):  # other Hessians from the same rows (unweighted: as before)
        inputs["routing"] = calibration.routing
    return {**inputs, "tiers": tier_bitmap_sha256(tiers)} if tiers else inputs


def observed_calibration(cfg: EncodeConfig) -> CalibrationInfo:
    """The calibration of a finished observation (observations.json), none for an uncalibrated encode."""
    if cfg.observations is None:
        return CalibrationInfo(routing="none")
    summary = ObservationSummary.load(Path(cfg.observations))
    return calibration_info(
        summary.recipe,
        summary.recipe_sha256,
        summary.token_rows_sha256,
        [(lane.rows, lane.tokens) for lane in summary.lanes],
        hessian_routing(cfg),
        summary.hessian_weighting,
    )


def hessian_routing(cfg: EncodeConfig) -> str:
    """The Hessians' coverage as the provenance states it: natural, all, or blend:<natural share>."""
    return cfg.hessians.value if cfg.blend is None else f"blend:{cfg.blend:g}"


def calibration_info(
    recipe: str,
    recipe_sha256: str,
    token_rows_sha256: str,
    lanes: Sequence[tuple[int, ...]],
    hessians: str,
    weighting: str = "token",
) -> CalibrationInfo:
    """Hashes of the recipe and of the token rows actually used (not of observations.json, which records
    timings and would make two identical observation runs look different); `lanes` as (rows, tokens).
    Gate-weighted natural Hessians (`weighting` "gate") add "+gate-weighted" to the routing the manifest states."""
    routing = "natural" if hessians == "natural" else "all-token" if hessians == "all" else hessians
    if weighting != "token" and hessians != "all":  # all-token Hessians are never weighted
        routing += f"+{weighting}-weighted"
    return CalibrationInfo(
        manifest=Path(recipe).name,
        manifest_sha256=recipe_sha256,
        token_rows_sha256=token_rows_sha256,
        rows=sum(rows for rows, _ in lanes),
        cols=max(tokens for _, tokens in lanes),
        routing=routing,
    )
