"""lm_head's Hessian from `observe --dense-hessians` on a micro model (the small model's shape with one MoE layer of
128-wide experts): the final norm's output over every calibration token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from glmquant.calibration import TokenRows
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessian_reader import hessians_path, load_dense_hessian
from glmquant.observe.run import observe
from glmquant.observe.streaming import stream_final_hidden

MICRO = TinyModelConfig(num_hidden_layers=2, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=128)
HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def micro_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("micro-src"), MICRO)


@pytest.fixture(scope="module")
def micro_observations(micro_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("micro-obs")
    observe(ObserveConfig(source=micro_source, out=out, rows=4, tokens=64, dense_hessians=True))
    return out


def test_observe_captures_the_heads_input(micro_source: Path, micro_observations: Path) -> None:
    """`head.hessians.safetensors` holds Σ x xᵀ of lm_head's input over every token of the Hessian lanes: x the
    model's last hidden state (final norm after the streams' mean), as streaming the rows through the model gives."""
    path = hessians_path(micro_observations, None)
    assert path.name == "head.hessians.safetensors"
    with SourceCheckpoint.open(path) as f:
        assert set(f.names()) == {"dense.lm_head.weight.sum", "dense.lm_head.weight.count"}
        assert (f.headers[path.name].metadata or {})["layer"] == "head"
    rows = TokenRows.load(micro_observations)
    batch_rows = json.loads((micro_observations / "observations.json").read_text())["batch_rows"]
    lanes = [lane.ids for lane in rows.lanes if "hessians" in lane.use]
    x = torch.cat([stream_final_hidden(micro_source, ids, batch_rows=batch_rows) for ids in lanes])
    x = x.reshape(-1, MICRO.hidden_size).float()
    ids = torch.cat([ids.flatten() for ids in lanes])
    head = load_dense_hessian(micro_observations, None, HEAD)
    assert head.count == ids.numel()
    torch.testing.assert_close(head.sum, x.T @ x, rtol=1e-4, atol=1e-3)
