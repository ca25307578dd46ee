"""`encode_artifact`: BF16 source + observations -> a verified EXL3 artifact, one MoE layer at a time, resumable."""

from __future__ import annotations

import json
import time
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path

import torch
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
from glmquant.encode.distributed import Ranks, join, leave
from glmquant.encode.layer import encode_units, layer_units
from glmquant.encode.provenance import build_provenance, job_inputs
from glmquant.encode.pruning import resolve_keep
from glmquant.encode.state import EncodeState
from glmquant.encode.summary import LayerSummary, fallback_warnings, summarize_layer
from glmquant.encode.units import UnitStore
from glmquant.errors import CheckpointFormatError, NumericalError

SUMMARY_NAME = "encode-summary.json"


@dataclass(frozen=True)
class EncodeResult:
    artifact: ArtifactResult
    layers: list[LayerSummary]
    summary_path: Path
    verification: VerifyReport | None  # the full verification (every file hashed) when cfg.verify


def encode_artifact(cfg: EncodeConfig, console: Console) -> EncodeResult | None:
    """Build the artifact. Under torchrun every rank encodes its share of the work units and rank 0 writes the
    artifact; ranks other than 0 return None."""
    ranks = join()
    try:
        return _encode(cfg, console, ranks)
    finally:
        leave(ranks)


def _encode(cfg: EncodeConfig, console: Console, ranks: Ranks) -> EncodeResult | None:
    with SourceCheckpoint.open(cfg.source) as source:
        spec = load_model_spec(source.config_path)
        classify(spec, source.names())
        keep = resolve_keep(cfg, spec)
        plan = plan_artifact(spec, cfg.layout, cfg.bits, cfg.codebook,
                             {n: source.shard_of(n) for n in source.names()}, keep)
        state = EncodeState.load_or_new(cfg.state_dir, cfg.fingerprint(job_inputs(cfg, source, keep)))
        cfg.out.mkdir(parents=True, exist_ok=True)
        if cfg.uncalibrated and ranks.is_main:
            console.print("[yellow]warning:[/] --uncalibrated: every tensor is encoded without calibration "
                          "(identity Hessians)", highlight=False)
        if ranks.is_main:
            for directory in (cfg.out, cfg.state_dir):  # what a killed run was writing (kill -9 runs no cleanup)
                remove_temp_files(directory)
        ranks.barrier()  # no rank writes before rank 0 has swept
        _encode_layers(cfg, plan, source, state, console, ranks)
        if not ranks.is_main:
            return None
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
                   console: Console, ranks: Ranks) -> None:
    """Encode this rank's units of the unfinished layers into unit files; rank 0 turns every layer whose units
    are all done into artifact files as soon as it can (and the rest after the ranks meet)."""
    assembler = _Assembler(cfg, plan, source, state, console)
    store = assembler.store
    units = [(layer, u, slices) for layer in assembler.todo
             for u, slices in enumerate(layer_units(plan, layer, cfg.experts_per_unit))]
    mine = [(layer, u, slices) for layer, u, slices in ranks.mine(units) if not store.has(layer, u)]
    device = ranks.device(cfg.device)
    if torch.device(device).index is not None and torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    views = lru_cache(maxsize=2)(HessianSource(cfg.observations, cfg.hessians).layer)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    label = "routed-expert tensors" + (f" (rank {ranks.rank} of {ranks.world})" if ranks.world > 1 else "")
    with Progress(*columns, console=console, disable=not ranks.is_main) as bar:
        task = bar.add_task(label, total=sum(len(s) for _, _, s in mine), rate="")
        started = t0 = time.monotonic()
        encoded_units = encode_units(plan, [(layer, s) for layer, _, s in mine], source, views, cfg.seed, device)
        for layer, u, _ in mine:
            try:
                encoded = next(encoded_units)
            except NumericalError as exc:
                raise NumericalError(f"layer {layer}: {exc} (finished work units are kept; rerun to resume)") from None
            now = time.monotonic()
            store.write(layer, u, encoded, now - t0)
            t0 = now
            bar.advance(task, len(encoded.reports))
            bar.update(task, rate=f"{bar.tasks[task].completed / max(now - started, 1e-9):.1f} tensors/s")
            if ranks.is_main:
                assembler.assemble_ready()
    ranks.barrier()
    if ranks.is_main:
        assembler.assemble_ready()
        missing = [layer for layer in assembler.todo if str(layer) not in state.layers]
        if missing:
            raise CheckpointFormatError(f"{store.directory}: units of MoE layers {missing} are missing after all ranks "
                                        "finished; rerun the same command")


class _Assembler:
    """Rank 0's side: layers whose units are all on disk become artifact files, in layer order; an expert file
    is written as soon as every layer it holds is assembled."""

    def __init__(self, cfg: EncodeConfig, plan: ArtifactPlan, source: SourceCheckpoint, state: EncodeState,
                 console: Console) -> None:
        self.cfg, self.plan, self.source, self.state, self.console = cfg, plan, source, state, console
        self.store = UnitStore(cfg.state_dir / "units")
        self.expert_files = [f for f in plan.files if has_expert_parts(f)]
        self.layers_of = {f.path: {t.expert.layer for t in f.tensors if t.expert} for f in self.expert_files}
        self.done = {int(l) for l in state.layers
                     if _files_present(cfg.out, [f for f in self.expert_files if int(l) in self.layers_of[f.path]])}
        self.todo = [l for l in plan.spec.moe_layers if l not in self.done]
        self.written = {f.path for f in self.expert_files if self.layers_of[f.path] <= self.done}
        self.units = {layer: len(layer_units(plan, layer, cfg.experts_per_unit)) for layer in self.todo}
        self.pending: dict[str, torch.Tensor] = {}

    def assemble_ready(self) -> None:
        for layer in self.todo:
            if layer in self.done:
                continue
            if not all(self.store.has(layer, u) for u in range(self.units[layer])):
                return  # layers are assembled in order
            reports, seconds = [], 0.0
            for u in range(self.units[layer]):
                encoded, unit_seconds = self.store.read(layer, u)
                self.pending.update(encoded.tensors)
                reports += encoded.reports
                seconds += unit_seconds
            self.done.add(layer)
            for line in fallback_warnings(reports):
                self.console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
            bytes_written = 0
            for f in self.expert_files:
                if f.path not in self.written and self.layers_of[f.path] <= self.done:
                    write_planned_file(f, self.source, self.cfg.out, self.pending)
                    self.written.add(f.path)
                    bytes_written += f.size
                    for t in f.tensors:
                        self.pending.pop(t.name, None)
            self.state.finish_layer(layer, summarize_layer(layer, reports, seconds, bytes_written).__dict__)
            for finished in sorted(self.done):
                if all(f.path in self.written for f in self.expert_files if finished in self.layers_of[f.path]):
                    self.store.remove_layer(finished)


def _retained_files(plan: ArtifactPlan) -> list[PlannedFile]:
    return [f for f in plan.files if not has_expert_parts(f)]


def _files_present(out: Path, files: list[PlannedFile]) -> bool:
    return all((out / f.path).is_file() and (out / f.path).stat().st_size == f.size for f in files)

