"""`observations.json`: what an observation run produced, from what, and what it cost."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.reader import SourceCheckpoint, vector_tensors_sha256
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import UsageError
from glmquant.observe.checkpointing import SOURCE_VECTORS_KEY, read_state

SUMMARY_FILE = "observations.json"
FORMAT = "glmquant.observations.v1"


def check_observed_from(obs_dir: Path, source: SourceCheckpoint) -> None:
    """UsageError unless `obs_dir` was observed from `source`: the hash of its 1-D tensors that the observation's
    fingerprint records (finished or not) must be the source's. Observations from before the hash was recorded pass."""
    refuse_artifact(obs_dir)
    recorded = _recorded_fingerprint(obs_dir).get(SOURCE_VECTORS_KEY)
    if recorded is not None and recorded != vector_tensors_sha256(source):
        raise UsageError(
            f"{obs_dir} was observed from another checkpoint than {source.directory}: the hash of its 1-D tensors "
            "(norms, biases) differs; give the checkpoint it was observed from, or observe this one"
        )


def refuse_artifact(obs_dir: Path) -> None:
    """UsageError when `obs_dir` is an artifact given where observations belong (the two are easily swapped)."""
    if (obs_dir / MANIFEST_NAME).is_file():
        raise UsageError(
            f"{obs_dir} is an artifact (it holds {MANIFEST_NAME}), not observations: give `glmquant observe`'s output"
        )


def _recorded_fingerprint(obs_dir: Path) -> Mapping[str, Any]:
    path = obs_dir / SUMMARY_FILE
    if path.is_file():
        try:
            fingerprint = json.loads(path.read_text(encoding="utf-8")).get("fingerprint")
        except (json.JSONDecodeError, AttributeError):
            fingerprint = None  # ObservationSummary.load names what is wrong with the file where it is read
        return fingerprint if isinstance(fingerprint, dict) else {}
    state = read_state(obs_dir)
    return {} if state is None else state.fingerprint


@dataclass(frozen=True)
class LayerSummary:
    layer: int
    mlp: str  # "moe" | "dense"
    attention: str  # "kda" | "mla"
    stats_file: str | None
    hessians_file: str | None
    tokens: int  # calibration tokens in the REAP statistics (0 for dense layers)
    experts_hit: int  # experts that received at least one token
    load_imbalance: float  # busiest expert's count / mean count
    # routed-output energy / residual energy (stats.py), what `--tiers share:...` ranks; None: dense, or observed before
    routed_share: float | None = None
    cost: LayerCost | None = None  # what this invocation spent on the layer (None: done by an earlier one)


@dataclass
class LayerCost:
    """Wall time and device peak of observing one layer, the results sink (a build's encode) excluded."""

    observe_s: float = 0.0  # the pass with the hooks on
    advance_s: float = 0.0  # the pass that finishes the streams entering the next layer
    recomputed_chunks: int = 0  # output chunks the advancing pass had to compute (past the stream budget)
    chunks: int = 0  # chunks of the layer's input streams
    peak_device_bytes: int | None = None  # CUDA peak allocated during the two passes, None on CPU
    load_bytes: int = 0  # one load of the layer's weights (its module state) onto the device
    # what observe_s and advance_s spent outside the forward, keyed "<pass>.<part>" (pass: observe | advance;
    # part: load = building the layer and reading its weights onto the device, read = stream chunks from disk
    # onto the device, write = output chunks to disk, checkpoint = waiting for the device streams' checkpoint);
    # the rest of each pass is the forward with its hooks. "checkpoint.write" is outside both passes: the
    # checkpoint writer's own time, on its thread, whether or not the run waited for it
    parts_s: dict[str, float] = field(default_factory=dict)
    parts_bytes: dict[str, int] = field(default_factory=dict)  # bytes moved by each part of parts_s

    def add_part(self, key: str, seconds: float, nbytes: int) -> None:
        self.parts_s[key] = round(self.parts_s.get(key, 0.0) + seconds, 4)
        self.parts_bytes[key] = self.parts_bytes.get(key, 0) + nbytes


@dataclass(frozen=True)
class HeadSummary:
    """lm_head's Hessian, or the MTP layer's (`--dense-hessians`): its file and what capturing it cost."""

    hessians_file: str
    cost: LayerCost | None = None  # None: captured by an earlier invocation


@dataclass(frozen=True)
class LaneSummary:
    name: str
    rows: int
    tokens: int
    use: tuple[str, ...]


@dataclass(frozen=True)
class ObservationSummary:
    source: str
    recipe: str
    recipe_sha256: str
    token_rows_sha256: str
    lanes: tuple[LaneSummary, ...]
    hessians: str
    dense_hessians: bool
    device: str
    batch_rows: int
    fingerprint: Mapping[str, Any]
    layers: tuple[LayerSummary, ...]
    peak_rss_bytes: int  # this process's peak resident memory
    peak_device_bytes: int | None  # CUDA peak allocated, None on CPU
    elapsed_s: float  # wall time of this invocation (a resumed run counts only its own part)
    resumed_from_layer: int | None
    prune_plan: str | None
    tier_plan: str | None = None
    hessian_weighting: str = "token"  # of the natural Hessians (hessians.HessianWeighting); older files: token
    head: HeadSummary | None = None  # lm_head's Hessian; None without one (and in older files)
    mtp: HeadSummary | None = None  # the MTP layer's Hessians (dense and routed); None without them
    # a resumed device-stream run: the checkpoint layer its streams were recomputed from (0: the embeddings)
    streams_recomputed_from: int | None = None
    streams_recompute_s: float | None = None  # and the seconds that took

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, sort_keys=True) + "\n"

    def save(self, obs_dir: Path) -> None:
        atomic_write_text(obs_dir / SUMMARY_FILE, self.to_json())

    @classmethod
    def load(cls, obs_dir: Path) -> ObservationSummary:
        path = obs_dir / SUMMARY_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.pop("format", None) != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            raw["lanes"] = tuple(LaneSummary(**{**x, "use": tuple(x["use"])}) for x in raw["lanes"])
            raw["layers"] = tuple(
                LayerSummary(**{**x, "cost": x.get("cost") and LayerCost(**x["cost"])}) for x in raw["layers"]
            )
            for key in ("head", "mtp"):
                if raw.get(key) is not None:
                    part = raw[key]
                    raw[key] = HeadSummary(part["hessians_file"], part.get("cost") and LayerCost(**part["cost"]))
            return cls(**raw)
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            refuse_artifact(obs_dir)
            raise UsageError(f"{path}: unreadable observation summary ({exc}); run glmquant observe first") from None

    def moe_layers(self) -> list[LayerSummary]:
        return [x for x in self.layers if x.mlp == "moe"]
