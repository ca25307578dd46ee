"""Wall time per encoder stage, for benchmarks: nothing is measured (and nothing synchronized) unless a caller
opens `record_stages()`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_totals: dict[str, float] | None = None


@contextmanager
def record_stages() -> Iterator[dict[str, float]]:
    """Collect seconds per stage name while the block runs (GPU work synchronized at each stage boundary)."""
    global _totals
    previous, _totals = _totals, {}
    try:
        yield _totals
    finally:
        _totals = previous


@contextmanager
def stage(name: str, device: torch.device) -> Iterator[None]:
    if _totals is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _totals[name] = _totals.get(name, 0.0) + time.perf_counter() - start
