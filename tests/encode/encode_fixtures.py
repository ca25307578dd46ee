"""What the encode tests share: the small source's shape, a quiet console and a file-digest helper."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rich.console import Console

from glmquant.fixtures import TinyModelConfig

QUIET = Console(quiet=True)
SMALL = TinyModelConfig(n_routed_experts=2, num_experts_per_tok=1)


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}
