"""The hidden streams between decoder layers, on disk: one file per (layer, lane, chunk of `batch_rows` rows).

`state/streams-LL/<lane>-CCCCC.safetensors` holds tensor `hidden` [rows, T, hc, H] (model dtype, BF16 for
GLM-5.3-Flash): chunk C of a lane, entering layer LL. A chunk is the rows one forward step takes, so reading one
is reading one file, and a chunk that is dead (its layer's results are saved and its output chunk written) is
deleted at once. Only live streams stay on disk: the inputs of the layer being observed plus the outputs
written so far; `budget_bytes` caps the two together (see run.py for how the run keeps under it).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.checkpoint.safetensors_format import TensorSpec, file_size
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import write_safetensors
from glmquant.errors import UsageError
from glmquant.observe.tensor_file import read_rows

HIDDEN = "hidden"


@dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of one calibration lane."""

    lane: str
    index: int
    start: int
    stop: int


class StreamStore:
    """The stream chunk files of one observation directory."""

    in_memory = False

    def __init__(
        self,
        state: Path,
        lanes: Sequence[tuple[str, int, int]],
        batch_rows: int,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        budget_bytes: int | None,
    ) -> None:
        """`lanes`: (name, rows, tokens) in recipe order; `row_shape`: (hc, H) of one token."""
        self.state, self.row_shape, self.dtype, self.budget_bytes = state, row_shape, dtype, budget_bytes
        self.tokens = {name: tokens for name, _, tokens in lanes}
        self.chunks = [
            Chunk(name, i, start, min(start + batch_rows, rows))
            for name, rows, _ in lanes
            for i, start in enumerate(range(0, rows, batch_rows))
        ]
        largest = max((self.chunk_bytes(c) for c in self.chunks), default=0)
        if budget_bytes is not None and budget_bytes < self.layer_bytes + largest:
            raise UsageError(
                f"--stream-budget-gb {budget_bytes / 1e9:.3f} is below one layer's hidden streams plus "
                f"one chunk ({(self.layer_bytes + largest) / 1e9:.3f} GB); raise it or use fewer rows"
            )

    def _spec(self, chunk: Chunk) -> TensorSpec:
        shape = (chunk.stop - chunk.start, self.tokens[chunk.lane], *self.row_shape)
        return TensorSpec(HIDDEN, dtype_name(torch.empty(0, dtype=self.dtype)), shape)

    def chunk_bytes(self, chunk: Chunk) -> int:
        return file_size([self._spec(chunk)])

    @property
    def layer_bytes(self) -> int:
        """Disk taken by the streams entering one layer (every chunk of every lane)."""
        return sum(self.chunk_bytes(c) for c in self.chunks)

    def directory(self, layer: int) -> Path:
        return self.state / f"streams-{layer:02d}"

    def path(self, layer: int, chunk: Chunk) -> Path:
        return self.directory(layer) / f"{chunk.lane}-{chunk.index:05d}.safetensors"

    def has(self, layer: int, chunk: Chunk) -> bool:
        return self.path(layer, chunk).is_file()

    def read(self, layer: int, chunk: Chunk) -> torch.Tensor:
        return read_rows(self.path(layer, chunk), HIDDEN, 0, chunk.stop - chunk.start)

    def write(self, layer: int, chunk: Chunk, streams: torch.Tensor) -> None:
        self.directory(layer).mkdir(parents=True, exist_ok=True)
        write_safetensors(self.path(layer, chunk), [self._spec(chunk)], lambda _: streams)

    def drop(self, layer: int, chunk: Chunk) -> None:
        self.path(layer, chunk).unlink(missing_ok=True)

    def drop_layer(self, layer: int) -> None:
        shutil.rmtree(self.directory(layer), ignore_errors=True)

    def on_disk(self) -> int:
        """Bytes of every stream chunk file now on disk."""
        return sum(p.stat().st_size for p in self.state.glob("streams-*/*.safetensors"))

    def fits(self, chunk: Chunk) -> bool:
        """Whether writing `chunk` keeps the streams within the budget."""
        return self.budget_bytes is None or self.on_disk() + self.chunk_bytes(chunk) <= self.budget_bytes


class DeviceStreamStore(StreamStore):
    """The same chunks held as tensors on the observing device (RAM on cpu): no file per chunk, no disk traffic.

    A chunk's output replaces its input as soon as it is computed (rows are independent sequences), so memory is
    one layer's streams S plus one chunk. A killed process loses them, so `checkpoint(layer)` writes the streams
    entering `layer` to the same files a disk run uses (the run records that layer as its resume point) and
    `restore(layer)` reads them back; only the newest checkpoint is kept on disk.
    """

    in_memory = True

    def __init__(self, *args, device: torch.device, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.held: dict[tuple[int, str, int], torch.Tensor] = {}

    def has(self, layer: int, chunk: Chunk) -> bool:
        return (layer, chunk.lane, chunk.index) in self.held

    def read(self, layer: int, chunk: Chunk) -> torch.Tensor:
        return self.held[(layer, chunk.lane, chunk.index)]

    def write(self, layer: int, chunk: Chunk, streams: torch.Tensor) -> None:
        self.held[(layer, chunk.lane, chunk.index)] = streams.to(self.device)

    def drop(self, layer: int, chunk: Chunk) -> None:
        self.held.pop((layer, chunk.lane, chunk.index), None)

    def drop_layer(self, layer: int) -> None:
        for key in [k for k in self.held if k[0] == layer]:
            del self.held[key]

    def fits(self, chunk: Chunk) -> bool:
        return True

    def checkpoint(self, layer: int) -> int:
        """Write the held streams entering `layer` to disk (chunk files, as a disk run has them); returns bytes."""
        for chunk in self.chunks:
            super().write(layer, chunk, self.read(layer, chunk))
        return self.layer_bytes

    def restore(self, layer: int) -> None:
        """Hold the streams entering `layer` from its checkpoint files."""
        for chunk in self.chunks:
            self.held[(layer, chunk.lane, chunk.index)] = super().read(layer, chunk).to(self.device)

    def drop_checkpoints(self, keep: int | None = None) -> None:
        """Delete every checkpoint on disk but the one of layer `keep`."""
        for directory in self.state.glob("streams-*"):
            if keep is None or directory != self.directory(keep):
                shutil.rmtree(directory, ignore_errors=True)
