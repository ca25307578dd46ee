"""The resumable job state: which layers are finished, swapped in atomically after each one.

A killed job leaves at most one layer half done; its files were written under temporary names, so the
rerun (same command) redoes that layer and, because encoding is deterministic (one seed, no dependence on
the order or batching of the work), the finished artifact is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import UsageError

STATE_NAME = "encode-state.json"


@dataclass
class EncodeState:
    path: Path
    fingerprint: str
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer -> its summary
    retained_done: bool = False

    @classmethod
    def load_or_new(cls, work_dir: Path, fingerprint: str) -> EncodeState:
        path = work_dir / STATE_NAME
        if not path.exists():
            work_dir.mkdir(parents=True, exist_ok=True)
            return cls(path, fingerprint)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: unreadable job state ({exc}); delete the work dir to start over") from None
        if not isinstance(data, dict) or data.get("fingerprint") != fingerprint:
            raise UsageError(
                f"{path} belongs to a job with other inputs or options (or one begun by a glmquant whose encoder "
                f"defaults differ); rerun the same command with that version, or give another --work-dir (or delete "
                f"it) to start over"
            )
        return cls(path, fingerprint, data.get("layers", {}), data.get("retained_done", False))

    def finish_layer(self, layer: int, summary: dict[str, Any]) -> None:
        self.layers[str(layer)] = summary
        self.save()

    def finish_retained(self) -> None:
        self.retained_done = True
        self.save()

    def save(self) -> None:
        data = {"fingerprint": self.fingerprint, "layers": self.layers, "retained_done": self.retained_done}
        atomic_write_text(self.path, json.dumps(data, indent=2, sort_keys=True) + "\n")
