"""`model.safetensors.index.json`: which shard holds each tensor, plus the total tensor bytes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import CheckpointFormatError

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class SafetensorsIndex:
    """`total_size` is the sum of tensor data bytes (headers excluded), as transformers writes it."""

    weight_map: Mapping[str, str]
    total_size: int

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def index_text(index: SafetensorsIndex) -> str:
    """Deterministic serialization: sorted keys, two-space indent, trailing newline."""
    body = {"metadata": {"total_size": index.total_size}, "weight_map": dict(index.weight_map)}
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


def write_index(path: str | Path, index: SafetensorsIndex) -> None:
    atomic_write_text(path, index_text(index))


def read_index(path: str | Path) -> SafetensorsIndex:
    """Parse an index, rejecting anything but plain shard file names (no directories, no '..')."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFormatError(f"{path}: 'weight_map' must map tensor names to shard file names")
    bad = sorted(v for v in set(weight_map.values()) if Path(v).name != v or v in ("", ".", ".."))
    if bad:
        raise CheckpointFormatError(f"{path}: shard names must be plain file names, got {bad[:3]}")
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointFormatError(f"{path}: 'metadata' must be an object, got {type(metadata).__name__}")
    total = metadata.get("total_size", 0)
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise CheckpointFormatError(f"{path}: metadata.total_size must be a non-negative integer, got {total!r}")
    return SafetensorsIndex(weight_map, total)
