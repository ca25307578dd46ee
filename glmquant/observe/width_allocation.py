"""The widths of least summed cost within a byte budget: an exact multiple-choice knapsack over layers.

Each layer takes one of its options (a K, or None for exact), each with a cost (e.g. the KL the layer causes alone at
that width) and bytes; the chosen options' bytes must sum to at most the budget. The costs are assumed to add (on the
proxies a row's KL was within 10 % of its layers' sum for routed experts; the retained linears' sums overstate but
rank, docs/fidelity.md). Used for the routed experts' K per MoE layer (`observe.tiers.allocate_layer_widths`) and the
retained linears' K per decoder layer (`encode --retained-layer-bits`, as the fidelity bench's
`retained-layer-cost-head5` row chooses them).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import TypeVar

from glmquant.errors import UsageError

EXACT_RANK = 1 << 16  # an exact option (None) ranks as the widest on a tie
Width = TypeVar("Width", bound=int | None)  # a K, or None for exact where a layer may stay exact


def _width(option: int | None) -> int:
    return EXACT_RANK if option is None else option


def allocate_widths(
    cost: Mapping[int, Mapping[Width, float]],
    nbytes: Mapping[int, Mapping[Width, int]],
    budget: int,
    offered: Collection[Width] | None = None,
) -> dict[int, Width]:
    """The option of each layer that minimizes the sum of the layers' costs, their bytes at most `budget`, among the
    `offered` options alone when given (e.g. the K one kernel runs). Every option with a cost needs its bytes. Ties
    keep the wider option on the earlier layer. UsageError for a layer without options, a cost that is not finite, or
    a budget no choice fits (naming the least it needs)."""
    if offered is not None:
        cost = {layer: {k: v for k, v in by_k.items() if k in offered} for layer, by_k in cost.items()}
    layers = sorted(cost)
    if not layers or any(not cost[layer] for layer in layers):
        raise UsageError(f"layer costs {dict(cost)}: every layer needs a cost at one width at least")
    bad = [(layer, k) for layer in layers for k, v in cost[layer].items() if not math.isfinite(float(v))]
    if bad:
        raise UsageError(f"layer costs: not finite at (layer, K) {bad}")
    missing = [(layer, k) for layer in layers for k in cost[layer] if k not in nbytes.get(layer, {})]
    if missing:
        raise UsageError(f"layer costs: no bytes given at (layer, K) {missing}")

    def rank(entry: tuple[float, tuple[Width, ...]]) -> tuple[float, tuple[int, ...]]:
        return entry[0], tuple(-_width(k) for k in entry[1])  # the least cost; on a tie the wider K first

    # bytes spent -> (least cost, widths so far); an entry another beats with no more bytes is dropped: extended by
    # the same later widths, the other stays within the budget and ranks first, so the result is exact
    best: dict[int, tuple[float, tuple[Width, ...]]] = {0: (0.0, ())}
    for layer in layers:
        step: dict[int, tuple[float, tuple[Width, ...]]] = {}
        for spent, (total, widths) in best.items():
            for k in sorted(cost[layer], key=_width, reverse=True):
                cost_k, after = float(cost[layer][k]), spent + int(nbytes[layer][k])
                if after > budget:
                    continue
                candidate = (total + cost_k, (*widths, k))
                if after not in step or rank(candidate) < rank(step[after]):
                    step[after] = candidate
        if not step:
            least = sum(min(nbytes[layer][k] for k in cost[layer]) for layer in layers)
            raise UsageError(f"layer costs: no width per layer fits {budget:,} bytes (the narrowest take {least:,})")
        best, leader = {}, None
        for spent in sorted(step):
            if leader is None or rank(step[spent]) < rank(leader):
                best[spent] = leader = step[spent]
    _, widths = min(best.values(), key=rank)
    return dict(zip(layers, widths))
