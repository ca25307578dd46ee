"""The observation settings the observe tests share (small enough for CI: 4 rows x 32 tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.observe import run
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessians import HessianMode

ROWS, TOKENS, BATCH = 4, 32, 2


def observe_config(source: Path, out: Path, **changes) -> ObserveConfig:
    base = dict(rows=ROWS, tokens=TOKENS, hessians=HessianMode.BOTH, dense_hessians=True, keep=2, batch_rows=BATCH)
    return ObserveConfig(source, out, **{**base, **changes})


def killed_at_layer_2(monkeypatch: pytest.MonkeyPatch, job: ObserveConfig) -> None:
    """Run `observe(job)` until it is killed as it starts layer 2 (a KeyboardInterrupt is what a kill looks like
    to the code that was running); the observing pass is the real one again afterwards."""
    original = run._observe_pass

    def dies_at_layer_2(model, rows, config, streams, layer, *rest):
        if layer == 2:
            raise KeyboardInterrupt
        return original(model, rows, config, streams, layer, *rest)

    monkeypatch.setattr(run, "_observe_pass", dies_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        run.observe(job)
    monkeypatch.setattr(run, "_observe_pass", original)
