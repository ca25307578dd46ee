"""Per-expert bit widths (tiers) from REAP saliency or by whole MoE layers, as data for the encoder.

A tier spec names the ranking and the tiers from the most salient down. `reap` ranks the experts of each layer,
e.g. `reap:K4=8,K3=16,K2=rest,K1=8`: in every MoE layer the 8 most salient experts get K4, the next 16 K3, the 8
least salient K1 and every other K2. Two criteria rank whole MoE layers, every expert of a layer getting its K:
`depth` puts the first MoE layers first, e.g. `depth:K3=1,K2=rest,K1=1`: K3 for the first MoE layer, K1 for the
last (the same bytes as K2 everywhere), K2 between; an error early in the stack passes through every later layer
(and moves their routing): on the first two trained proxies each MoE layer's K2 experts cost 8 to 120 times the
KL of the next layer's, and on a deeper one (six MoE layers) the first carried 99 % of it (docs/fidelity.md).
`share` ranks them by their routed share (stats.py: the routed experts' output energy against the residual stream
it joins), which leaves that propagation out: on the second proxy it put a middle layer last. A count is a number
of experts (layers) or a percentage of the layer's (kept) experts (of the MoE layers), `K3=25%` rounded down;
exactly one tier is `rest`. Ties rank the lower expert id (layer) first, as the prune plan does, so the assignment
is deterministic. `layers` names every MoE layer's K from the first, e.g. `layers:K4,K2,K1,K2,K2,K1`: an allocation
no ranking expresses, such as `allocate_layer_widths`' from each layer's measured cost at each K (on the six-MoE-layer
proxy the cheapest is not monotone in depth, docs/fidelity.md); its most common K is the artifact's base `bits`.

`tier_plan.json` (written by `glmquant observe --tiers SPEC`, or by encode from the observations):

    {"format": "glmquant.tier_plan.v1", "spec": "reap:K3=16,K2=rest", "criterion": "reap",
     "token_rows_sha256": "...", "layers": {"3": [2, 3, 2, ...]}, "counts": {"2": 48, "3": 16},
     "mean_bits": 2.25, "bitmap_sha256": "..."}

`layers[L]` holds the bits of each output expert (after pruning, in kept order). `bitmap_sha256` is the hash
an artifact's manifest records as `tier_bitmap_sha256` (`tier_bitmap_sha256` below).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmquant.checkpoint.tiers import mean_bits, tier_bitmap_sha256, tier_counts, tiers_by_layer, tiers_differ_by_layer
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import UsageError
from glmquant.observe.width_allocation import allocate_widths

if TYPE_CHECKING:
    from glmquant.observe.stats import LayerStats

TIER_PLAN_FILE = "tier_plan.json"
FORMAT = "glmquant.tier_plan.v1"
CRITERIA = ("reap", "depth", "share", "layers")
LAYER_CRITERIA = ("depth", "share", "layers")  # those that rank whole MoE layers
STRUCTURE_CRITERIA = ("depth", "layers")  # those that follow from the model's structure, no observations needed
_TIER = re.compile(r"^K(\d)=(rest|\d+%?)$")
_WIDTH = re.compile(r"^K(\d)$")


@dataclass(frozen=True)
class Tier:
    bits: int
    count: int | None = None  # experts; None with percent or for the rest
    percent: int | None = None

    def size(self, experts: int) -> int | None:
        """Experts in this tier out of `experts`; None for the rest."""
        if self.percent is not None:
            return experts * self.percent // 100
        return self.count


@dataclass(frozen=True)
class TierSpec:
    criterion: str
    tiers: tuple[Tier, ...]  # most salient first
    widths: tuple[int, ...] = ()  # `layers`: each MoE layer's K from the first

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        criterion, _, body = text.partition(":")
        if criterion not in CRITERIA or not body:
            raise UsageError(
                f"--tiers {text!r}: expected {'|'.join(CRITERIA[:3])}:K<bits>=<count|N%|rest>,..., e.g. "
                "reap:K3=32,K2=rest, or layers:K<bits>,... (one per MoE layer)"
            )
        if criterion == "layers":
            return cls.of_widths(cls._widths(text, body))
        tiers = []
        for item in body.split(","):
            m = _TIER.match(item.strip())
            if m is None or not 1 <= int(m[1]) <= 8:
                raise UsageError(f"--tiers {text!r}: {item.strip()!r} is not K<1..8>=<count|N%|rest>")
            value = m[2]
            tiers.append(
                Tier(
                    int(m[1]),
                    None if value == "rest" or value.endswith("%") else int(value),
                    int(value[:-1]) if value.endswith("%") else None,
                )
            )
        if sum(t.count is None and t.percent is None for t in tiers) != 1:
            raise UsageError(f"--tiers {text!r}: exactly one tier must be 'rest'")
        if len({t.bits for t in tiers}) != len(tiers):
            raise UsageError(f"--tiers {text!r}: each bit width may appear once")
        return cls(criterion, tuple(tiers))

    @staticmethod
    def _widths(text: str, body: str) -> tuple[int, ...]:
        widths = []
        for item in body.split(","):
            m = _WIDTH.match(item.strip())
            if m is None or not 1 <= int(m[1]) <= 8:
                raise UsageError(f"--tiers {text!r}: {item.strip()!r} is not K<1..8> (layers: one K per MoE layer)")
            widths.append(int(m[1]))
        return tuple(widths)

    @classmethod
    def of_widths(cls, widths: Sequence[int]) -> TierSpec:
        """The `layers` spec giving MoE layer i (from the first) the K widths[i]; its tiers are the widths' counts,
        the most common (the lower K on a tie) the `rest`."""
        if not widths or not all(1 <= k <= 8 for k in widths):
            raise UsageError(f"layer widths {list(widths)}: expected one K of 1..8 per MoE layer")
        distinct = sorted(set(widths), reverse=True)
        rest = max(sorted(distinct), key=widths.count)
        tiers = tuple(Tier(k, None if k == rest else widths.count(k)) for k in distinct)
        return cls("layers", tiers, tuple(widths))

    @property
    def text(self) -> str:
        if self.widths:
            return "layers:" + ",".join(f"K{k}" for k in self.widths)

        def size(t: Tier) -> str:
            return (
                "rest"
                if t.count is None and t.percent is None
                else f"{t.percent}%"
                if t.percent is not None
                else str(t.count)
            )

        return f"{self.criterion}:" + ",".join(f"K{t.bits}={size(t)}" for t in self.tiers)

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(t.bits for t in self.tiers)

    @property
    def rest_bits(self) -> int:
        return next(t.bits for t in self.tiers if t.size(1) is None)

    @property
    def ranks_layers(self) -> bool:
        """Whether the spec gives whole MoE layers a K (`depth`, `share`, `layers`) rather than the experts of each
        layer (`reap`)."""
        return self.criterion in LAYER_CRITERIA

    @property
    def from_structure(self) -> bool:
        """Whether the plan follows from the model's structure alone (`depth`, `layers`): a config or a build's
        first layer suffices, no statistics needed."""
        return self.criterion in STRUCTURE_CRITERIA

    def counts(self, experts: int) -> list[tuple[int, int]]:
        """(bits, items) per tier in salience order for `experts` items (the experts of a layer, or the layers)."""
        if self.widths and experts != len(self.widths):
            raise UsageError(f"--tiers {self.text}: {len(self.widths)} widths, the model has {experts} MoE layers")
        fixed = sum(t.size(experts) or 0 for t in self.tiers)
        if fixed > experts:
            what = "MoE layers, the model has" if self.ranks_layers else "experts, the layer has"
            raise UsageError(f"--tiers {self.text}: the counted tiers take {fixed} {what} {experts}")
        counts = []
        for t in self.tiers:
            size = t.size(experts)
            counts.append((t.bits, experts - fixed if size is None else size))
        return counts

    def assign(self, saliency: Sequence[float]) -> tuple[int, ...]:
        """Bits per expert (by index) from its saliency: the most salient fill the first tier, and so on (`layers`:
        the i-th ranked gets widths[i])."""
        counts = self.counts(len(saliency))  # refuses sizes that do not fit
        by_rank = self.widths or tuple(width for width, count in counts for _ in range(count))
        ranked = sorted(range(len(saliency)), key=lambda e: (-saliency[e], e))
        bits = [0] * len(saliency)
        for e, width in zip(ranked, by_rank, strict=True):
            bits[e] = width
        return tuple(bits)


def plan_tiers(
    saliency: Mapping[int, Sequence[float]], spec: TierSpec, keep: Mapping[int, Sequence[int]] | None = None
) -> dict[int, tuple[int, ...]]:
    """Bits of each output expert per MoE layer: `saliency[L]` by source expert, `keep[L]` the kept source
    experts in output order (None: all)."""
    out = {}
    for layer, values in sorted(saliency.items()):
        kept = list(keep[layer]) if keep is not None else list(range(len(values)))
        out[layer] = spec.assign([float(values[e]) for e in kept])
    return out


def plan_layer_tiers(
    saliency: Mapping[int, float], spec: TierSpec, experts: Mapping[int, int]
) -> dict[int, tuple[int, ...]]:
    """Bits of each output expert per MoE layer when the spec ranks layers: `saliency[L]` the layer's rank value
    (its routed share, or minus its index for `depth`), `experts[L]` its output experts, each of which gets the
    layer's K."""
    layers = sorted(saliency)
    widths = spec.assign([saliency[layer] for layer in layers])
    return {layer: (k,) * experts[layer] for layer, k in zip(layers, widths)}


def depth_saliency(layers: Iterable[int]) -> dict[int, float]:
    """`depth`'s rank value of each MoE layer: minus its index, so the first layer ranks first."""
    return {layer: -float(layer) for layer in layers}


def plan_structure_tiers(spec: TierSpec, moe_layers: Sequence[int], experts: int) -> dict[int, tuple[int, ...]]:
    """A `depth` or `layers` spec's bits per expert of every MoE layer from the model's structure alone
    (`plan --tiers`)."""
    if not spec.from_structure:
        raise UsageError(
            f"--tiers {spec.text}: only depth and layers tiers follow from a config alone; {spec.criterion} tiers need "
            "observations (observe --tiers, then --tier-plan)"
        )
    return plan_layer_tiers(depth_saliency(moe_layers), spec, dict.fromkeys(moe_layers, experts))


def allocate_layer_widths(cost: Mapping[int, Mapping[int, float]], mean_bits: float) -> dict[int, int]:
    """The K of each MoE layer that minimizes the sum of the layers' costs, their mean K at most `mean_bits` (the
    bytes of uniform K`mean_bits` where the MoE layers are alike): `allocate_widths` with each K costing K. cost[L][K]
    is layer L's cost at K alone, e.g. the KL it causes with every other layer exact. Ties keep the wider K on the
    earlier layer."""
    nbytes = {layer: {k: k for k in by_k} for layer, by_k in cost.items()}
    budget = math.floor(mean_bits * len(cost) + 1e-9)
    if cost and all(cost.values()) and sum(min(by_k) for by_k in cost.values()) > budget:
        narrowest = [min(cost[layer]) for layer in sorted(cost)]
        raise UsageError(
            f"layer costs: no K per MoE layer has a mean of at most {mean_bits} (the narrowest: {narrowest})"
        )
    return allocate_widths(cost, nbytes, budget)


def layer_saliency(stats: Mapping[int, LayerStats], spec: TierSpec, obs_dir: Path) -> dict[int, float]:
    """Each MoE layer's rank value for a spec that ranks layers: minus its index (`depth`, `layers`: the first layer
    first) or its routed share (`share`; observations without routed-output energies are refused)."""
    if spec.from_structure:
        return depth_saliency(stats)
    shares = {layer: s.routed_share for layer, s in stats.items()}
    missing = sorted(layer for layer, value in shares.items() if value is None)
    if missing:
        raise UsageError(
            f"{obs_dir}: layer(s) {missing} have no routed-output energies (observed before glmquant recorded "
            f"them); observe again to plan {spec.text}"
        )
    return {layer: float(v) for layer, v in shares.items() if v is not None}


def write_tier_plan(
    obs_dir: Path, spec: TierSpec, keep: Mapping[int, Sequence[int]] | None = None, path: Path | None = None
) -> Path:
    """Plan tiers from a finished observation's REAP statistics and write them (default: OBS/tier_plan.json)."""
    from glmquant.calibration.token_rows import TokenRows
    from glmquant.observe.stats import LayerStats, stats_files

    stats = {layer: LayerStats.load(f) for layer, f in stats_files(Path(obs_dir)).items()}
    if not stats:
        raise UsageError(f"{obs_dir}: no MoE layer statistics to plan tiers from")
    if spec.ranks_layers:
        experts = {layer: len(keep[layer]) if keep is not None else s.count.numel() for layer, s in stats.items()}
        bits = plan_layer_tiers(layer_saliency(stats, spec, Path(obs_dir)), spec, experts)
    else:
        bits = plan_tiers({layer: s.reap.tolist() for layer, s in stats.items()}, spec, keep)
    body = {
        "format": FORMAT,
        "spec": spec.text,
        "criterion": spec.criterion,
        "token_rows_sha256": TokenRows.load(Path(obs_dir)).sha256,
        "layers": {str(layer): list(b) for layer, b in bits.items()},
        "counts": {str(b): n for b, n in sorted(tier_counts(bits).items())},  # per layer; null: differs by layer
        **({"layer_counts": tiers_by_layer(bits)} if tiers_differ_by_layer(bits) else {}),
        "mean_bits": round(mean_bits(bits), 4),
        "bitmap_sha256": tier_bitmap_sha256(bits),
    }
    target = path or Path(obs_dir) / TIER_PLAN_FILE
    atomic_write_text(target, json.dumps(body, indent=2, sort_keys=True) + "\n")
    return target


@dataclass(frozen=True)
class TierPlan:
    expert_bits: dict[int, tuple[int, ...]]  # per MoE layer, the bits of each output expert
    rest_bits: int  # the `rest` tier's K: the artifact's base `bits`


def load_tier_plan(path: Path, moe_layers: Sequence[int], experts: int) -> TierPlan:
    """A tier plan's bits per output expert of every MoE layer, checked against the layers and expert count."""
    try:
        data = json.loads(Path(path).read_text())
        layers = {int(k): tuple(int(b) for b in v) for k, v in data["layers"].items()}
        rest = TierSpec.parse(data["spec"]).rest_bits
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UsageError) as exc:
        raise UsageError(f"{path}: not a tier plan ({exc})") from None
    if sorted(layers) != sorted(moe_layers):
        raise UsageError(f"{path}: tiers for layers {sorted(layers)}, the model's MoE layers are {list(moe_layers)}")
    bad = [layer for layer, bits in layers.items() if len(bits) != experts or not all(1 <= b <= 8 for b in bits)]
    if bad:
        raise UsageError(f"{path}: layer(s) {bad} do not give 1..8 bits to each of {experts} experts")
    return TierPlan(layers, rest)
