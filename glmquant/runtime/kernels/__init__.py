"""GPU kernels for the runtime's routed experts: Triton EXL3 decode-and-multiply, the fused MoE step, CUDA graphs.

Importable without triton or a GPU: `TRITON_AVAILABLE` / `EXLLAMAV3_AVAILABLE` say what is installed and
`cuda_ready()` whether the kernels can run here. With triton installed, importing this package registers the
"triton", "triton-eager" and (with exllamav3 installed) "exllamav3" expert backends.
"""

from __future__ import annotations

import importlib.util

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
EXLLAMAV3_AVAILABLE = importlib.util.find_spec("exllamav3") is not None


def cuda_ready() -> bool:
    """True when triton is installed and a CUDA device is visible."""
    return TRITON_AVAILABLE and torch.cuda.is_available()


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    if not TRITON_AVAILABLE:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from glmquant.runtime.kernels.exl3_gemm import _exl3_rows_kernel

    return isinstance(_exl3_rows_kernel, InterpretedFunction)


if TRITON_AVAILABLE:
    from glmquant.runtime.kernels import backend  # noqa: F401  (registers the GPU expert backends)
