"""The hidden streams between decoder layers, on disk: one file per (layer, lane, chunk of `batch_rows` rows).

`state/streams-LL/<lane>-CCCCC.safetensors` holds tensor `hidden` [rows, T, hc, H] (model dtype, BF16 for
GLM-5.3-Flash): chunk C of a lane, entering layer LL. A chunk is the rows one forward step takes, so reading one
is reading one file, and a chunk that is dead (its layer's results are saved and its output chunk written) is
deleted at once. Only live streams stay on disk: the inputs of the layer being observed plus the outputs
written so far; `budget_bytes` caps the two together (see run.py for how the run keeps under it).
"""

from __future__ import annotations

import shutil
import threading
import time
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
    one layer's streams S plus one chunk. A killed process loses them, so `start_checkpoint(layer)` writes the
    streams entering `layer` to the same files a disk run uses, on a thread of its own while the run goes on with
    work that leaves them alone (a build's encode of the layer before), and `finish_checkpoint()` waits for it
    before they are dropped (the run then records that layer's checkpoint and deletes the older one);
    `restore(layer)` reads them back, for a resumed run to recompute its streams from.
    """

    in_memory = True

    def __init__(self, *args, device: torch.device, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.held: dict[tuple[int, str, int], torch.Tensor] = {}
        self.writer: CheckpointWriter | None = None
        self.checkpointed: int | None = None  # the layer of the last checkpoint finished or restored
        self.deleting: threading.Thread | None = None  # older checkpoints being deleted

    def has(self, layer: int, chunk: Chunk) -> bool:
        return (layer, chunk.lane, chunk.index) in self.held

    def read(self, layer: int, chunk: Chunk) -> torch.Tensor:
        return self.held[(layer, chunk.lane, chunk.index)]

    def write(self, layer: int, chunk: Chunk, streams: torch.Tensor) -> None:
        self.held[(layer, chunk.lane, chunk.index)] = streams.to(self.device)

    def drop(self, layer: int, chunk: Chunk) -> None:
        if layer == self.checkpointing:
            raise RuntimeError(f"the streams entering layer {layer} are still being written to their checkpoint")
        self.held.pop((layer, chunk.lane, chunk.index), None)

    def drop_layer(self, layer: int) -> None:
        for chunk in self.chunks:
            self.drop(layer, chunk)

    def fits(self, chunk: Chunk) -> bool:
        return True

    def start_checkpoint(self, layer: int) -> None:
        """Begin writing the held streams entering `layer` to disk (chunk files, as a disk run has them) while the
        caller goes on. Every other checkpoint but the last finished one (`checkpointed`) is deleted first."""
        if self.writer is not None:
            raise RuntimeError(f"the checkpoint of layer {self.writer.layer} was never finished")
        self.drop_checkpoints(self.checkpointed)
        self.writer = CheckpointWriter(self, layer)  # registered before it starts: an interrupt here still stops it
        self.writer.start()

    @property
    def checkpointing(self) -> int | None:
        """The layer whose checkpoint is under way, if any."""
        return None if self.writer is None else self.writer.layer

    def finish_checkpoint(self) -> tuple[int, float]:
        """Wait for the checkpoint under way; its bytes and the seconds its writer took. Raises the writer's error
        (a full disk names the chunk file); the writer stays registered until it is done, so an interrupted wait
        still lets `cancel_checkpoint` stop it."""
        assert self.writer is not None, "no checkpoint under way"
        seconds = self.writer.join()
        self.checkpointed, self.writer = self.writer.layer, None
        return self.layer_bytes, seconds

    def cancel_checkpoint(self) -> BaseException | None:
        """Stop the checkpoint under way, if any, after the chunk being written (it is left unfinished), and wait
        for a deletion under way; the writer's own error, if it had one."""
        self._wait_for_deletion()
        if self.writer is None:
            return None
        error = self.writer.cancel()
        self.writer = None  # only once stopped: a second interrupt during the wait still finds it
        return error

    def has_checkpoint(self, layer: int) -> bool:
        """Whether every chunk file of the checkpoint of `layer` is on disk."""
        return all(StreamStore.has(self, layer, chunk) for chunk in self.chunks)

    def restore(self, layer: int) -> None:
        """Hold the streams entering `layer` from its checkpoint files."""
        for chunk in self.chunks:
            self.held[(layer, chunk.lane, chunk.index)] = super().read(layer, chunk).to(self.device)
        self.checkpointed = layer

    def drop_checkpoints(self, keep: int | None = None, wait: bool = True) -> None:
        """Delete every checkpoint on disk but the one of layer `keep`; `wait` False: on a thread of its own (tens of
        GB of files take seconds to delete), which the next deletion or `cancel_checkpoint` waits for."""
        self._wait_for_deletion()
        doomed = [d for d in self.state.glob("streams-*") if keep is None or d != self.directory(keep)]
        if wait:
            _delete(doomed)
        else:
            self.deleting = threading.Thread(target=_delete, args=(doomed,), name="streams-checkpoint-delete")
            self.deleting.start()

    def _wait_for_deletion(self) -> None:
        if self.deleting is not None:
            self.deleting.join()
            self.deleting = None


class CheckpointWriter:
    """Writes the streams `store` holds for `layer` to its chunk files on a thread, chunk by chunk. On CUDA the copies
    to the host run on a stream of their own, after the work queued before the checkpoint began, so they overlap the
    run's kernels."""

    def __init__(self, store: DeviceStreamStore, layer: int) -> None:
        self.layer = layer
        self._files = [(chunk, store.read(layer, chunk)) for chunk in store.chunks]
        self._store = store
        self._error: BaseException | None = None
        self._seconds = 0.0
        self._cancelled = threading.Event()
        self._copies: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None
        if store.device.type == "cuda":
            self._copies = torch.cuda.Stream(store.device)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(store.device))
        self._thread = threading.Thread(target=self._run, name=f"streams-checkpoint-{layer:02d}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for chunk, streams in self._files:
                if self._cancelled.is_set():
                    return
                StreamStore.write(self._store, self.layer, chunk, self._on_host(streams))
        except BaseException as err:  # noqa: BLE001 (handed to the run's thread, which raises it at `join`)
            self._error = err
        finally:
            self._seconds = time.monotonic() - started
            self._files = []  # a failed writer's error, kept until the run raises it, must not hold the streams

    def _on_host(self, streams: torch.Tensor) -> torch.Tensor:
        if self._copies is None or self._ready is None:
            return streams
        with torch.cuda.stream(self._copies):
            self._copies.wait_event(self._ready)
            host = streams.to("cpu")
        self._copies.synchronize()
        return host

    def join(self) -> float:
        """Until every chunk is on disk; the seconds the writer took. Raises the writer's error."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._seconds

    def cancel(self) -> BaseException | None:
        """Stop after the chunk being written (the run failed or was interrupted: the checkpoint is never recorded,
        and a later run deletes it); the writer's own error, if it had one."""
        self._cancelled.set()
        self._thread.join()
        return self._error


def _delete(directories: list[Path]) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
