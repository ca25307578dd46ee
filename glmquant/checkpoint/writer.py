"""Atomic, streaming file writes: a job killed at any point never leaves a file that looks complete.

Every file is written under a temporary name in its own directory, fsynced, then renamed into place (and
the directory fsynced). On any failure, KeyboardInterrupt included, the temporary file is removed.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from glmquant.checkpoint.safetensors_format import TensorSpec, build_header
from glmquant.checkpoint.tensor_bytes import dtype_name, tensor_to_bytes
from glmquant.errors import CheckpointFormatError, GlmquantError

# What a provider hands over for one tensor: its bytes, the tensor itself, or a function that streams the
# bytes into the open file and returns how many it wrote (used to copy retained tensors without loading them).
Streamer = Callable[[BinaryIO], int]
Provided = bytes | bytearray | memoryview | torch.Tensor | Streamer


_TEMP_NAME = re.compile(r"^\..+\.tmp-\d+$")  # `.NAME.tmp-PID`, as atomic_file names its temporary file


def is_temp_file(name: str) -> bool:
    """A file name atomic_file gives a write in progress (left behind only when the process was killed)."""
    return bool(_TEMP_NAME.match(name))


def remove_temp_files(directory: Path) -> list[Path]:
    """Remove what killed writes left in `directory` (temporary files never replaced a real one); returns them."""
    stale = [p for p in directory.iterdir() if p.is_file() and is_temp_file(p.name)] if directory.is_dir() else []
    for path in stale:
        path.unlink()
    return stale


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temp file beside `path`; it becomes `path` only if the block completes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _named(path, exc) from exc
        raise


def _named(path: Path, exc: OSError) -> GlmquantError:
    if exc.errno == errno.ENOSPC:
        return GlmquantError(f"{path}: disk full while writing; free space on {path.parent} and rerun")
    return GlmquantError(f"{path}: write failed ({exc.strerror or exc})")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_safetensors(
    path: str | Path,
    specs: Sequence[TensorSpec],
    provide: Callable[[TensorSpec], Provided],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file byte-identical to the library's, fetching one tensor at a time; returns its size.

    Only one tensor's bytes are held at once, so a file of any size streams through bounded memory.
    """
    prefix, placed = build_header(specs, metadata)
    with atomic_file(path) as f:
        f.write(prefix)
        for p in placed:
            _write_tensor(f, p.spec, provide(p.spec), path)
        return f.tell()


def _write_tensor(f: BinaryIO, spec: TensorSpec, data: Provided, path: str | Path) -> None:
    if isinstance(data, torch.Tensor):
        if dtype_name(data) != spec.dtype or tuple(data.shape) != spec.shape:
            raise CheckpointFormatError(
                f"{path}: tensor {spec.name} provided as {dtype_name(data)} {list(data.shape)}, "
                f"header says {spec.dtype} {list(spec.shape)}"
            )
        data = tensor_to_bytes(data)
    if callable(data):
        start = f.tell()
        written = data(f)
        if written != spec.nbytes or f.tell() - start != spec.nbytes:
            raise CheckpointFormatError(
                f"{path}: tensor {spec.name} streamed {f.tell() - start} bytes, expected {spec.nbytes}"
            )
        return
    if len(memoryview(data).cast("B")) != spec.nbytes:
        raise CheckpointFormatError(
            f"{path}: tensor {spec.name} provided {len(memoryview(data).cast('B'))} bytes, expected {spec.nbytes}"
        )
    f.write(data)
