"""Row-range reads and chunked writes of one big tensor in a safetensors file.

Hidden states and stacked per-expert Hessians are far larger than what one step needs: a step reads
rows [start, stop) of the leading dimension (a byte range, since safetensors is row-major) and a writer
streams a tensor chunk by chunk, so neither side ever holds the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import torch

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.tensor_bytes import tensor_to_bytes


def read_rows(path: str | Path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of tensor `name` (a CPU tensor in its stored dtype), reading only their bytes."""
    with SourceCheckpoint.open(path) as f:
        return f.read_rows(name, start, stop)


def chunk_streamer(chunks: Iterable[torch.Tensor]) -> Callable[[BinaryIO], int]:
    """A `write_safetensors` streamer writing the chunks' bytes in order (each chunk moved to CPU alone)."""

    def stream(f: BinaryIO) -> int:
        written = 0
        for chunk in chunks:
            written += f.write(tensor_to_bytes(chunk))
        return written

    return stream
