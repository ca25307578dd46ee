"""Widths named per MoE layer (`--tiers layers:...`) and the allocation that picks them from each layer's measured
cost: the knapsack is exact (every allocation enumerated on small cases), keeps the byte budget, and refuses what it
cannot meet; a `layers` spec plans from the structure alone, in any order of depth."""

from __future__ import annotations

import itertools
import random

import pytest

from glmquant.errors import UsageError
from glmquant.observe.tiers import TierSpec, allocate_layer_widths, plan_structure_tiers
from glmquant.observe.width_allocation import allocate_widths


def test_layers_spec_names_each_moe_layers_k_in_any_order() -> None:
    spec = TierSpec.parse("layers:K4,K2,K1,K2,K2,K1")
    assert spec.text == "layers:K4,K2,K1,K2,K2,K1" and TierSpec.of_widths(spec.widths) == spec
    assert spec.ranks_layers and spec.from_structure and spec.rest_bits == 2  # the most common K
    assert spec.counts(6) == [(4, 1), (2, 3), (1, 2)]
    assert plan_structure_tiers(spec, [3, 5, 7, 8, 9, 11], 2) == {
        3: (4, 4),
        5: (2, 2),
        7: (1, 1),
        8: (2, 2),
        9: (2, 2),
        11: (1, 1),
    }
    assert TierSpec.of_widths([1, 3]).rest_bits == 1  # a tie: the lower K is the artifact's base
    with pytest.raises(UsageError, match="6 widths, the model has 5 MoE layers"):
        plan_structure_tiers(spec, [1, 2, 3, 4, 5], 2)
    for bad in ("layers:", "layers:K2,K9", "layers:K2,3", "layers:K2=rest"):
        with pytest.raises(UsageError):
            TierSpec.parse(bad)


def test_allocation_is_the_least_cost_within_the_bytes() -> None:
    rng = random.Random(0)
    widths = (1, 2, 3, 4)
    for layers in range(1, 6):
        for _ in range(20):
            # costs that fall with K, as a layer's KL does, but by layer-dependent factors
            cost = {}
            for layer in range(layers):
                scale = rng.uniform(1e-5, 1e-2)
                cost[10 + layer] = {k: scale * rng.uniform(0.2, 1.0) ** (k - 1) for k in widths}
            got = allocate_layer_widths(cost, 2)
            assert sum(got.values()) <= 2 * layers and sorted(got) == sorted(cost)
            best = min(
                sum(cost[layer][k] for layer, k in zip(sorted(cost), choice))
                for choice in itertools.product(widths, repeat=layers)
                if sum(choice) <= 2 * layers
            )
            assert sum(cost[layer][k] for layer, k in got.items()) == pytest.approx(best, rel=1e-12)


def test_allocation_moves_bits_to_where_they_buy_most_and_refuses_an_impossible_budget() -> None:
    # layer 1 gains most from bits, layer 3 next; layers 2 and 4 lose least at K1: not monotone in depth
    cost = {
        1: {1: 1e-1, 2: 4e-3, 3: 1e-3, 4: 4e-4},
        2: {1: 1e-4, 2: 2e-5, 3: 1e-5, 4: 8e-6},
        3: {1: 5e-2, 2: 2e-3, 3: 5e-4, 4: 2e-4},
        4: {1: 1e-4, 2: 3e-5, 3: 2e-5, 4: 1e-5},
    }
    assert allocate_layer_widths(cost, 2) == {1: 3, 2: 1, 3: 3, 4: 1}
    assert allocate_layer_widths(cost, 4) == {1: 4, 2: 4, 3: 4, 4: 4}
    assert allocate_layer_widths({1: {2: 1.0}, 2: {2: 1.0}}, 2) == {1: 2, 2: 2}
    with pytest.raises(UsageError, match="mean of at most 1"):
        allocate_layer_widths({1: {2: 1.0, 3: 0.5}, 2: {2: 1.0}}, 1)
    with pytest.raises(UsageError, match="every layer needs a cost"):
        allocate_layer_widths({1: {2: 1.0}, 2: {}}, 2)


def test_allocation_breaks_ties_toward_the_earlier_layer_and_refuses_non_finite_costs() -> None:
    even = {layer: {1: 1.0, 2: 1.0, 3: 1.0} for layer in (1, 2, 3)}
    assert allocate_layer_widths(even, 2) == {1: 3, 2: 2, 3: 1}
    with pytest.raises(UsageError, match=r"not finite at \(layer, K\) \[\(1, 1\)\]"):
        allocate_layer_widths({1: {1: float("nan"), 2: 1.0}, 2: {1: 1.0, 2: 1.0}}, 1.5)


def test_byte_allocation_with_exact_layers_is_the_least_cost_within_the_budget() -> None:
    """`allocate_widths` as `--retained-layer-bits` uses it: layers of unequal bytes, K3-K6 or exact (None, cost 0,
    the BF16 bytes); the result equals the best of every allocation enumerated, within the budget, and among `offered`
    options alone the best of theirs; a budget below the narrowest choice is refused, naming what that takes."""
    rng = random.Random(1)
    options: tuple[int | None, ...] = (3, 4, 5, 6, None)
    for layers in range(1, 5):
        for _ in range(15):
            weights = {layer: rng.choice((1000, 1400, 2000)) for layer in range(layers)}
            nbytes = {
                layer: {k: w * (16 if k is None else k) // 8 + 64 for k in options} for layer, w in weights.items()
            }
            cost = {
                layer: {k: 0.0 if k is None else rng.uniform(1e-4, 1e-2) * 0.5 ** (k - 3) for k in options}
                for layer in weights
            }
            budget = sum(nbytes[layer][4] for layer in weights)  # uniform K4's bytes
            got = allocate_widths(cost, nbytes, budget)
            assert sum(nbytes[layer][k] for layer, k in got.items()) <= budget
            best = min(
                sum(cost[layer][k] for layer, k in zip(sorted(cost), choice))
                for choice in itertools.product(options, repeat=layers)
                if sum(nbytes[layer][k] for layer, k in zip(sorted(cost), choice)) <= budget
            )
            assert sum(cost[layer][k] for layer, k in got.items()) == pytest.approx(best, rel=1e-12)
            offered = (4, 6, None)  # a subset: chosen among those alone, the best of their allocations
            narrower = allocate_widths(cost, nbytes, budget, offered)
            assert set(narrower.values()) <= set(offered)
            best_offered = min(
                sum(cost[layer][k] for layer, k in zip(sorted(cost), choice))
                for choice in itertools.product(offered, repeat=layers)
                if sum(nbytes[layer][k] for layer, k in zip(sorted(cost), choice)) <= budget
            )
            assert sum(cost[layer][k] for layer, k in narrower.items()) == pytest.approx(best_offered, rel=1e-12)
    two = {0: {3: 1.0, None: 0.0}, 1: {3: 1.0, None: 0.0}}
    assert allocate_widths(two, {0: {3: 30, None: 160}, 1: {3: 30, None: 160}}, 190) == {0: None, 1: 3}  # ties: earlier
    with pytest.raises(UsageError, match="no width per layer fits 59 bytes \\(the narrowest take 60\\)"):
        allocate_widths(two, {0: {3: 30, None: 160}, 1: {3: 30, None: 160}}, 59)
    with pytest.raises(UsageError, match=r"no bytes given at \(layer, K\) \[\(1, None\)\]"):
        allocate_widths(two, {0: {3: 30, None: 160}, 1: {3: 30}}, 500)
