"""GPU kernels for the runtime's routed experts: Triton EXL3 decode-and-multiply, the fused MoE step, CUDA graphs.

Importable without triton or a GPU: `availability` says what is installed and whether the kernels can run
here. With triton installed, importing this package registers the "triton", "triton-eager" and (with
exllamav3 installed) "exllamav3" expert backends. The modules are listed in docs/kernels.md.
"""

from __future__ import annotations

from glmquant.runtime.kernels.availability import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    from glmquant.runtime.kernels import backend  # noqa: F401  (registers the GPU expert backends)
