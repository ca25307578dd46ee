"""What is installed and usable here, for the kernels and the code that picks them.

Importable without triton or a GPU, and imports no kernel module at module level, so every kernel module can
import it without an import cycle.
"""

from __future__ import annotations

import importlib.util
import os

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
EXLLAMAV3_AVAILABLE = importlib.util.find_spec("exllamav3") is not None
FLA_AVAILABLE = importlib.util.find_spec("fla") is not None


def cuda_ready() -> bool:
    """True when triton is installed and a CUDA device is visible."""
    return TRITON_AVAILABLE and torch.cuda.is_available()


def interpreter_requested() -> bool:
    """True when the environment asks for Triton's CPU interpreter now (TRITON_INTERPRET=1, for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).

    Asks a jit helper of `exl3_decode`, which every core imports and which imports nothing of this package.
    """
    if not TRITON_AVAILABLE:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from glmquant.runtime.kernels.exl3_decode import codebook_value

    return isinstance(codebook_value, InterpretedFunction)
