"""transformers' GLM-5.3-Flash modeling module, with its optional kernels chosen per call by the tensors' device.

transformers binds `chunk_kda`, `fused_recurrent_kda` and the causal-conv1d kernels once, at import, whenever their
packages import; those are Triton/CUDA kernels, so a CPU forward (the reference the CUDA paths are tested against,
observation on the CPU) fails on a machine that has them. `modeling()` wraps each so that tensors off CUDA take
transformers' own PyTorch fallback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

KERNEL_FUNCTIONS = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def modeling() -> ModuleType:
    """`transformers.models.glm5_next.modeling_glm5_next`, its kernel functions routed by device (idempotent)."""
    from transformers.models.glm5_next import modeling_glm5_next as glm

    for name in KERNEL_FUNCTIONS:
        current = getattr(glm, name)
        if not getattr(current, "_routed_by_device", False):
            setattr(glm, name, _route_by_device(current))
    return glm


def cache_argument(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); accept either."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def reference(name: str) -> Callable[..., Any]:
    """transformers' own PyTorch function `name` (one of KERNEL_FUNCTIONS), never a package's kernel."""
    return _reference(getattr(modeling(), name))


def _reference(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(wrapped, "__wrapped__", wrapped)  # the hub-kernel wrapper (and ours) keep the function they wrap


def _route_by_device(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """`wrapped` (transformers' hub-kernel wrapper) for CUDA inputs, the PyTorch function it wraps for others."""
    reference = _reference(wrapped)

    @functools.wraps(reference)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        on_cuda = isinstance(first, torch.Tensor) and first.is_cuda
        return (wrapped if on_cuda else reference)(*args, **kwargs)

    call._routed_by_device = True  # type: ignore[attr-defined]
    return call
