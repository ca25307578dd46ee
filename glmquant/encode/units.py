"""Finished work units on disk: one safetensors file per (layer, unit) in the job's work dir, written atomically.

A unit file holds the unit's EXL3 parts and, in its metadata, each tensor's report. It is what ranks of a
distributed job hand to rank 0, and what a resumed job reuses; rank 0 deletes a layer's unit files once the
artifact files holding that layer are written.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from safetensors import safe_open
from safetensors.torch import save

from glmquant.checkpoint.writer import atomic_write_bytes
from glmquant.encode.layer import EncodedLayer, TensorReport, TuningReport

FORMAT = "glmquant.encode_unit.v1"


class UnitStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, layer: int, unit: int) -> Path:
        return self.directory / f"layer-{layer:03d}-unit-{unit:03d}.safetensors"

    def has(self, layer: int, unit: int) -> bool:
        return self.path(layer, unit).is_file()

    def write(self, layer: int, unit: int, encoded: EncodedLayer, seconds: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        reports = [[r.name, r.proxy_error, r.fallback] for r in encoded.reports]
        meta = {"format": FORMAT, "reports": json.dumps(reports), "seconds": repr(seconds)}
        if encoded.tuning is not None:
            meta["tuning"] = json.dumps(dataclasses.asdict(encoded.tuning))
        tensors = {k: v.contiguous() for k, v in encoded.tensors.items()}
        atomic_write_bytes(self.path(layer, unit), save(tensors, metadata=meta))

    def read(self, layer: int, unit: int) -> tuple[EncodedLayer, float]:
        path = self.path(layer, unit)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not an encode unit file")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has keys() but no __iter__
        reports = [TensorReport(name, float(err), fallback) for name, err, fallback in json.loads(meta["reports"])]
        tuning = None
        if "tuning" in meta:
            fields = json.loads(meta["tuning"])
            tuning = TuningReport(**{**fields, "heldout_by_step": tuple(fields["heldout_by_step"])})
        return EncodedLayer(tensors, reports, tuning), float(meta["seconds"])

    def remove_layer(self, layer: int) -> None:
        for path in self.directory.glob(f"layer-{layer:03d}-unit-*.safetensors"):
            path.unlink(missing_ok=True)


class WriteBehind:
    """Runs each finished unit's write (and what follows it: assembling a completed layer's files) on one background
    thread, so the GPU encodes the next unit instead of waiting for the disk. One write in flight at most: memory
    holds one finished unit beyond the one encoding, and files appear in submission order. A failed write is raised
    by the next `submit` or at exit; leaving the block (Ctrl-C included) first lets the write in flight finish, so
    a unit already encoded is kept whole for the resumed job. `announce` says so when an interrupt has to wait."""

    def __init__(self, announce: Callable[[str], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-write")
        self._pending: Future[None] | None = None
        self._announce = announce

    def submit(self, write: Callable[[], None]) -> None:
        self.wait()
        self._pending = self._pool.submit(write)

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is None:
                self.wait()
                return
            if self._announce is not None and self._pending is not None and not self._pending.done():
                self._announce("finishing the unit file being written (its encode is kept)...")
            try:
                self.wait()
            except Exception as write_error:  # noqa: BLE001 - the error already propagating stays the one raised
                exc.add_note(f"the unit write in flight failed too: {write_error!r}")
        finally:
            self._pool.shutdown(wait=True)
