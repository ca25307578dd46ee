"""Where an artifact came from: the inputs of a build that its files cannot tell by themselves.

Built once at the CLI edge and passed as one object to the config writer, the manifest and the model card.
Hashes are lowercase hex SHA-256; None where a build had no such input (e.g. an uncalibrated encode).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import glmquant
from glmquant.environment import source_date_epoch


@dataclass(frozen=True)
class CalibrationInfo:
    manifest: str | None = None  # file name of the calibration recipe/manifest
    manifest_sha256: str | None = None
    token_rows_sha256: str | None = None  # hash of the packed token rows actually used
    verification_sha256: str | None = None  # hash of the calibration verification record
    rows: int | None = None
    cols: int | None = None
    # "natural" (top-k routed tokens only), "all-token", "blend:<natural share>"; "+gate-weighted" when the natural
    # Hessians weight each routed token by its gate (observe --hessian-weighting gate)
    routing: str = "natural"


@dataclass(frozen=True)
class MethodInfo:
    claim: str = "EXL3 trellis quantization of routed experts; all other tensors retained byte-for-byte"
    upstream_repo: str = "https://github.com/turboderp-org/exllamav3"
    upstream_commit: str | None = None
    implementation: str = f"glmquant {glmquant.__version__}"
    out_scales: str = "auto"


@dataclass(frozen=True)
class Provenance:
    source_repo: str
    source_revision: str | None = None
    source_format: str = "safetensors-bf16"
    source_manifest: str | None = None
    source_manifest_sha256: str | None = None
    calibration: CalibrationInfo = field(default_factory=CalibrationInfo)
    method: MethodInfo = field(default_factory=MethodInfo)
    selection_sha256: str | None = None  # expert selection (REAP keep list), None when nothing was pruned
    tier_bitmap_sha256: str | None = None  # per-expert bit-width tiers, None for a single tier
    raw_private_content_included: bool = False
    cuda_graphs_required: bool = False
    runtime_status: str = "structural"  # what has been proven so far: structural, serve-checked, ...


def build_timestamp(default_epoch: int | None = None) -> str:
    """ISO-8601 UTC time of the build; SOURCE_DATE_EPOCH (else `default_epoch`, else now) pins it so rebuilds are
    byte-identical."""
    epoch = source_date_epoch()
    epoch = default_epoch if epoch is None else epoch
    moment = datetime.fromtimestamp(epoch, UTC) if epoch is not None else datetime.now(UTC)
    return moment.replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
