"""bench_tuning.py on a real unit: the tiny model's first MoE layer, observed with a token sample, one unit encoded
as `glmquant encode` does and its scales tuned from those codes at two learning rates, each step's held-out error
recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from glmquant.arch import load_model_spec
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6

pytestmark = pytest.mark.slow


def test_real_unit_convergence_record(tiny_source: Path, tmp_path: Path) -> None:
    observations = tmp_path / "obs"
    observe(ObserveConfig(source=tiny_source, out=observations, rows=4, tokens=32, tuning_tokens=64))
    layer = load_model_spec(tiny_source).moe_layers[0]
    out = tmp_path / "tuning.json"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_tuning.py"), "--device", "cpu", "--source", str(tiny_source)]
    argv += ["--observations", str(observations), "--layer", str(layer), "--experts-per-unit", "2"]
    argv += ["--steps", str(STEPS), "--learning-rates", "2e-3,2e-2", "--out", str(out)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["mode"] == "real_unit" and record["layer"] == layer and record["experts"] == 2
    assert record["bits"] == [2] and record["unit_expert_token_pairs"] > 0
    slow, fast = record["runs"]
    assert (slow["learning_rate"], fast["learning_rate"]) == (2e-3, 2e-2)
    assert slow["heldout_by_step"][0] == fast["heldout_by_step"][0]  # the same codes and scales to start from
    for r in (slow, fast):
        curve = r["heldout_by_step"]
        assert len(curve) == STEPS + 1 and r["heldout_after"] == min(curve) == curve[r["best_step"]]
    best = min((slow, fast), key=lambda r: r["heldout_after"])
    assert best["heldout_after"] < best["heldout_before"] and best["step_to_99pct"] <= best["best_step"]
