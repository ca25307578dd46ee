"""The one check of a `--device` option, shared by every stage config."""

from __future__ import annotations

import torch

from glmquant.errors import UsageError


def device_type(device: str) -> str:
    """'cpu' or 'cuda' for a device string (cpu, cuda, cuda:N); UsageError for anything else."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (or cuda:N), got {device!r}")
    return kind
