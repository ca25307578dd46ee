"""Kernel tests run on CUDA when present, else under Triton's CPU interpreter (set by the root conftest, before
any test imports the kernels)."""
