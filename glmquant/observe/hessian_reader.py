"""What the encoder reads back: one layer's Hessians in one coverage mode, loaded one expert at a time.

The stacked per-expert sums of a GLM-5.3-Flash layer are ~24 GB, so `LayerHessians` holds only the file
path and the counts; `gate_up(e)` / `down(e)` read that expert's [n, n] slab. Format: hessians.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.checkpoint.reader import SourceCheckpoint, assert_finite
from glmquant.errors import CheckpointFormatError, NumericalError, UsageError
from glmquant.observe.hessians import FORMAT, HessianAccumulator, HessianMode
from glmquant.observe.tensor_file import read_rows
from glmquant.observe.tuning_sample import TENSORS, RoutedSample


def hessians_path(obs_dir: str | Path, layer: int | None) -> Path:
    """Decoder layer `layer`'s Hessians; layer None: lm_head's (its input, the final norm's output after the last
    decoder layer, is no layer's)."""
    return Path(obs_dir) / f"{'head' if layer is None else f'layer-{layer:02d}'}.hessians.safetensors"


@dataclass(frozen=True)
class Hessian:
    """Σ x xᵀ over `count` input rows of one linear (float32 [n, n])."""

    sum: torch.Tensor
    count: int

    def mean(self) -> torch.Tensor | None:
        """E[x xᵀ] as the encoder takes it; None when the linear saw no token."""
        return self.sum / self.count if self.count else None


@dataclass(frozen=True)
class LayerHessians:
    """Per-expert gate/up and down Hessians of one layer; in "all" mode gate/up is one shared matrix."""

    path: Path
    layer: int
    mode: HessianMode  # NATURAL or ALL
    gate_up_counts: torch.Tensor  # [E] int64 (all mode: the shared count repeated)
    down_counts: torch.Tensor  # [E] int64

    @property
    def n_experts(self) -> int:
        return self.down_counts.numel()

    def gate_up(self, expert: int) -> Hessian:
        name = f"{self.mode.value}.gate_up.sum"
        if self.mode is HessianMode.ALL:
            with SourceCheckpoint.open(self.path) as f:
                return Hessian(_finite(self.path, name, f.read_tensor(name)), int(self.gate_up_counts[expert]))
        hessian = _finite(self.path, f"{name}[{expert}]", read_rows(self.path, name, expert, expert + 1)[0])
        return Hessian(hessian, int(self.gate_up_counts[expert]))

    def sample(self) -> RoutedSample | None:
        """The layer's tuning sample (`observe --tuning-tokens`), None when the file holds none."""
        with SourceCheckpoint.open(self.path) as f:
            if TENSORS[0] not in f:
                return None
            found = [f.read_tensor(name) for name in TENSORS]
        for name, value in zip(TENSORS, found):
            _finite(self.path, name, value)
        return RoutedSample(*found)

    def down(self, expert: int) -> Hessian:
        name = f"{self.mode.value}.down.sum"
        hessian = _finite(self.path, f"{name}[{expert}]", read_rows(self.path, name, expert, expert + 1)[0])
        return Hessian(hessian, int(self.down_counts[expert]))


def _finite(path: Path, name: str, hessian: torch.Tensor) -> torch.Tensor:
    """`hessian` as read from `path`, or a NumericalError naming the file and tensor when it holds NaN or Inf: a
    damaged observation is refused, not encoded uncalibrated with a warning (Σ x xᵀ of finite activations, which
    observe checks, is finite)."""
    try:
        assert_finite(name, hessian)
    except NumericalError as exc:
        raise NumericalError(f"{path}: {exc}; observe again into a new directory to replace it") from None
    return hessian


def load_layer_hessians(obs_dir: str | Path, layer: int, mode: str | HessianMode) -> LayerHessians:
    """Open one layer's Hessians for `mode` ("natural" or "all"), checking the file holds that mode."""
    mode = HessianMode(mode)
    if mode not in (HessianMode.NATURAL, HessianMode.ALL):
        raise UsageError(f"load_layer_hessians reads one mode, 'natural' or 'all', not {mode.value!r}")
    path = hessians_path(obs_dir, layer)
    if not path.is_file():
        raise UsageError(f"{path}: no Hessians for layer {layer} (was observe run with --hessians?)")
    with SourceCheckpoint.open(path) as f:
        meta = f.headers[path.name].metadata or {}
        if meta.get("format") != FORMAT:
            raise UsageError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
        if f"{mode.value}.down.sum" not in f:
            raise UsageError(f"{path}: holds no {mode.value!r} Hessians (observed with --hessians {meta.get('mode')})")
        down = f.read_tensor(f"{mode.value}.down.count")
        gate_up = f.read_tensor(f"{mode.value}.gate_up.count")
        _check_square(path, f, mode, down.numel())
    if mode is HessianMode.ALL:
        gate_up = gate_up.expand(down.shape).clone()
    return LayerHessians(path, layer, mode, gate_up, down)


def _check_square(path: Path, f: SourceCheckpoint, mode: HessianMode, experts: int) -> None:
    """Each sum is a square matrix per expert (all mode: one gate/up matrix for the layer), or the file is damaged:
    refused naming it, not met later as the codec's complaint about a matrix of no file."""
    wanted = {
        f"{mode.value}.down.sum": (experts,),
        f"{mode.value}.gate_up.sum": () if mode is HessianMode.ALL else (experts,),
    }
    for name, lead in wanted.items():
        shape = tuple(f.spec(name).shape)
        if len(shape) != len(lead) + 2 or shape[: len(lead)] != lead or shape[-1] != shape[-2]:
            want = "[" + ", ".join([*map(str, lead), "n", "n"]) + "]"
            raise CheckpointFormatError(f"{path}: {name} has shape {list(shape)}, expected {want}")


def load_dense_hessian(obs_dir: str | Path, layer: int | None, weight_name: str) -> Hessian:
    """The Hessian of a dense linear (attention, shared expert, dense MLP; lm_head with layer None) by its checkpoint
    weight name."""
    path = hessians_path(obs_dir, layer)
    with SourceCheckpoint.open(path) as f:
        if f"dense.{weight_name}.sum" not in f:
            raise UsageError(f"{path}: no dense Hessian for {weight_name} (observe with --dense-hessians)")
        hessian = _finite(path, f"dense.{weight_name}.sum", f.read_tensor(f"dense.{weight_name}.sum"))
        return Hessian(hessian, int(f.read_tensor(f"dense.{weight_name}.count")))


class HeldHessians:
    """One layer's Hessians of one mode still in their accumulator (on its device), read like `LayerHessians`.

    The fused build hands these to the encoder, so Hessians never leave the device; the matrices are the
    accumulator's own sums, so the encoder sees exactly what it would read back from the file."""

    def __init__(self, acc: HessianAccumulator, mode: HessianMode) -> None:
        if mode not in (HessianMode.NATURAL, HessianMode.ALL) or f"{mode.value}.down" not in acc.sums:
            raise UsageError(f"the accumulator holds no {mode.value!r} Hessians (it was made for {acc.mode.value!r})")
        self.mode = mode
        self._gate_up, self._down = acc.sums[f"{mode.value}.gate_up"], acc.sums[f"{mode.value}.down"]
        self._gate_up_counts, self._down_counts = self._gate_up.count.tolist(), self._down.count.tolist()
        self._sample = None if acc.sampler is None else acc.sampler.result()

    def gate_up(self, expert: int) -> Hessian:
        if self.mode is HessianMode.ALL:
            return Hessian(self._gate_up.sum, int(self._gate_up.count))  # one shared count
        return Hessian(self._gate_up.sum[expert], self._gate_up_counts[expert])

    def down(self, expert: int) -> Hessian:
        return Hessian(self._down.sum[expert], self._down_counts[expert])

    def sample(self) -> RoutedSample | None:
        return self._sample
