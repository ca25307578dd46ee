"""`encode_artifact`: BF16 source + observations -> a verified EXL3 artifact in work units, resumable, on any
number of processes (torchrun).

Each MoE layer's experts are cut into work units (`--experts-per-unit`); a rank encodes its share of the units
(round-robin) into unit files in the work dir, and rank 0 turns every layer whose units are all there into
artifact files, in layer order, then writes the retained tensors, the manifest and verifies the whole.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from glmquant.arch import classify, load_model_spec
from glmquant.checkpoint.artifact_writer import (
    ArtifactResult,
    finalize_artifact,
    has_expert_parts,
    has_retained_linears,
    write_planned_file,
    write_retained_shards,
)
from glmquant.checkpoint.layouts import ArtifactPlan, ExpertSlice, PlannedFile, plan_artifact
from glmquant.checkpoint.provenance import CalibrationInfo
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import VerifyReport, verify_artifact
from glmquant.checkpoint.writer import atomic_write_text, remove_temp_files
from glmquant.encode.config import EncodeConfig
from glmquant.encode.distributed import Ranks, join, leave
from glmquant.encode.hessians import HessianSource, LayerHessiansView
from glmquant.encode.layer import EncodedLayer, encode_units, layer_units
from glmquant.encode.provenance import build_provenance, job_inputs, observed_calibration
from glmquant.encode.pruning import resolve_keep, resolve_tiers
from glmquant.encode.retained import check_dense_hessians, retained_encoder
from glmquant.encode.state import EncodeState
from glmquant.encode.summary import LayerSummary, fallback_warnings, summarize_layer
from glmquant.encode.units import UnitStore, WriteBehind
from glmquant.errors import CheckpointFormatError, NumericalError, UsageError
from glmquant.observe.summary import check_observed_from

SUMMARY_NAME = "encode-summary.json"

Unit = tuple[int, int, list[ExpertSlice]]  # (layer, unit index, the unit's EXL3 tensors)


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
        with SourceCheckpoint.open(cfg.source) as source:
            job = EncodeJob(cfg, source, observed_calibration(cfg), console, ranks)
            job.encode_all()
            return job.finish() if ranks.is_main else None
    finally:
        leave(ranks)


def _refuse_another_artifact(out: Path, plan: ArtifactPlan) -> None:
    """--out may hold this job's files (a resume, or the same encode again, which replaces them), but not tensor
    files this plan does not write: another layout's or pruning's artifact would end up half replaced, its old files
    beside the new ones, and fail verification after the whole encode."""
    if not out.is_dir():
        return
    planned = {f.path for f in plan.files}
    stray = sorted(p.name for p in out.glob("*.safetensors") if p.name not in planned)
    if stray:
        raise UsageError(
            f"--out {out} holds {len(stray)} tensor file(s) this artifact would not write (e.g. {stray[0]}): another "
            "artifact's; encode into a new directory, or delete it first"
        )


class EncodeJob:
    """An encode in progress over an open source: the plan, the resume state, the unit files and (rank 0) the
    expert files waiting for their layers. `encode_all` runs this rank's share of every unfinished layer; the
    fused observe+encode stage calls `encode(layer, hessians)` one layer at a time instead, with Hessians that
    never left the device. Then `finish`."""

    def __init__(
        self,
        cfg: EncodeConfig,
        source: SourceCheckpoint,
        calibration: CalibrationInfo,
        console: Console,
        ranks: Ranks = Ranks(),
    ) -> None:
        spec = load_model_spec(source.config_path)
        source.check_specs(classify(spec, source.names()).values())
        self.cfg, self.source, self.calibration, self.console, self.ranks = cfg, source, calibration, console, ranks
        self.keep = resolve_keep(cfg, spec)
        tiers = resolve_tiers(cfg, spec, self.keep)
        self.tiers = tiers.expert_bits if tiers else None
        self.plan = plan_artifact(
            spec,
            cfg.layout,
            tiers.rest_bits if tiers else cfg.bits,
            cfg.codebook,
            {n: source.shard_of(n) for n in source.names()},
            self.keep,
            expert_bits=self.tiers,
            retained_bits=cfg.retained_bits,
            head_bits=cfg.head_bits,
            retained_exact_layers=cfg.retained_exact_layers,
            retained_layer_bits=cfg.retained_layer_bits,
        )
        _refuse_another_artifact(cfg.out, self.plan)
        if ranks.is_main:  # refuse another source's observations or a missing retained Hessian before any work
            if cfg.observations is not None:
                check_observed_from(Path(cfg.observations), source)
            check_dense_hessians(self.plan, cfg.observations, cfg.retained_fallback_identity)
        self.state = EncodeState.load_or_new(
            cfg.state_dir, cfg.fingerprint(job_inputs(cfg, source, self.keep, calibration, self.tiers))
        )
        cfg.out.mkdir(parents=True, exist_ok=True)
        if ranks.is_main:
            if cfg.uncalibrated:
                console.print(
                    "[yellow]warning:[/] --uncalibrated: every tensor is encoded without calibration "
                    "(identity Hessians)",
                    highlight=False,
                )
            for directory in (cfg.out, cfg.state_dir, cfg.state_dir / "units"):  # what a killed run was writing
                remove_temp_files(directory)
        ranks.barrier()  # no rank writes before rank 0 has swept
        self.device = ranks.device(cfg.device)
        if torch.device(self.device).type == "cuda" and torch.device(self.device).index is not None:
            torch.cuda.set_device(torch.device(self.device))
        self.store = UnitStore(cfg.state_dir / "units")
        self._expert_files = [f for f in self.plan.files if has_expert_parts(f)]
        self._layers_of = {f.path: {t.expert.layer for t in f.tensors if t.expert} for f in self._expert_files}
        self._done = {
            int(layer)
            for layer in self.state.layers
            if _files_present(cfg.out, [f for f in self._expert_files if int(layer) in self._layers_of[f.path]])
        }
        self._written = {f.path for f in self._expert_files if self._layers_of[f.path] <= self._done}
        self._units = {layer: layer_units(self.plan, layer, cfg.experts_per_unit) for layer in self.todo}
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def todo(self) -> list[int]:
        """MoE layers not encoded yet (their files not all on disk)."""
        return [layer for layer in self.plan.spec.moe_layers if layer not in self._done]

    def encode_all(self) -> None:
        """This rank's units of every unfinished layer; then rank 0 assembles whatever is left."""
        units = [(layer, u, slices) for layer in self.todo for u, slices in enumerate(self._units[layer])]
        self._run(
            self.ranks.mine(units),
            lru_cache(maxsize=2)(HessianSource(self.cfg.observations, self.cfg.hessians, self.cfg.blend).layer),
        )
        self.ranks.barrier()
        if self.ranks.is_main:
            self._assemble_ready()
            if self.todo:
                raise CheckpointFormatError(
                    f"{self.store.directory}: units of MoE layers {self.todo} are missing "
                    "after all ranks finished; rerun the same command"
                )

    def encode(self, layer: int, hessians: LayerHessiansView) -> LayerSummary:
        """Every unit of one layer with the given Hessians (one process), then its artifact files."""
        self._run([(layer, u, slices) for u, slices in enumerate(self._units[layer])], lambda _: hessians)
        self._assemble_ready()
        return LayerSummary(**self.state.layers[str(layer)])

    def _run(self, units: list[Unit], views: Callable[[int], LayerHessiansView]) -> None:
        """Encode the units not already on disk into unit files; rank 0 assembles layers as they complete."""
        units = [(layer, u, slices) for layer, u, slices in units if not self.store.has(layer, u)]
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        ranks = self.ranks
        label = "routed-expert tensors" + (f" (rank {ranks.rank} of {ranks.world})" if ranks.world > 1 else "")
        with Progress(*columns, console=self.console, disable=not ranks.is_main) as bar:
            task = bar.add_task(label, total=sum(len(s) for _, _, s in units), rate="")
            started = t0 = time.monotonic()
            encoded_units = encode_units(
                self.plan,
                [(layer, s) for layer, _, s in units],
                self.source,
                views,
                self.cfg.seed,
                self.device,
                self.cfg.tune_scales,
            )
            # a unit's file (and a completed layer's files) written while the next unit encodes
            with WriteBehind(partial(self.console.print, highlight=False)) as writer:
                for layer, u, _ in units:
                    try:
                        encoded = next(encoded_units)
                    except NumericalError as exc:
                        raise NumericalError(
                            f"layer {layer}: {exc} (finished work units are kept; rerun to resume)"
                        ) from None
                    now = time.monotonic()
                    writer.submit(partial(self._keep_unit, layer, u, encoded, now - t0))
                    t0 = now
                    bar.advance(task, len(encoded.reports))
                    bar.update(task, rate=f"{bar.tasks[task].completed / max(now - started, 1e-9):.1f} tensors/s")

    def _keep_unit(self, layer: int, unit: int, encoded: EncodedLayer, seconds: float) -> None:
        """A finished unit's file; on rank 0 also the artifact files of layers it completes."""
        self.store.write(layer, unit, encoded, seconds)
        if self.ranks.is_main:
            self._assemble_ready()

    def _assemble_ready(self) -> None:
        """Layers whose units are all on disk become artifact files, in layer order; an expert file is written as
        soon as every layer it holds is assembled, and a layer's unit files go once all its files are written."""
        for layer in self.todo:
            if not all(self.store.has(layer, u) for u in range(len(self._units[layer]))):
                return
            reports, seconds, tuning = [], 0.0, []
            for u in range(len(self._units[layer])):
                encoded, unit_seconds = self.store.read(layer, u)
                self._pending.update(encoded.tensors)
                reports += encoded.reports
                seconds += unit_seconds
                tuning += [] if encoded.tuning is None else [encoded.tuning]
            self._done.add(layer)
            for line in fallback_warnings(reports):
                self.console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
            bytes_written = 0
            for f in self._expert_files:
                if f.path not in self._written and self._layers_of[f.path] <= self._done:
                    linears = self._retained_linears(f) if has_retained_linears(f) else {}  # exllamav3 module files
                    write_planned_file(f, self.source, self.cfg.out, {**self._pending, **linears})
                    self._written.add(f.path)
                    bytes_written += f.size
                    for t in f.tensors:  # free what was written
                        self._pending.pop(t.name, None)
            self.state.finish_layer(layer, summarize_layer(layer, reports, seconds, bytes_written, tuning).__dict__)
            for finished in sorted(self._done):
                if all(f.path in self._written for f in self._expert_files if finished in self._layers_of[f.path]):
                    self.store.remove_layer(finished)

    def _retained_linears(self, planned: PlannedFile) -> Mapping[str, torch.Tensor]:
        """The EXL3 retained linears and head of one planned file (`--retained-bits`, `--head-bits`), encoded now."""
        cfg = self.cfg
        encode = retained_encoder(
            self.plan,
            self.source,
            cfg.observations,
            cfg.retained_fallback_identity,
            cfg.seed,
            self.device,
            self._warn_fallbacks,
        )
        return encode(planned)

    def _warn_fallbacks(self, encoded: EncodedLayer) -> None:
        for line in fallback_warnings(encoded.reports):
            self.console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)

    def finish(self) -> EncodeResult:
        """Copy the retained tensors, finalize (config, index, manifest) and verify the artifact (rank 0)."""
        cfg, plan, state = self.cfg, self.plan, self.state
        if self.todo:
            raise UsageError(f"{cfg.out}: MoE layer(s) {self.todo} are not encoded yet")
        if not state.retained_done or not _files_present(cfg.out, _retained_files(plan)):
            head = None if plan.head_bits is None else f"K{plan.head_bits}"
            encoded = [
                f"the {what} at {k}" for what, k in (("retained linears", plan.retained_widths), ("lm_head", head)) if k
            ]
            self.console.print(
                "copying retained tensors byte-for-byte"
                + (", EXL3-encoding " + " and ".join(encoded) if encoded else "")
            )
            try:
                write_retained_shards(plan, self.source, cfg.out, self._retained_linears)
            except NumericalError as exc:  # hours of routed experts must not look lost
                raise NumericalError(
                    f"{exc}; the routed experts' files in {cfg.out} are kept: mend the source and rerun the same "
                    "command, which redoes only the retained tensors"
                ) from None
            state.finish_retained()
        result = finalize_artifact(
            plan,
            self.source,
            cfg.out,
            build_provenance(cfg, self.source, self.keep, self.calibration, self.tiers),
            cfg.verified_at,
        )
        report = None
        if cfg.verify:
            report = verify_artifact(cfg.out, expect_sha256=result.manifest_sha256, fast=False)
            if not report.ok:
                raise CheckpointFormatError(f"{cfg.out}: verification failed: {report.failure_summary()}")
        layers = [LayerSummary(**state.layers[str(layer)]) for layer in plan.spec.moe_layers]
        summary_path = cfg.state_dir / SUMMARY_NAME
        atomic_write_text(
            summary_path,
            json.dumps(
                {"manifest_sha256": result.manifest_sha256, "layers": [summary.__dict__ for summary in layers]},
                indent=2,
            )
            + "\n",
        )
        return EncodeResult(result, layers, summary_path, report)


def _retained_files(plan: ArtifactPlan) -> list[PlannedFile]:
    return [f for f in plan.files if not has_expert_parts(f)]


def _files_present(out: Path, files: list[PlannedFile]) -> bool:
    return all((out / f.path).is_file() and (out / f.path).stat().st_size == f.size for f in files)
