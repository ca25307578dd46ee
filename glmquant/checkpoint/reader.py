"""Lazy reading of a (sharded) safetensors checkpoint: every header parsed once, tensor data read on demand.

Reads use `os.pread` on one descriptor per shard, so only the requested byte range is ever read, reads are
safe from several threads, and memory stays bounded by the largest tensor asked for.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from glmquant.arch.table import DTYPE_BYTES, TensorInfo
from glmquant.checkpoint.index import INDEX_NAME, SafetensorsIndex, read_index
from glmquant.checkpoint.safetensors_format import ParsedHeader, TensorSpec, parse_header
from glmquant.checkpoint.tensor_bytes import tensor_from_bytes
from glmquant.errors import CheckpointFormatError, NumericalError, UsageError

COPY_CHUNK = 16 << 20  # bytes per read when streaming a tensor into another file (a multiple of every dtype's size)
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})  # the stored dtypes NaN/Inf can be in


@dataclass
class SourceCheckpoint:
    """A checkpoint directory (sharded with an index, or one `model.safetensors`) or a single file."""

    directory: Path
    headers: Mapping[str, ParsedHeader]  # shard file name -> header
    locations: Mapping[str, str]  # tensor name -> shard file name
    _fds: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> SourceCheckpoint:
        path = Path(path)
        if path.is_file():
            return cls._from_shards(path.parent, [path.name], None)
        if not path.is_dir():
            raise UsageError(f"{path}: no such checkpoint file or directory")
        if (path / INDEX_NAME).is_file():
            index = read_index(path / INDEX_NAME)
            return cls._from_shards(path, index.shards, index)
        if (path / "model.safetensors").is_file():
            return cls._from_shards(path, ["model.safetensors"], None)
        raise UsageError(f"{path}: neither {INDEX_NAME} nor model.safetensors found")

    @classmethod
    def _from_shards(cls, directory: Path, shards: list[str], index: SafetensorsIndex | None) -> SourceCheckpoint:
        headers: dict[str, ParsedHeader] = {}
        locations: dict[str, str] = {}
        for shard in shards:
            if not (directory / shard).is_file():
                raise CheckpointFormatError(f"{directory / INDEX_NAME}: shard {shard} is listed but missing")
            headers[shard] = parse_header(directory / shard)
            for name in headers[shard].tensors:
                if name in locations:
                    raise CheckpointFormatError(
                        f"{directory}: tensor {name} appears in both {locations[name]} and {shard}"
                    )
                locations[name] = shard
        if index is not None:
            _check_index(directory, index, locations)
        return cls(directory, headers, locations)

    @property
    def config_path(self) -> Path:
        return self.directory / "config.json"

    def names(self) -> list[str]:
        return list(self.locations)

    def __contains__(self, name: str) -> bool:
        return name in self.locations

    def shard_of(self, name: str) -> str:
        return self.locations[self._known(name)]

    def spec(self, name: str) -> TensorSpec:
        return self.headers[self.shard_of(name)].tensors[name].spec

    def read_raw(self, name: str) -> bytes:
        """The tensor's exact stored bytes."""
        return bytes(self._read_range(name))

    def read_tensor(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype and shape, reading only its own bytes."""
        spec = self.spec(name)
        return tensor_from_bytes(self._read_range(name), spec.dtype, spec.shape)

    def read_finite_float(self, name: str) -> torch.Tensor:
        """A weight as float32, refused (NumericalError naming its shard and the tensor) when it holds NaN or Inf."""
        weight = self.read_tensor(name).float()
        try:
            assert_finite(name, weight)
        except NumericalError as exc:
            raise NumericalError(f"{self.directory / self.shard_of(name)}: {exc}") from None
        return weight

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the leading dimension, reading only their bytes (safetensors is row-major)."""
        spec = self.spec(name)
        if not spec.shape or not 0 <= start <= stop <= spec.shape[0]:
            raise CheckpointFormatError(
                f"{self.directory / self.shard_of(name)}: rows [{start}, {stop}) outside "
                f"tensor {name!r} of shape {list(spec.shape)}"
            )
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
        buf = bytearray((stop - start) * row_bytes)
        self._read_into(name, memoryview(buf), self.headers[self.shard_of(name)].span(name)[0] + start * row_bytes)
        return tensor_from_bytes(buf, spec.dtype, (stop - start, *spec.shape[1:]))

    def copy_raw_into(
        self, name: str, out: BinaryIO, start: int = 0, length: int | None = None, finite: bool = False
    ) -> int:
        """Stream the tensor's stored bytes (or `length` of them from `start`) into `out` in bounded chunks; with
        `finite`, a floating tensor holding NaN or Inf is a NumericalError naming the file and the tensor."""
        begin, end = self.headers[self.shard_of(name)].span(name)
        length = end - begin - start if length is None else length
        if start < 0 or length < 0 or begin + start + length > end:
            raise ValueError(f"byte range {start}+{length} is outside tensor {name} ({end - begin} bytes)")
        dtype, whole = self.spec(name).dtype, length == end - begin
        check = finite and dtype in FLOAT_DTYPES and not (start % DTYPE_BYTES[dtype] or length % DTYPE_BYTES[dtype])
        begin, end = begin + start, begin + start + length
        buf, bad = bytearray(min(COPY_CHUNK, length)), 0
        for offset in range(begin, end, COPY_CHUNK):
            chunk = memoryview(buf)[: min(COPY_CHUNK, end - offset)]
            self._read_into(name, chunk, offset)
            if check:  # chunks hold whole elements: COPY_CHUNK is a multiple of every dtype's size
                values = tensor_from_bytes(chunk, dtype, (len(chunk) // DTYPE_BYTES[dtype],))
                bad += int((~torch.isfinite(values if values.itemsize > 1 else values.float())).sum())
            out.write(chunk)
        if bad:  # raised inside the writer's atomic file: what was written goes with it
            count = length // DTYPE_BYTES[dtype]
            raise NumericalError(
                f"{self.directory / self.shard_of(name)}: tensor {name} has {bad} non-finite value(s) (NaN/Inf) "
                + (f"of {count}" if whole else f"in the {count} copied")
            )
        return length

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_specs(self, expected: Iterable[TensorInfo], dtypes: bool = True) -> None:
        """Refuse a header whose shape (and with `dtypes` dtype) is not the one the config gives the tensor (tensors
        absent here are the census's business): a transposed tensor would be read as other numbers, and an artifact
        copies its tensors' bytes as the plan's dtypes (a BF16 tensor relabelled F16 would be encoded as other
        numbers). A reader that converts every tensor to its compute dtype takes any float dtype (an F32 reference)."""

        def differs(info: TensorInfo, got: TensorSpec) -> bool:
            return tuple(got.shape) != tuple(info.shape) or (dtypes and got.dtype != info.dtype)

        wrong = [
            (info, self.spec(info.name))
            for info in expected
            if info.name in self.locations and differs(info, self.spec(info.name))
        ]
        if wrong:
            info, got = wrong[0]
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            raise CheckpointFormatError(
                f"{self.directory / self.shard_of(info.name)}: tensor {info.name} is {got.dtype} {list(got.shape)}, "
                f"but its config gives {info.dtype} {list(info.shape)}{more}"
            )

    def _known(self, name: str) -> str:
        if name not in self.locations:
            raise KeyError(f"tensor {name} is not in checkpoint {self.directory}")
        return name

    def _fd(self, shard: str) -> int:
        if shard not in self._fds:
            fd = os.open(self.directory / shard, os.O_RDONLY)
            if self._fds.setdefault(shard, fd) != fd:  # another thread opened it first
                os.close(fd)
        return self._fds[shard]

    def _read_range(self, name: str) -> bytearray:
        begin, end = self.headers[self.shard_of(name)].span(name)
        buf = bytearray(end - begin)
        self._read_into(name, memoryview(buf), begin)
        return buf

    def _read_into(self, name: str, view: memoryview, offset: int) -> None:
        """Fill `view` from the tensor's shard starting at absolute `offset` (positional reads, thread-safe)."""
        shard = self.shard_of(name)
        fd, done = self._fd(shard), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointFormatError(f"{self.directory / shard}: file ended inside tensor {name} (truncated?)")
            done += n


def vector_tensors_sha256(ckpt: SourceCheckpoint) -> str:
    """SHA-256 of every 1-D tensor's name and stored bytes (norms, biases, decay parameters): a few MB that tell two
    checkpoints of one config apart, read in seconds where hashing the weights would read the whole model."""
    digest = hashlib.sha256()
    for name in sorted(n for n in ckpt.names() if len(ckpt.spec(n).shape) == 1):
        digest.update(name.encode() + b"\0")
        digest.update(ckpt.read_raw(name))
    return digest.hexdigest()


def _check_index(directory: Path, index: SafetensorsIndex, locations: Mapping[str, str]) -> None:
    """The index and the headers must describe the same tensors in the same shards."""
    path = directory / INDEX_NAME
    for name, shard in index.weight_map.items():
        if locations.get(name) != shard:
            raise CheckpointFormatError(f"{path}: tensor {name} is mapped to {shard} but that shard's header lacks it")
    unlisted = sorted(set(locations) - set(index.weight_map))
    if unlisted:
        raise CheckpointFormatError(
            f"{path}: {len(unlisted)} tensor(s) in shard headers are not in the index, "
            f"e.g. {unlisted[0]} in {locations[unlisted[0]]}"
        )


def assert_finite(name: str, tensor: torch.Tensor) -> None:
    """Fail with the tensor's name when a floating tensor holds NaN or Inf (integer tensors always pass)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise NumericalError(f"tensor {name} has {bad} non-finite value(s) (NaN/Inf) of {tensor.numel()}")
