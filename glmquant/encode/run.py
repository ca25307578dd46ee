"""`encode_artifact`: BF16 source + observations -> a verified EXL3 artifact, one MoE layer at a time, resumable."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from glmquant.arch import classify, load_model_spec
from glmquant.checkpoint.artifact_writer import (
    ArtifactResult, finalize_artifact, has_expert_parts, write_planned_file, write_retained_shards,
)
from glmquant.checkpoint.layouts import ArtifactPlan, PlannedFile, plan_artifact
from glmquant.checkpoint.provenance import CalibrationInfo
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import VerifyReport, verify_artifact
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.encode.config import EncodeConfig
from glmquant.encode.hessians import HessianSource, LayerHessiansView
from glmquant.encode.layer import encode_layer, layer_slices
from glmquant.encode.provenance import build_provenance, job_inputs, observed_calibration
from glmquant.encode.pruning import resolve_keep
from glmquant.encode.state import EncodeState
from glmquant.encode.summary import LayerSummary, summarize_layer
from glmquant.errors import CheckpointFormatError, UsageError

SUMMARY_NAME = "encode-summary.json"


@dataclass(frozen=True)
class EncodeResult:
    artifact: ArtifactResult
    layers: list[LayerSummary]
    summary_path: Path
    verification: VerifyReport | None  # the full verification (every file hashed) when cfg.verify


def encode_artifact(cfg: EncodeConfig, console: Console) -> EncodeResult:
    with SourceCheckpoint.open(cfg.source) as source:
        job = EncodeJob(cfg, source, observed_calibration(cfg))
        hessians = HessianSource(cfg.observations, cfg.hessians)
        total = sum(len(layer_slices(job.plan, l)) for l in job.todo)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console) as bar:
            overall = bar.add_task("all MoE layers", total=total, rate="")
            started = time.monotonic()
            for layer in job.todo:
                task = bar.add_task(f"layer {layer}", total=len(layer_slices(job.plan, layer)), rate="")

                def advance(k: int) -> None:
                    bar.advance(task, k)
                    bar.advance(overall, k)
                    rate = bar.tasks[overall].completed / max(time.monotonic() - started, 1e-9)
                    bar.update(overall, rate=f"{rate:.1f} tensors/s")

                job.encode(layer, hessians.layer(layer), advance)
                bar.remove_task(task)
        return job.finish(console)


class EncodeJob:
    """An encode in progress over an open source: the artifact plan, the resume state and the expert files that
    wait for their layers. `encode` one layer at a time (in any order), then `finish`. The fused observe+encode
    stage drives it with Hessians that never left the device."""

    def __init__(self, cfg: EncodeConfig, source: SourceCheckpoint, calibration: CalibrationInfo) -> None:
        spec = load_model_spec(source.config_path)
        classify(spec, source.names())
        self.cfg, self.source, self.calibration = cfg, source, calibration
        self.keep = resolve_keep(cfg, spec)
        self.plan = plan_artifact(spec, cfg.layout, cfg.bits, cfg.codebook,
                                  {n: source.shard_of(n) for n in source.names()}, self.keep)
        self.state = EncodeState.load_or_new(cfg.state_dir, cfg.fingerprint(job_inputs(cfg, source, self.keep,
                                                                                       calibration)))
        cfg.out.mkdir(parents=True, exist_ok=True)
        self._expert_files = [f for f in self.plan.files if has_expert_parts(f)]
        self._layers_of = {f.path: {t.expert.layer for t in f.tensors if t.expert} for f in self._expert_files}
        self._done = {int(l) for l in self.state.layers
                      if _files_present(cfg.out, [f for f in self._expert_files if int(l) in self._layers_of[f.path]])}
        self._written = {f.path for f in self._expert_files if self._layers_of[f.path] <= self._done}
        self._pending: dict = {}

    @property
    def todo(self) -> list[int]:
        """MoE layers not encoded yet (their files not all on disk)."""
        return [l for l in self.plan.spec.moe_layers if l not in self._done]

    def encode(self, layer: int, hessians: LayerHessiansView, on_tensor: Callable[[int], None] = lambda n: None
               ) -> LayerSummary:
        """Encode one layer, write every expert file whose layers are now all encoded, and record the layer."""
        t0 = time.monotonic()
        encoded = encode_layer(self.plan, layer, self.source, hessians, self.cfg.seed, self.cfg.device,
                               self.cfg.batch_tensors, on_tensor)
        self._pending.update(encoded.tensors)
        self._done.add(layer)
        bytes_written = 0
        for f in self._expert_files:
            if f.path not in self._written and self._layers_of[f.path] <= self._done:
                write_planned_file(f, self.source, self.cfg.out, self._pending)
                self._written.add(f.path)
                bytes_written += f.size
                for t in f.tensors:  # free what was written
                    self._pending.pop(t.name, None)
        summary = summarize_layer(layer, encoded.reports, time.monotonic() - t0, bytes_written)
        self.state.finish_layer(layer, summary.__dict__)
        return summary

    def finish(self, console: Console) -> EncodeResult:
        """Copy the retained tensors, finalize (config, index, manifest) and verify the artifact."""
        cfg, plan, state = self.cfg, self.plan, self.state
        if self.todo:
            raise UsageError(f"{cfg.out}: MoE layer(s) {self.todo} are not encoded yet")
        if not state.retained_done or not _files_present(cfg.out, _retained_files(plan)):
            console.print("copying retained tensors byte-for-byte")
            write_retained_shards(plan, self.source, cfg.out)
            state.finish_retained()
        result = finalize_artifact(plan, self.source, cfg.out,
                                   build_provenance(cfg, self.source, self.keep, self.calibration))
        report = None
        if cfg.verify:
            report = verify_artifact(cfg.out, expect_sha256=result.manifest_sha256, fast=False)
            if not report.ok:
                raise CheckpointFormatError(f"{cfg.out}: verification failed: {report.failure_summary()}")
        layers = [LayerSummary(**state.layers[str(layer)]) for layer in plan.spec.moe_layers]
        summary_path = cfg.state_dir / SUMMARY_NAME
        atomic_write_text(summary_path, json.dumps({"manifest_sha256": result.manifest_sha256,
                                                    "layers": [l.__dict__ for l in layers]}, indent=2) + "\n")
        return EncodeResult(result, layers, summary_path, report)


def _retained_files(plan: ArtifactPlan) -> list[PlannedFile]:
    return [f for f in plan.files if not has_expert_parts(f)]


def _files_present(out: Path, files: list[PlannedFile]) -> bool:
    return all((out / f.path).is_file() and (out / f.path).stat().st_size == f.size for f in files)

