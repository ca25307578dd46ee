"""Pruning plans: top-N by REAP saliency per layer, deterministic ties, the format the encoder reads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.writer import write_safetensors
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.observe.prune import plan_pruning, write_prune_plan
from glmquant.observe.stats import SUMS, LayerStats


def _stats(count: list[int], gate_norm: list[float]) -> LayerStats:
    sums = {k: torch.zeros(len(count), dtype=torch.float64) for k in SUMS}
    sums["sum_gate_norm"] = torch.tensor(gate_norm, dtype=torch.float64)
    return LayerStats(sum(count) // 2, 2, torch.tensor(count), torch.zeros(len(count), dtype=torch.float64), sums)


def test_keeps_the_most_salient_experts() -> None:
    # saliency = sum_gate_norm / count: [1.0, 3.0, 0 (no tokens), 2.0, 3.0]
    stats = {5: _stats([2, 1, 0, 4, 2], [2.0, 3.0, 0.0, 8.0, 6.0])}
    plan = plan_pruning(stats, 3, "abc")
    (layer,) = plan.layers
    assert layer.keep == (1, 3, 4) and layer.drop == (0, 2)  # tie 1 vs 4 at 3.0: both kept; 0 and 2 go
    assert layer.kept_saliency_share == pytest.approx(8.0 / 9.0)
    assert plan_pruning(stats, 1, "abc").layers[0].keep == (1,)  # the tie keeps the lower id
    body = json.loads(plan.to_json())
    assert body["layers"] == {"5": [1, 3, 4]} and body["dropped"] == {"5": [0, 2]} and body["keep"] == 3


def test_bad_keep_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--keep 9"):
        plan_pruning({1: _stats([1, 1], [1.0, 1.0])}, 9, "abc")
    with pytest.raises(UsageError, match="no MoE layer"):
        plan_pruning({}, 1, "abc")


def test_fewer_experts_than_the_router_needs_are_refused(tiny_source: Path, tmp_path: Path) -> None:
    """The tiny model's router takes its top 2 of one group scored by its two best experts: a plan keeping one
    expert is refused naming the file (the encode would write an artifact no runtime can route), and `observe
    --keep 1` before it observes anything."""
    from glmquant.arch import load_model_spec
    from glmquant.encode.pruning import load_prune_plan
    from glmquant.observe.config import ObserveConfig
    from glmquant.observe.run import observe

    spec = load_model_spec(tiny_source)
    assert spec.min_kept_experts == 2
    # DeepSeek-V3's routing (8 groups, top-8): two in each group, 16 in all
    assert replace(spec, n_group=8, num_experts_per_tok=8, n_routed_experts=256).min_kept_experts == 16
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"keep": 1, "layers": {str(layer): [0] for layer in spec.moe_layers}}))
    with pytest.raises(UsageError, match=r"plan\.json: 1 kept experts per layer; the router needs 2 to 4"):
        load_prune_plan(path, spec)
    out = tmp_path / "obs"
    with pytest.raises(UsageError, match="--keep: 1 kept experts per layer"):
        observe(ObserveConfig(source=tiny_source, out=out, rows=2, tokens=16, keep=1))
    assert not out.exists()


def test_written_plan_is_what_the_encoder_loads(observed: Path, tmp_path: Path, tiny_source: Path) -> None:
    from glmquant.arch import load_model_spec
    from glmquant.encode.pruning import load_prune_plan

    path = write_prune_plan(observed, 3, tmp_path / "plan.json")
    layers = load_prune_plan(path, load_model_spec(tiny_source), expect_keep=3)
    assert sorted(k for k in layers if k < 3) == [1, 2] and all(len(v) == 3 for v in layers.values())
    assert (observed / "prune_plan.json").is_file()  # the observation itself was run with keep=2
    assert len(json.loads((observed / "prune_plan.json").read_text())["layers"]["2"]) == 2


def test_stats_round_trip_and_a_foreign_file_is_named(tmp_path: Path) -> None:
    stats = _stats([2, 1, 0], [2.0, 3.0, 0.0])
    stats.save(tmp_path / "layer-01.stats.safetensors")
    back = LayerStats.load(tmp_path / "layer-01.stats.safetensors")
    assert torch.equal(back.count, stats.count) and torch.equal(back.sums["sum_gate_norm"], stats.sums["sum_gate_norm"])
    write_safetensors(tmp_path / "other.safetensors", [TensorSpec("x", "F32", (1,))], lambda s: torch.zeros(1), {})
    with pytest.raises(CheckpointFormatError, match="other.safetensors: not an expert-statistics file"):
        LayerStats.load(tmp_path / "other.safetensors")
