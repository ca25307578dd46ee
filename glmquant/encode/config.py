"""The options of one encode job, built once at the CLI edge.

Resuming a killed job (rerun the same command; the state lives in --work-dir, default ARTIFACT.work):

    may change:  --work-dir location (moved with its contents), progress display, the number of processes
                 (torchrun's world size: units are assigned by rank, each computed the same way anywhere)
    must match:  the source's tensors (content hash of its structure), the observations' token rows and
                 recipe, the kept experts, --bits --codebook --layout --hessians --keep --seed
                 --experts-per-unit (the batch a GPU computes together), --source-repo and --revision
                 (the commit a Hub source resolved to), the device type and the Viterbi backend (CPU and GPU
                 arithmetic differ)

A mismatch is refused with an error naming the state file; nothing already written is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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
    experts_per_unit: int = 32  # work unit: this many experts' EXL3 tensors encoded in one batched call
    source_repo: str | None = None
    source_revision: str | None = None  # the Hub commit a repo-id source resolved to
    verify: bool = True

    @property
    def state_dir(self) -> Path:
        return self.work_dir or self.out.with_name(self.out.name + ".work")

    def fingerprint(self, inputs: dict[str, str | None]) -> str:
        """What must not change between a killed run and its resume: every option that shapes the bytes, the
        device type and Viterbi backend (CPU and GPU arithmetic differ), and the hashes of the inputs' contents
        (`inputs`: source structure, observations, prune plan), not their paths."""
        shaping = {k: str(v) for k, v in asdict(self).items()
                   if k not in ("out", "work_dir", "verify", "source", "observations", "prune_plan")}
        shaping["device"] = torch.device(self.device).type
        shaping["backend"] = os.environ.get("GLMQUANT_EXL3_BACKEND", "auto")
        return hashlib.sha256(json.dumps({**shaping, **inputs}, sort_keys=True).encode()).hexdigest()
