"""Write an artifact from a plan: weight files one at a time, then index, configs, small files, manifest, card.

Retained tensors are copied byte-for-byte from the source (row ranges of the router when experts were
pruned), never decoded. EXL3 parts come from the caller one planned file at a time, so the encoder can
stream a layer's expert files as soon as they are encoded. Every file is written atomically and checked
against the plan's predicted size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from glmquant.arch import read_config
from glmquant.checkpoint.artifact_config import (
    config_text,
    copy_small_files,
    output_config,
    quantization_block,
    quantization_config_file,
)
from glmquant.checkpoint.index import INDEX_NAME, SafetensorsIndex, write_index
from glmquant.checkpoint.layouts import ArtifactPlan, OutputTensor, PlannedFile
from glmquant.checkpoint.manifest import MANIFEST_NAME, build_manifest, with_metadata_files, write_manifest
from glmquant.checkpoint.model_card import MODEL_CARD_NAME, write_model_card
from glmquant.checkpoint.provenance import Provenance, build_timestamp
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.verify import verify_artifact
from glmquant.checkpoint.writer import Provided, atomic_write_text, write_safetensors
from glmquant.errors import CheckpointFormatError

ExpertTensors = Callable[[PlannedFile], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class ArtifactResult:
    directory: Path
    manifest_sha256: str
    weight_files: int
    physical_bytes: int


def has_expert_parts(planned: PlannedFile) -> bool:
    return any(t.expert is not None for t in planned.tensors)


def has_retained_linears(planned: PlannedFile) -> bool:
    """Whether the file holds retained linears stored as EXL3 (`--retained-bits`), which the encoder supplies."""
    return any(t.linear is not None for t in planned.tensors)


def write_planned_file(
    planned: PlannedFile,
    source: SourceCheckpoint,
    out_dir: str | Path,
    expert_tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write one planned file: retained tensors streamed from `source`, EXL3 parts from `expert_tensors`."""
    path = Path(out_dir) / planned.path
    by_name = {t.name: t for t in planned.tensors}

    def provide(spec: TensorSpec) -> Provided:
        t = by_name[spec.name]
        if t.source is not None:
            return _retained_bytes(source, t)
        if expert_tensors is None or t.name not in expert_tensors:
            raise CheckpointFormatError(f"{path}: no encoded tensor provided for {t.name}")
        return expert_tensors[t.name]

    size = write_safetensors(path, [t.spec for t in planned.tensors], provide)
    if size != planned.size:
        raise CheckpointFormatError(f"{path}: wrote {size} bytes but the plan predicted {planned.size}")
    return path


def _retained_bytes(source: SourceCheckpoint, t: OutputTensor) -> Provided:
    """A streamer copying the source tensor's stored bytes (only the kept rows when the plan pruned it); a NaN or Inf
    in them stops the copy, naming the source file and tensor (the artifact must not carry it on, silently)."""
    name, rows = t.source_name, t.rows
    if name not in source:
        raise CheckpointFormatError(f"{source.directory}: retained tensor {name} is not in the source checkpoint")
    src = source.spec(name)
    if src.dtype != t.dtype or src.shape[1:] != t.shape[1:] or (rows is None and src.shape != t.shape):
        raise CheckpointFormatError(
            f"source tensor {name} is {src.dtype} {list(src.shape)}, the plan expects {t.dtype} {list(t.shape)}"
        )
    if rows is None:
        return lambda f: source.copy_raw_into(name, f, finite=True)
    row_bytes = src.nbytes // src.shape[0]
    return lambda f: sum(source.copy_raw_into(name, f, r * row_bytes, row_bytes, finite=True) for r in rows)


def write_retained_shards(
    plan: ArtifactPlan, source: SourceCheckpoint, out_dir: str | Path, linears: ExpertTensors | None = None
) -> list[Path]:
    """Every planned file without routed-expert parts (the tr3 retained shards): byte copies from the source, plus
    the EXL3 parts of retained linears (`--retained-bits`), which `linears(file)` supplies by output name."""
    return _write_files([f for f in plan.files if not has_expert_parts(f)], source, out_dir, linears)


def write_artifact_files(
    plan: ArtifactPlan,
    source: SourceCheckpoint,
    expert_tensors: ExpertTensors,
    out_dir: str | Path,
) -> list[Path]:
    """Every weight file of the plan; `expert_tensors(file)` supplies that file's EXL3 parts by output name."""
    return _write_files(list(plan.files), source, out_dir, expert_tensors)


def _write_files(
    files: list[PlannedFile], source: SourceCheckpoint, out_dir: str | Path, expert_tensors: ExpertTensors | None
) -> list[Path]:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    written = []
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("writing weight files", total=sum(f.size for f in files))
        for f in files:
            needs = has_expert_parts(f) or has_retained_linears(f)
            parts = expert_tensors(f) if expert_tensors is not None and needs else None
            written.append(write_planned_file(f, source, out_dir, parts))
            bar.advance(task, f.size)
    return written


def finalize_artifact(
    plan: ArtifactPlan,
    source: SourceCheckpoint,
    out_dir: str | Path,
    provenance: Provenance,
    verified_at: str | None = None,
) -> ArtifactResult:
    """After the weight files: index, config.json, quantization_config.json, small files, model card, manifest
    (which lists every one of them).

        The manifest is kept only if the artifact passes structural verification against it (headers, index,
        EXL3 shapes, config), so an artifact with a manifest is one that verified.
    """
    root = Path(out_dir)
    weight_map = {t.name: f.path for f in plan.files for t in f.tensors}
    write_index(root / INDEX_NAME, SafetensorsIndex(weight_map, sum(f.tensor_bytes for f in plan.files)))
    block = quantization_block(plan, provenance)
    config = output_config(read_config(source.config_path), plan, block)
    atomic_write_text(root / "config.json", config_text(config, plan.layout))
    specs = [t.spec for f in plan.files for t in f.tensors]
    atomic_write_text(
        root / "quantization_config.json", config_text(quantization_config_file(block, plan.layout, specs), plan.layout)
    )
    small = copy_small_files(source.directory, root)
    metadata = sorted({"config.json", "quantization_config.json", INDEX_NAME, *small})
    manifest = build_manifest(plan, root, provenance, verified_at or build_timestamp(), metadata)
    write_model_card(root, manifest)
    manifest = with_metadata_files(manifest, root, [MODEL_CARD_NAME])
    sha = write_manifest(root, manifest)
    try:
        report = verify_artifact(root, expect_sha256=sha, fast=True, show_progress=False)
        if not report.ok:
            raise CheckpointFormatError(f"{root}: artifact failed structural verification: {report.failure_summary()}")
    except BaseException:  # killed or failed mid-check: no manifest may claim a verification that did not finish
        (root / MANIFEST_NAME).unlink(missing_ok=True)
        raise
    return ArtifactResult(root, sha, len(plan.files), manifest["physical_tensor_bytes"])
