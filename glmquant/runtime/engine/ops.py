"""The math a forward calls, as one object: GLM-5.3-Flash's PyTorch functions (`arch.glm5_next_math`), or the same
functions compiled by `torch.compile`, and on CUDA the Triton kernels of mHC (`kernels/mhc.py`) and of the router's
scores (`kernels/router.py`).

A decode step is bound by launches more than by work: each elementwise chain (a norm, the SwiGLU clamps, the KDA
gate, the router) is five to ten tiny kernels in eager PyTorch, ~180 per layer. Compiled, each chain is one or two
kernels; the whole step stays one CUDA graph (compiled code is captured like any other). Prefill keeps the eager
functions: its chunks are large and of many lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import torch

from glmquant.arch import glm5_next_math as math


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[..., torch.Tensor]
    hyper_enter: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    hyper_expand: Callable[..., torch.Tensor]
    swiglu: Callable[..., torch.Tensor]
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    kda_gate: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]
    pool_keys: Callable[..., torch.Tensor]
    index_scores: Callable[..., torch.Tensor]
    select_tokens: Callable[..., torch.Tensor]
    absorbed_query: Callable[..., torch.Tensor]
    sparse_mla: Callable[..., torch.Tensor]


# Graphs torch.compile may keep per function. A function is called with several ranks and dtypes (rms_norm: the
# hidden state, the q/kv latents, KDA and MTP inputs; 2-D in a decode step, 3-D in a verify step), and each such
# signature (once its sizes are dynamic) is one graph. Past dynamo's default of 8 the function silently runs eager:
# on the H200 (f817dfe) rms_norm hit it in the MTP verify steps, after the plain decode's graphs.
RECOMPILE_LIMIT = 64


def ops_for(device: torch.device, compiled: bool = False, kernels: bool | None = None) -> Ops:
    """The functions for `device`: compiled (torch.compile, shapes dynamic after their first change, dynamo's
    recompile limit raised to `RECOMPILE_LIMIT`) if asked; mHC and the router's scores from their Triton kernels if
    `kernels` (by default on CUDA; the engine's Triton backends also on the CPU under Triton's interpreter, for
    tests)."""
    funcs = {f.name: getattr(math, f.name) for f in fields(Ops)}
    select = math.select_experts
    if compiled:
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        funcs = {name: torch.compile(fn, dynamic=None) for name, fn in funcs.items()}
        select = torch.compile(select, dynamic=None)
    if device.type == "cuda" if kernels is None else kernels:
        from glmquant.runtime.kernels import router
        from glmquant.runtime.kernels.mhc import hyper_enter, hyper_expand

        funcs |= {
            "hyper_enter": hyper_enter,
            "hyper_expand": hyper_expand,
            "route": partial(router.route, select=select),
        }
    return Ops(**funcs)
