"""`encode_artifact`: BF16 source + observations -> a verified EXL3 artifact, one MoE layer at a time, resumable."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from glmquant.arch import classify, load_model_spec
from glmquant.checkpoint.artifact_writer import (
    ArtifactResult, finalize_artifact, has_expert_parts, write_planned_file, write_retained_shards,
)
from glmquant.checkpoint.layouts import ArtifactPlan, PlannedFile, plan_artifact
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import VerifyReport, verify_artifact
from glmquant.checkpoint.writer import atomic_write_text, remove_temp_files
from glmquant.encode.config import EncodeConfig
from glmquant.encode.hessians import HessianSource
from glmquant.encode.layer import encode_layer, layer_slices
from glmquant.encode.provenance import build_provenance, job_inputs
from glmquant.encode.pruning import resolve_keep
from glmquant.encode.state import EncodeState
from glmquant.encode.summary import LayerSummary, fallback_warnings, summarize_layer
from glmquant.errors import CheckpointFormatError, NumericalError

SUMMARY_NAME = "encode-summary.json"


@dataclass(frozen=True)
class EncodeResult:
    artifact: ArtifactResult
    layers: list[LayerSummary]
    summary_path: Path
    verification: VerifyReport | None  # the full verification (every file hashed) when cfg.verify


def encode_artifact(cfg: EncodeConfig, console: Console) -> EncodeResult:
    with SourceCheckpoint.open(cfg.source) as source:
        spec = load_model_spec(source.config_path)
        classify(spec, source.names())
        keep = resolve_keep(cfg, spec)
        plan = plan_artifact(spec, cfg.layout, cfg.bits, cfg.codebook,
                             {n: source.shard_of(n) for n in source.names()}, keep)
        state = EncodeState.load_or_new(cfg.state_dir, cfg.fingerprint(job_inputs(cfg, source, keep)))
        cfg.out.mkdir(parents=True, exist_ok=True)
        if cfg.uncalibrated:
            console.print("[yellow]warning:[/] --uncalibrated: every tensor is encoded without calibration "
                          "(identity Hessians)", highlight=False)
        for directory in (cfg.out, cfg.state_dir):  # what a killed run was writing (kill -9 runs no cleanup)
            remove_temp_files(directory)
        _encode_layers(cfg, plan, source, state, console)
        if not state.retained_done or not _files_present(cfg.out, _retained_files(plan)):
            console.print("copying retained tensors byte-for-byte")
            write_retained_shards(plan, source, cfg.out)
            state.finish_retained()
        result = finalize_artifact(plan, source, cfg.out, build_provenance(cfg, source, keep), cfg.verified_at)
    report = None
    if cfg.verify:
        report = verify_artifact(cfg.out, expect_sha256=result.manifest_sha256, fast=False)
        if not report.ok:
            raise CheckpointFormatError(f"{cfg.out}: verification failed: {report.failure_summary()}")
    layers = [LayerSummary(**state.layers[str(layer)]) for layer in spec.moe_layers]
    summary_path = cfg.state_dir / SUMMARY_NAME
    atomic_write_text(summary_path, json.dumps({"manifest_sha256": result.manifest_sha256,
                                                "layers": [l.__dict__ for l in layers]}, indent=2) + "\n")
    return EncodeResult(result, layers, summary_path, report)


def _encode_layers(cfg: EncodeConfig, plan: ArtifactPlan, source: SourceCheckpoint, state: EncodeState,
                   console: Console) -> None:
    """Encode each MoE layer not yet finished; write every expert file as soon as all its layers are encoded."""
    expert_files = [f for f in plan.files if has_expert_parts(f)]
    layers_of = {f.path: {t.expert.layer for t in f.tensors if t.expert} for f in expert_files}
    done = {int(l) for l in state.layers if _files_present(cfg.out, [f for f in expert_files if int(l) in layers_of[f.path]])}
    todo = [l for l in plan.spec.moe_layers if l not in done]
    written = {f.path for f in expert_files if layers_of[f.path] <= done}
    pending: dict = {}
    hessians = HessianSource(cfg.observations, cfg.hessians)
    total = sum(len(layer_slices(plan, l)) for l in todo)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        overall = bar.add_task("all MoE layers", total=total, rate="")
        started = time.monotonic()
        for layer in todo:
            n = len(layer_slices(plan, layer))
            task = bar.add_task(f"layer {layer}", total=n, rate="")
            t0 = time.monotonic()

            def advance(k: int) -> None:
                bar.advance(task, k)
                bar.advance(overall, k)
                rate = bar.tasks[overall].completed / max(time.monotonic() - started, 1e-9)
                bar.update(overall, rate=f"{rate:.1f} tensors/s")

            try:
                encoded = encode_layer(plan, layer, source, hessians.layer(layer), cfg.seed, cfg.device,
                                       cfg.batch_tensors, advance)
            except NumericalError as exc:
                raise NumericalError(f"layer {layer}: {exc} (layers before it are kept; rerun to resume)") from None
            for line in fallback_warnings(encoded.reports):
                console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
            pending.update(encoded.tensors)
            done_now = done | {layer}
            bytes_written = 0
            for f in expert_files:
                if f.path not in written and layers_of[f.path] <= done_now:
                    write_planned_file(f, source, cfg.out, pending)
                    written.add(f.path)
                    bytes_written += f.size
            for f in expert_files:  # free what was written
                if f.path in written:
                    for t in f.tensors:
                        pending.pop(t.name, None)
            done = done_now
            state.finish_layer(layer, summarize_layer(layer, encoded.reports, time.monotonic() - t0, bytes_written).__dict__)
            bar.remove_task(task)


def _retained_files(plan: ArtifactPlan) -> list[PlannedFile]:
    return [f for f in plan.files if not has_expert_parts(f)]


def _files_present(out: Path, files: list[PlannedFile]) -> bool:
    return all((out / f.path).is_file() and (out / f.path).stat().st_size == f.size for f in files)

