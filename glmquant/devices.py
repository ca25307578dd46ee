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


def require_visible(device: str) -> None:
    """UsageError naming the option when `device` is CUDA and no CUDA device is visible. The runtime checks it where
    work starts (its options are built and validated on any machine); the observe and encode configs, which their
    commands build right before the work, check it there, so nothing is created before the refusal."""
    if device_type(device) == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: no CUDA device is visible here")
