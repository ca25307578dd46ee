"""Facts of per-expert bit widths (tiers) that the plan, the manifest and the verifier share: the tier bitmap's
hash, the experts per width, the mean width."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence


def tier_bitmap_sha256(expert_bits: Mapping[int, Sequence[int]]) -> str:
    """Hash of the bits of every output expert per quantized layer (compact JSON, layers ascending)."""
    rows = {str(layer): list(bits) for layer, bits in sorted(expert_bits.items())}
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def layer_tier_counts(expert_bits: Mapping[int, Sequence[int]]) -> dict[int, dict[int, int]]:
    """Experts per bit width of each layer (layers and widths ascending)."""
    return {layer: {b: list(bits).count(b) for b in sorted(set(bits))} for layer, bits in sorted(expert_bits.items())}


def tier_counts(expert_bits: Mapping[int, Sequence[int]]) -> dict[int, int | None]:
    """Experts per bit width in each layer, None for a width whose count differs between layers (tiers by layer,
    `depth`, `share` and `layers`, give whole layers different widths; `reap` tiers give every layer the same
    counts)."""
    per_layer = layer_tier_counts(expert_bits).values()
    widths = sorted({b for counts in per_layer for b in counts})
    found = {b: {counts.get(b, 0) for counts in per_layer} for b in widths}
    return {b: next(iter(n)) if len(n) == 1 else None for b, n in found.items()}


def tiers_differ_by_layer(expert_bits: Mapping[int, Sequence[int]]) -> bool:
    return None in tier_counts(expert_bits).values()


def tiers_by_layer(expert_bits: Mapping[int, Sequence[int]]) -> dict[str, dict[str, int]]:
    """`tier_experts_by_layer` of the config block and the manifest (written only when tiers differ by layer):
    {"<layer>": {"k<K>": experts}}."""
    return {str(layer): {f"k{b}": n for b, n in c.items()} for layer, c in layer_tier_counts(expert_bits).items()}


def mean_bits(expert_bits: Mapping[int, Sequence[int]]) -> float:
    flat = [b for bits in expert_bits.values() for b in bits]
    return sum(flat) / len(flat)
