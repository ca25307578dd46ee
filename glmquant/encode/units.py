"""Finished work units on disk: one safetensors file per (layer, unit) in the job's work dir, written atomically.

A unit file holds the unit's EXL3 parts and, in its metadata, each tensor's report. It is what ranks of a
distributed job hand to rank 0, and what a resumed job reuses; rank 0 deletes a layer's unit files once the
artifact files holding that layer are written.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save

from glmquant.checkpoint.writer import atomic_write_bytes
from glmquant.encode.layer import EncodedLayer, TensorReport

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
        return EncodedLayer(tensors, reports), float(meta["seconds"])

    def remove_layer(self, layer: int) -> None:
        for path in self.directory.glob(f"layer-{layer:03d}-unit-*.safetensors"):
            path.unlink(missing_ok=True)
