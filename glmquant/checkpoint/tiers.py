"""Facts of per-expert bit widths (tiers) that the plan, the manifest and the verifier share: the tier bitmap's
hash, the experts per width, the mean width."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from glmquant.errors import UsageError


def tier_bitmap_sha256(expert_bits: Mapping[int, Sequence[int]]) -> str:
    """Hash of the bits of every output expert per quantized layer (compact JSON, layers ascending)."""
    rows = {str(layer): list(bits) for layer, bits in sorted(expert_bits.items())}
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def tier_counts(expert_bits: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Experts per bit width in each layer; every layer must have the same counts (a tier spec gives that)."""
    per_layer = {tuple(sorted((b, list(bits).count(b)) for b in set(bits))) for bits in expert_bits.values()}
    if len(per_layer) != 1:
        raise UsageError(f"tier counts differ between layers: {sorted(per_layer)}")
    return dict(per_layer.pop())


def mean_bits(expert_bits: Mapping[int, Sequence[int]]) -> float:
    flat = [b for bits in expert_bits.values() for b in bits]
    return sum(flat) / len(flat)
