"""The environment variables glmquant reads (the README's table), validated once at the CLI edge and again where a
stage's config is built, so a bad value is refused before any work instead of ending a job in a traceback."""

from __future__ import annotations

import os
from pathlib import Path

from glmquant.errors import UsageError

EXL3_BACKEND = (
    "GLMQUANT_EXL3_BACKEND"  # the EXL3 Viterbi backend: native, torch, cuda or exllamav3 (unset: the fastest)
)
CACHE_DIR = "GLMQUANT_CACHE_DIR"  # where the C++ Viterbi kernel is compiled to (default ~/.cache/glmquant)
ENCODE_MEMO = "GLMQUANT_ENCODE_MEMO"  # a directory of finished encodes read back by a repeated encode (unset: off)
SOURCE_DATE_EPOCH = "SOURCE_DATE_EPOCH"  # the manifest's timestamp, in whole seconds since 1970 (reproducible builds)
EXL3_BACKENDS = ("native", "torch", "cuda", "exllamav3")  # exl3.backends.BACKENDS, without importing torch


def exl3_backend() -> str | None:
    """$GLMQUANT_EXL3_BACKEND, checked; None when unset or empty."""
    value = os.environ.get(EXL3_BACKEND) or None
    if value is not None and value not in EXL3_BACKENDS:
        raise UsageError(
            f"{EXL3_BACKEND}={value!r} is not an EXL3 backend; choose one of {', '.join(EXL3_BACKENDS)} "
            "or unset it (the fastest one for the device)"
        )
    return value


def _directory(name: str, value: str) -> Path:
    """`value` of the variable `name` as a directory to use or create: refused when empty or a file."""
    if not value or Path(value).exists() and not Path(value).is_dir():
        raise UsageError(f"{name}={value!r} must name a directory (it is created when missing)")
    return Path(value)


def encode_memo_dir() -> Path | None:
    """$GLMQUANT_ENCODE_MEMO, checked; None when unset or empty."""
    value = os.environ.get(ENCODE_MEMO) or None
    return None if value is None else _directory(ENCODE_MEMO, value)


def source_date_epoch() -> int | None:
    """$SOURCE_DATE_EPOCH, checked; None when unset."""
    epoch = os.environ.get(SOURCE_DATE_EPOCH)
    if epoch is not None and not epoch.isdigit():
        raise UsageError(f"{SOURCE_DATE_EPOCH} must be whole seconds since 1970, got {epoch!r}")
    return None if epoch is None else int(epoch)


def check_environment() -> None:
    """Refuse a bad value of any variable glmquant reads, naming the variable."""
    exl3_backend()
    cache = os.environ.get(CACHE_DIR)
    if cache is not None:
        _directory(CACHE_DIR, cache)
    encode_memo_dir()
    source_date_epoch()
