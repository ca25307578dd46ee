"""What every benchmark script records about the code it ran."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from glmquant.environment import ENCODE_MEMO

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The checkout's short HEAD, or "unknown" where git is missing or the tree is no repository (the device's copy:
    pass --commit there)."""
    try:
        run = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return run.stdout.strip() or "unknown"


def encodes_computed() -> None:
    """For the scripts that time or instrument encodes: $GLMQUANT_ENCODE_MEMO is dropped for the run, so that every
    encode they measure is computed, not read back."""
    if os.environ.pop(ENCODE_MEMO, None):
        print(f"{ENCODE_MEMO} is ignored here: this script times encodes", file=sys.stderr)


def provenance(device: str) -> dict[str, str]:
    """Commit, date, torch and Python versions and the device of a run, for a results file; and the encode memo where
    one was on ($GLMQUANT_ENCODE_MEMO: encodes read back from it take no encoding time)."""
    memo = os.environ.get(ENCODE_MEMO)
    return {
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        **({"encode_memo": memo} if memo else {}),
    }
