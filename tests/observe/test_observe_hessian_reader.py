"""The Hessian reader the encoder uses: one mode at a time, one expert at a time, clear errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from glmquant.errors import UsageError
from glmquant.observe.hessian_reader import Hessian, hessians_path, load_dense_hessian, load_layer_hessians
from glmquant.observe.hessians import HessianAccumulator, HessianMode


def test_natural_and_all_modes(observed: Path) -> None:
    natural = load_layer_hessians(observed, 1, "natural")
    everything = load_layer_hessians(observed, 1, HessianMode.ALL)
    assert natural.n_experts == everything.n_experts == 4
    assert int(natural.gate_up_counts.sum()) == 2 * int(everything.gate_up_counts[0])  # top-2 routing
    h = natural.gate_up(2)
    assert h.sum.shape == (128, 128) and h.sum.dtype == torch.float32 and h.count == natural.gate_up_counts[2]
    torch.testing.assert_close(h.mean(), h.sum / h.count)
    assert natural.down(2).sum.shape == (512, 512)
    assert Hessian(torch.eye(2), 0).mean() is None


def test_reader_errors(observed: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="one mode"):
        load_layer_hessians(observed, 1, "both")
    with pytest.raises(UsageError, match="no Hessians for layer 7"):
        load_layer_hessians(observed, 7, "natural")
    with pytest.raises(UsageError, match="dense-hessians"):
        load_dense_hessian(observed, 1, "no.such.weight")
    only_natural = HessianAccumulator(HessianMode.NATURAL, 2, 4, 8)
    only_natural.add_natural(0, torch.ones(3, 4), torch.ones(3, 8))
    only_natural.save(hessians_path(tmp_path, 1), 1)
    with pytest.raises(UsageError, match="holds no 'all'"):
        load_layer_hessians(tmp_path, 1, "all")
    shutil.copy(observed / "layer-01.stats.safetensors", hessians_path(tmp_path, 2))
    with pytest.raises(UsageError, match="not a glmquant.hessians.v1"):
        load_layer_hessians(tmp_path, 2, "natural")


def test_accumulator_sums_in_float32() -> None:
    acc = HessianAccumulator(HessianMode.BOTH, 3, 4, 2)
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    acc.add_natural(1, x, x[:, :2])
    acc.add_natural(1, x[:1], x[:1, :2])
    acc.add_all_gate_up(x)
    natural = acc.sums["natural.gate_up"]
    assert natural.count.tolist() == [0, 4, 0]
    torch.testing.assert_close(natural.sum[1], x.float().T @ x.float() + x[:1].float().T @ x[:1].float())
    assert acc.sums["all.gate_up"].count.item() == 3 and not acc.empty
    assert HessianAccumulator(HessianMode.NONE, 3, 4, 2).empty
