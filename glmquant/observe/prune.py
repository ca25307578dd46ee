"""REAP pruning plan: per MoE layer, the N experts with the highest saliency, as data for the encoder.

`prune_plan.json`: `layers` maps each MoE layer to its kept source experts in output order (ascending
old ids; new id = position in the list, so the router's `weight` rows and `e_score_correction_bias` are
sliced with it); `dropped` and `kept_saliency_share` per layer are for people. Ties in saliency keep the
lower expert id, so the plan is deterministic. Experts that saw no token have saliency 0 and go first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from glmquant.arch import ModelSpec
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import UsageError
from glmquant.observe.stats import LayerStats

PLAN_FILE = "prune_plan.json"
FORMAT = "glmquant.prune_plan.v1"


@dataclass(frozen=True)
class LayerKeep:
    layer: int
    keep: tuple[int, ...]
    drop: tuple[int, ...]
    kept_saliency_share: float  # Σ saliency of kept experts / Σ over all experts


@dataclass(frozen=True)
class PrunePlan:
    keep: int
    n_routed_experts: int
    criterion: str
    token_rows_sha256: str
    layers: tuple[LayerKeep, ...]

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "keep": self.keep,
            "n_routed_experts": self.n_routed_experts,
            "criterion": self.criterion,
            "token_rows_sha256": self.token_rows_sha256,
            "layers": {str(p.layer): list(p.keep) for p in self.layers},
            "dropped": {str(p.layer): list(p.drop) for p in self.layers},
            "kept_saliency_share": {str(p.layer): p.kept_saliency_share for p in self.layers},
        }
        return json.dumps(body, indent=2, sort_keys=True) + "\n"

    @property
    def sha256(self) -> str:
        """The selection hash the artifact manifest records."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, path: Path) -> Path:
        atomic_write_text(path, self.to_json())
        return path


def check_keep(spec: ModelSpec, keep: int, where: str) -> None:
    """A pruned layer the model's router can route over (UsageError naming `where`: the option or the plan file)."""
    if not spec.min_kept_experts <= keep <= spec.n_routed_experts:
        raise UsageError(
            f"{where}: {keep} kept experts per layer; the router needs {spec.min_kept_experts} to "
            f"{spec.n_routed_experts} (top-{spec.num_experts_per_tok} of {spec.n_group} group(s), each group scored "
            "by its two best experts)"
        )


def plan_pruning(stats: Mapping[int, LayerStats], keep: int, token_rows_sha256: str) -> PrunePlan:
    """Keep the top-`keep` experts of every layer by REAP saliency."""
    if not stats:
        raise UsageError("no MoE layer statistics to plan pruning from")
    n_experts = {s.count.numel() for s in stats.values()}
    if len(n_experts) != 1 or not 1 <= keep <= min(n_experts):
        raise UsageError(f"--keep {keep} must be between 1 and the number of routed experts {sorted(n_experts)}")
    layers = []
    for layer, s in sorted(stats.items()):
        saliency = s.reap.tolist()
        ranked = sorted(range(len(saliency)), key=lambda e: (-saliency[e], e))
        kept, dropped = sorted(ranked[:keep]), sorted(ranked[keep:])
        total = sum(saliency)
        share = sum(saliency[e] for e in kept) / total if total > 0 else 0.0
        layers.append(LayerKeep(layer, tuple(kept), tuple(dropped), share))
    return PrunePlan(keep, n_experts.pop(), "reap", token_rows_sha256, tuple(layers))


def write_prune_plan(obs_dir: Path, keep: int, path: Path | None = None) -> Path:
    """Plan from a finished observation's statistics and write it (default: OBS/prune_plan.json)."""
    from glmquant.calibration.token_rows import TokenRows
    from glmquant.observe.stats import stats_files

    stats = {layer: LayerStats.load(file) for layer, file in stats_files(Path(obs_dir)).items()}
    plan = plan_pruning(stats, keep, TokenRows.load(Path(obs_dir)).sha256)
    return plan.save(path or Path(obs_dir) / PLAN_FILE)
