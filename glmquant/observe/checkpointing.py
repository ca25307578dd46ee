"""Resumable observation: what survives a killed job, and how a rerun picks up from the last finished layer.

`state/progress.json` records the run's fingerprint and `next_layer`; `state/input-<lane>-LL.safetensors`
holds the hidden streams [rows, T, hc, H] entering layer LL. Finishing layer L writes, each atomically
(temp file, fsync, rename): its stats and Hessians, the streams entering L+1, and only then progress.json
with next_layer = L+1, after which the streams entering L are deleted. A job killed anywhere therefore
restarts layer L from the same inputs and writes byte-identical files. A rerun whose fingerprint differs
(another model, token rows, Hessian mode, device, batch size, dtype or library version) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import atomic_write_text, remove_temp_files, write_safetensors
from glmquant.errors import UsageError
from glmquant.observe.tensor_file import chunk_streamer, read_rows

STATE_DIR = "state"
HIDDEN = "hidden"


@dataclass(frozen=True)
class RunState:
    fingerprint: Mapping[str, Any]
    next_layer: int


def state_dir(obs: Path) -> Path:
    return obs / STATE_DIR


def hidden_path(obs: Path, lane: str, layer: int) -> Path:
    return state_dir(obs) / f"input-{lane}-{layer:02d}.safetensors"


def read_state(obs: Path) -> RunState | None:
    path = state_dir(obs) / "progress.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return RunState(raw["fingerprint"], int(raw["next_layer"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: unreadable resume state ({exc}); delete {state_dir(obs)} to start over") from None


def resume_point(obs: Path, fingerprint: Mapping[str, Any]) -> int | None:
    """The layer to continue from, None for a fresh run; refuses a state made with other settings."""
    state = read_state(obs)
    if state is None:
        return None
    changed = sorted(k for k in set(state.fingerprint) | set(fingerprint)
                     if state.fingerprint.get(k) != fingerprint.get(k))
    if changed:
        details = "; ".join(f"{k}: {state.fingerprint.get(k)!r} -> {fingerprint.get(k)!r}" for k in changed)
        raise UsageError(f"{obs}: holds an observation made with other settings ({details}); rerun with the "
                         f"same settings, or use a new --out (or delete {state_dir(obs)} to start over)")
    return state.next_layer


def write_state(obs: Path, fingerprint: Mapping[str, Any], next_layer: int) -> None:
    state_dir(obs).mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": dict(fingerprint), "next_layer": next_layer}
    atomic_write_text(state_dir(obs) / "progress.json", json.dumps(body, indent=2, sort_keys=True) + "\n")


def clean_stale(obs: Path) -> None:
    """Remove temp files a killed job left behind (they never replaced a real file)."""
    for directory in (obs, state_dir(obs)):
        remove_temp_files(directory)


def drop_hidden(obs: Path, layer: int) -> None:
    for path in state_dir(obs).glob(f"input-*-{layer:02d}.safetensors"):
        path.unlink()


def write_hidden(path: Path, shape: tuple[int, ...], dtype: torch.dtype, batches: Iterable[torch.Tensor]) -> None:
    """Stream the batches (consecutive rows, consumed lazily) into one [rows, ...] tensor file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    spec = TensorSpec(HIDDEN, dtype_name(torch.empty(0, dtype=dtype)), tuple(shape))
    write_safetensors(path, [spec], lambda _: chunk_streamer(batches))


def read_hidden(path: Path, start: int, stop: int) -> torch.Tensor:
    return read_rows(path, HIDDEN, start, stop)
