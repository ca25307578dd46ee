"""Writing tiny artifacts without the encoder: placeholder EXL3 tensors (random trellis, valid scales and
markers) for every expert slice, and a fixed provenance and timestamp so builds are reproducible."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from glmquant.arch import load_model_spec
from glmquant.checkpoint.artifact_writer import ArtifactResult, finalize_artifact, write_artifact_files
from glmquant.checkpoint.layouts import ArtifactPlan, PlannedFile, plan_artifact
from glmquant.checkpoint.provenance import CalibrationInfo, Provenance
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.tensor import EXL3Tensor

VERIFIED_AT = "2026-01-02T03:04:05Z"
PROVENANCE = Provenance(
    source_repo="glmquant/tiny-glm5-next",
    source_revision="0" * 40,
    source_manifest="SOURCE_MANIFEST.json",
    source_manifest_sha256="a" * 64,
    calibration=CalibrationInfo(
        manifest="cal.yaml",
        manifest_sha256="b" * 64,
        token_rows_sha256="c" * 64,
        verification_sha256="d" * 64,
        rows=8,
        cols=64,
    ),
)


def placeholder_experts(planned: PlannedFile) -> Mapping[str, torch.Tensor]:
    """Valid EXL3 parts for every expert slice and EXL3 retained linear or head of a planned file, seeded by the file
    name."""
    gen = torch.Generator().manual_seed(zlib.crc32(planned.path.encode()))
    codebook = Codebook(next((t.part for t in planned.tensors if t.part in ("mcg", "mul1")), "3inst"))
    out: dict[str, torch.Tensor] = {}
    for t in planned.tensors:
        if t.part != "trellis":
            continue
        i, o, _ = t.shape
        owner = t.expert or t.linear
        assert owner is not None
        x = EXL3Tensor(
            torch.randint(-32768, 32768, t.shape, generator=gen, dtype=torch.int32).to(torch.int16),
            torch.randn(i * 16, generator=gen).half(),
            torch.randn(o * 16, generator=gen).half(),
            codebook,
            owner.in_features,
            owner.out_features,
        )
        out.update(x.tensors(t.name[: -len(".trellis")]))
    return out


def build(source_dir: Path, out: Path, layout: str, **plan_args: Any) -> tuple[ArtifactPlan, ArtifactResult]:
    with SourceCheckpoint.open(source_dir) as source:
        spec = load_model_spec(source.config_path)
        plan = plan_artifact(spec, layout, source_shards=source.locations, **plan_args)
        write_artifact_files(plan, source, placeholder_experts, out)
        return plan, finalize_artifact(plan, source, out, PROVENANCE, verified_at=VERIFIED_AT)
