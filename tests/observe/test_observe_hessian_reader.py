"""The Hessian reader the encoder uses: one mode at a time, one expert at a time, clear errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from glmquant.errors import CheckpointFormatError, UsageError
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


def _poisoned(observed: Path, obs_dir: Path, name: str, row: int, value: float) -> Path:
    """A copy of layer 1's Hessians with element [row, 0, 1] (or [0, 1] of an unstacked matrix) of `name` set."""
    from glmquant.checkpoint.reader import SourceCheckpoint

    obs_dir.mkdir()
    path = Path(shutil.copy(hessians_path(observed, 1), hessians_path(obs_dir, 1)))
    with SourceCheckpoint.open(path) as f:
        begin, _ = f.headers[path.name].span(name)
        shape = f.spec(name).shape
    offset = begin + 4 * ((row * shape[-2] * shape[-1] if len(shape) == 3 else 0) + 1)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(torch.tensor([value], dtype=torch.float32).numpy().tobytes())
    return path


def test_a_non_finite_hessian_is_named_with_its_file(observed: Path, tmp_path: Path) -> None:
    """A NaN or Inf in a Hessian file is a NumericalError naming the file, the tensor and the expert (it used to be
    encoded uncalibrated with a warning naming only the weight, and the encode exited 0); the other experts read."""
    from glmquant.errors import NumericalError

    path = _poisoned(observed, tmp_path / "a", "natural.gate_up.sum", 2, float("nan"))
    natural = load_layer_hessians(path.parent, 1, "natural")
    with pytest.raises(NumericalError, match=re.escape(f"{path}: tensor natural.gate_up.sum[2] has 1 non-finite")):
        natural.gate_up(2)
    assert natural.gate_up(1).sum.isfinite().all() and natural.down(2).sum.isfinite().all()
    path = _poisoned(observed, tmp_path / "b", "all.down.sum", 3, float("-inf"))
    with pytest.raises(NumericalError, match=re.escape(f"{path}: tensor all.down.sum[3] has 1 non-finite")):
        load_layer_hessians(path.parent, 1, "all").down(3)
    path = _poisoned(observed, tmp_path / "c", "all.gate_up.sum", 0, float("inf"))  # one matrix shared by all
    with pytest.raises(NumericalError, match=re.escape(f"{path}: tensor all.gate_up.sum has 1 non-finite")):
        load_layer_hessians(path.parent, 1, "all").gate_up(0)
    dense = next(n for n in _tensor_names(hessians_path(observed, 1)) if n.startswith("dense.") and n.endswith(".sum"))
    path = _poisoned(observed, tmp_path / "d", dense, 0, float("nan"))
    with pytest.raises(NumericalError, match=re.escape(f"{path}: tensor {dense} has 1 non-finite")):
        load_dense_hessian(path.parent, 1, dense.removeprefix("dense.").removesuffix(".sum"))


def _tensor_names(path: Path) -> list[str]:
    from glmquant.checkpoint.reader import SourceCheckpoint

    with SourceCheckpoint.open(path) as f:
        return f.names()


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


@pytest.mark.parametrize(
    "mode, name, shape", [("natural", "natural.gate_up.sum", [4, 64, 256]), ("all", "all.down.sum", [4, 1024, 256])]
)
def test_a_hessian_of_the_wrong_shape_is_named_with_its_file(
    observed: Path, tmp_path: Path, mode: str, name: str, shape: list[int]
) -> None:
    """A sum relabelled to a non-square shape (same bytes) is refused when the layer is opened, naming the file and
    the tensor (it surfaced as the codec's complaint about a matrix of no file)."""
    obs_dir = tmp_path / "obs"
    shutil.copytree(observed, obs_dir)
    path = hessians_path(obs_dir, 1)
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header[name]["shape"] = shape
    text = json.dumps(header, separators=(",", ":")).encode()
    data[8 : 8 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=re.escape(f"{path}: {name} has shape {shape}, expected [")):
        load_layer_hessians(obs_dir, 1, mode)
