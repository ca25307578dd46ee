"""The provenance record of a build: source structure hash, calibration hashes, method."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from glmquant.checkpoint.provenance import CalibrationInfo, Provenance
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.config import EncodeConfig
from glmquant.observe.summary import ObservationSummary

def source_manifest_sha256(source: SourceCheckpoint) -> str:
    """Hash of the source's structure (every tensor's name, dtype, shape and shard), from headers only."""
    rows = sorted([n, source.spec(n).dtype, list(source.spec(n).shape), source.shard_of(n)] for n in source.names())
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def build_provenance(cfg: EncodeConfig, source: SourceCheckpoint) -> Provenance:
    return Provenance(
        source_repo=cfg.source_repo or source.directory.name,
        source_manifest="model.safetensors.index.json",
        source_manifest_sha256=source_manifest_sha256(source),
        calibration=_calibration(cfg),
    )


def _calibration(cfg: EncodeConfig) -> CalibrationInfo:
    """Hashes of the recipe and of the token rows actually used (not of observations.json, which records
    timings and would make two identical observation runs look different)."""
    if cfg.observations is None:
        return CalibrationInfo(routing="none")
    summary = ObservationSummary.load(Path(cfg.observations))
    return CalibrationInfo(
        manifest=Path(summary.recipe).name, manifest_sha256=summary.recipe_sha256,
        token_rows_sha256=summary.token_rows_sha256, rows=sum(lane.rows for lane in summary.lanes),
        cols=max(lane.tokens for lane in summary.lanes), routing="natural" if cfg.hessians == "natural" else "all-token",
    )
