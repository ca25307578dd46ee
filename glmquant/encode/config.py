"""The options of one encode job, built once at the CLI edge."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

HESSIAN_MODES = ("natural", "all")


@dataclass(frozen=True)
class EncodeConfig:
    source: Path
    out: Path
    observations: Path | None = None  # None: uncalibrated (identity Hessians), reported as fallbacks
    bits: int = 2
    codebook: str = "mcg"
    layout: str = "tr3"
    hessians: str = "natural"
    keep: int | None = None  # REAP pruning: experts kept per layer, ranked by the observations' saliency
    prune_plan: Path | None = None  # or an explicit plan file
    device: str = "cpu"
    work_dir: Path | None = None
    seed: int = 0
    batch_tensors: int = 24  # EXL3 tensors encoded together (the Viterbi vectorizes across them)
    source_repo: str | None = None
    verify: bool = True

    @property
    def state_dir(self) -> Path:
        return self.work_dir or self.out.with_name(self.out.name + ".work")

    def fingerprint(self) -> str:
        """What must not change between a killed run and its resume (everything that shapes the bytes)."""
        shaping = {k: str(v) for k, v in asdict(self).items() if k not in ("out", "work_dir", "device", "verify",
                                                                          "batch_tensors")}
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()
