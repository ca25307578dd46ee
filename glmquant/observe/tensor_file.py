"""Row-range reads and chunked writes of one big tensor in a safetensors file.

Hidden states and stacked per-expert Hessians are far larger than what one step needs: a step reads
rows [start, stop) of the leading dimension (a byte range, since safetensors is row-major) and a writer
streams a tensor chunk by chunk, so neither side ever holds the whole tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import torch

from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.checkpoint.tensor_bytes import tensor_from_bytes, tensor_to_bytes
from glmquant.errors import CheckpointFormatError


def read_rows(path: str | Path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of tensor `name` (a CPU tensor in its stored dtype), reading only their bytes."""
    header = parse_header(path)
    if name not in header.tensors:
        raise CheckpointFormatError(f"{path}: no tensor {name!r}")
    spec = header.tensors[name].spec
    if not 0 <= start <= stop <= spec.shape[0]:
        raise CheckpointFormatError(f"{path}: rows [{start}, {stop}) outside tensor {name!r} of {spec.shape[0]} rows")
    row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
    begin = header.span(name)[0] + start * row_bytes
    buf = bytearray((stop - start) * row_bytes)
    view, done = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while done < len(buf):
            n = os.preadv(f.fileno(), [view[done:]], begin + done)
            if n == 0:
                raise CheckpointFormatError(f"{path}: file ended inside tensor {name!r} (truncated?)")
            done += n
    return tensor_from_bytes(buf, spec.dtype, (stop - start, *spec.shape[1:]))


def chunk_streamer(chunks: Iterable[torch.Tensor]) -> Callable[[BinaryIO], int]:
    """A `write_safetensors` streamer writing the chunks' bytes in order (each chunk moved to CPU alone)."""

    def stream(f: BinaryIO) -> int:
        written = 0
        for chunk in chunks:
            written += f.write(tensor_to_bytes(chunk))
        return written

    return stream
