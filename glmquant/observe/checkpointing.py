"""Resumable observation: what survives a killed job, and how a rerun picks up where it stopped.

`state/progress.json` records the run's fingerprint, `next_layer` and whether that layer's results are
`committed`; the hidden streams live in `state/streams-LL/` (streams.py). Device streams (streams.py
`DeviceStreamStore`) live on the device and reach the disk only as checkpoints: `checkpoint` names the newest one
written whole, from which (or from the embeddings, where there is none) a rerun recomputes the streams entering
`next_layer` through the layers already done. Observing layer L is two passes:
the first runs every chunk of its input streams through the layer with the statistics and Hessians hooked on
(writing output chunks while they fit the stream budget), then saves the layer's results, each file atomically
(temp file, fsync, rename), and only then records committed = true; the second writes the output chunks still
missing and deletes each input chunk once its output exists, then records next_layer = L + 1. A job killed in
the first pass redoes it from the same inputs, which are all still there; one killed in the second pass goes on
with the chunks left. Chunk outputs are deterministic, so the results are byte-identical either way. A rerun
whose fingerprint differs (another model, token rows, Hessian mode, device, batch size, dtype, library version
or results sink) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmquant.checkpoint.writer import atomic_write_text, remove_temp_files
from glmquant.errors import UsageError

STATE_DIR = "state"
# in the fingerprint: the hash of the source's 1-D tensors (`vector_tensors_sha256`)
SOURCE_VECTORS_KEY = "source_vectors_sha256"
# and whether the run captures the MTP layer's Hessians
MTP_HESSIANS_KEY = "mtp_hessians"
# keys a state from before they were recorded resumes without (the rest of its fingerprint still has to match; a
# finished run stays without MTP Hessians, which `draft-head --mtp-bits` then asks for)
LATER_KEYS = (SOURCE_VECTORS_KEY, MTP_HESSIANS_KEY)


@dataclass(frozen=True)
class RunState:
    fingerprint: Mapping[str, Any]
    next_layer: int
    committed: bool  # next_layer's results are saved; only its streams remain to be advanced
    # device streams: the layer whose checkpoint (the streams entering it) is on disk whole; None: none is
    checkpoint: int | None = None


def state_dir(obs: Path) -> Path:
    return obs / STATE_DIR


def read_state(obs: Path) -> RunState | None:
    path = state_dir(obs) / "progress.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        next_layer = int(raw["next_layer"])
        # before checkpoints were named, a device-stream run recorded its progress only at one
        checkpoint = raw.get("checkpoint", next_layer)
        return RunState(
            raw["fingerprint"],
            next_layer,
            bool(raw.get("committed", False)),
            None if checkpoint is None else int(checkpoint),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: unreadable resume state ({exc}); delete {state_dir(obs)} to start over") from None


def resume_point(obs: Path, fingerprint: Mapping[str, Any]) -> RunState | None:
    """Where to continue, None for a fresh run; refuses a state made with other settings."""
    state = read_state(obs)
    if state is None:
        return None
    keys = set(state.fingerprint) | set(fingerprint)
    keys -= {k for k in LATER_KEYS if k not in state.fingerprint}
    changed = sorted(k for k in keys if state.fingerprint.get(k) != fingerprint.get(k))
    if changed:
        details = "; ".join(f"{k}: {state.fingerprint.get(k)!r} -> {fingerprint.get(k)!r}" for k in changed)
        raise UsageError(
            f"{obs}: holds an observation made with other settings ({details}); rerun with the "
            f"same settings, or use a new --out (or delete {state_dir(obs)} to start over)"
        )
    return state


def write_state(
    obs: Path, fingerprint: Mapping[str, Any], next_layer: int, committed: bool = False, checkpoint: int | None = None
) -> None:
    state_dir(obs).mkdir(parents=True, exist_ok=True)
    body = {
        "fingerprint": dict(fingerprint),
        "next_layer": next_layer,
        "committed": committed,
        "checkpoint": checkpoint,
    }
    atomic_write_text(state_dir(obs) / "progress.json", json.dumps(body, indent=2, sort_keys=True) + "\n")


def clean_stale(obs: Path) -> None:
    """Remove temp files a killed job left behind (they never replaced a real file)."""
    for directory in (obs, state_dir(obs), *state_dir(obs).glob("streams-*")):
        remove_temp_files(directory)
