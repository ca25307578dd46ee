"""`build_artifact`: observe and encode one MoE layer at a time, so no Hessian is ever written to disk.

observe() streams the layers as usual (same statistics, token rows, prune plan and stream files, same resume
rules); its results sink here saves the REAP statistics, then hands the layer's Hessian accumulators, still
on the device, straight to the encoder's per-layer step (`EncodeJob.encode`). The encoder sees the very sums
`observe` would have written, so the artifact is byte-identical to `observe` then `encode` with the same
options. Once every layer is observed, the encode finishes as usual (retained tensors, manifest, verification).
Disk: observations without Hessians (streams, statistics, token rows) plus the artifact.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console

from glmquant.build.config import BuildConfig
from glmquant.calibration import TokenRows
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.hessians import LayerHessiansView
from glmquant.encode.provenance import calibration_info, hessian_routing
from glmquant.encode.run import EncodeJob, EncodeResult
from glmquant.observe.hessian_reader import HeldHessians
from glmquant.observe.hessians import HessianAccumulator, HessianMode
from glmquant.observe.run import ObservationFiles, observe
from glmquant.observe.stats import ExpertStats
from glmquant.observe.summary import ObservationSummary


@dataclass(frozen=True)
class BuildResult:
    observation: ObservationSummary
    encode: EncodeResult


class EncodedLayers:
    """observe's results sink for a build: statistics as files, Hessians straight into the encoder."""

    kind = "encoded"

    def __init__(self, config: BuildConfig, source: SourceCheckpoint, console: Console) -> None:
        self.config, self.source, self.console = config, source, console
        self.statistics = ObservationFiles(config.observe.out)
        self.job: EncodeJob | None = None

    def start(self, rows: TokenRows) -> None:
        calibration = calibration_info(
            str(self.config.observe.recipe),
            rows.recipe_sha256,
            rows.sha256,
            [tuple(lane.ids.shape) for lane in rows.lanes],
            hessian_routing(self.config.encode),  # as an encode of these observations states it (blend included)
            self.config.observe.hessian_weighting.value,
        )
        self.job = EncodeJob(self.config.encode, self.source, calibration, self.console)

    def save(self, layer: int | None, stats: ExpertStats | None, hessians: HessianAccumulator | None) -> None:
        assert layer is not None  # no lm_head Hessian: a build refuses --dense-hessians
        self.statistics.save(layer, stats, None)
        assert self.job is not None  # observe starts the sink before it saves a layer
        if layer in self.job.todo:  # an encode killed after its layer finished but before observe recorded it
            self.job.encode(layer, self._view(hessians))

    def _view(self, hessians: HessianAccumulator | None) -> LayerHessiansView:
        """What `HessianSource.layer` would give for the same observation written to files."""
        if hessians is None:
            return LayerHessiansView(None, None)
        mode = HessianMode(self.config.encode.hessians)
        backup = HeldHessians(hessians, HessianMode.ALL) if mode.natural and hessians.mode.all_tokens else None
        return LayerHessiansView(HeldHessians(hessians, mode), backup, self.config.encode.blend)


def build_artifact(config: BuildConfig, console: Console, progress: bool = False) -> BuildResult:
    with SourceCheckpoint.open(config.encode.source) as source:
        sink = EncodedLayers(config, source, console)
        observation = observe(config.observe, progress, sink)
        assert sink.job is not None  # observe started it
        return BuildResult(observation, sink.job.finish())
