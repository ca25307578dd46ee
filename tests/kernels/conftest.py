"""Kernel tests run on CUDA when present, else under Triton's CPU interpreter (set before the kernels import)."""

from __future__ import annotations

import importlib.util
import os

import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
