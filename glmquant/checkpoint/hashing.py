"""Streaming SHA-256 of files, several at once: shared by the manifest builder and the verifier.

hashlib releases the GIL on large updates, so threads hash different files in parallel; each file is read
in fixed chunks and never held in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from glmquant.errors import CheckpointFormatError

HASH_CHUNK = 8 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex SHA-256 of a file, reporting each chunk's size to `on_bytes` (for progress bars)."""
    digest = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                digest.update(view[:n])
                if on_bytes is not None:
                    on_bytes(n)
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return digest.hexdigest()


def sha256_files(
    paths: Sequence[Path], workers: int = 4, on_bytes: Callable[[int], None] | None = None
) -> Mapping[Path, str]:
    """Hash many files in parallel; results keyed by path, in the order given."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda p: sha256_file(p, on_bytes), paths))
    return dict(zip(paths, digests, strict=True))
