"""What every benchmark script records about the code it ran."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
