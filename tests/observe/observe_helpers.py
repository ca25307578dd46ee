"""The observation settings the observe tests share (small enough for CI: 4 rows x 32 tokens)."""

from __future__ import annotations

from pathlib import Path

from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessians import HessianMode

ROWS, TOKENS, BATCH = 4, 32, 2


def observe_config(source: Path, out: Path, **changes) -> ObserveConfig:
    base = dict(rows=ROWS, tokens=TOKENS, hessians=HessianMode.BOTH, dense_hessians=True, keep=2, batch_rows=BATCH)
    return ObserveConfig(source, out, **{**base, **changes})
