"""Builds and calls the CUDA Viterbi kernel (viterbi_cuda.cu) through ctypes, on torch's current stream.

Compiled once per GPU architecture with nvcc into the same cache folder as the CPU kernel (seconds: the
source includes no torch headers). The search keeps ExLlamaV3's two passes; its arithmetic differs from the
CPU kernel's (fp16 targets, argmin packed into the costs; at K <= 2 16-bit fixed-point costs), so paths may
differ on near ties: same format, same quality (checked against the CPU reference in the tests and the benchmark).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from functools import lru_cache
from pathlib import Path

import torch

from glmquant.exl3.codebooks import Codebook, codebook_values
from glmquant.exl3.native import compile_cached

_SOURCE = Path(__file__).with_name("viterbi_cuda.cu")
PASS1_BEFORE = PASS1_AFTER = 128  # ExLlamaV3's seam search: the ring rotated by 128
MAX_TARGET = 6.0e4  # targets are searched in fp16 (max 65,504); regularized weights are O(1)
HIST_BYTES_PER_TILE = 256 * 1024 * 4
FIXED_MAX_BITS = 2  # K <= 2 runs the 16-bit fixed-point (DPX) search
FIXED_SCALE = 16.0  # its codebook values are stored scaled by this (exact in fp16)


class CudaViterbiUnavailable(RuntimeError):
    """No nvcc, no CUDA device, or the build failed; the message says which."""


def _nvcc() -> str:
    found = os.environ.get("NVCC") or shutil.which("nvcc")
    if found is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = Path(home) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    if found is None:
        raise CudaViterbiUnavailable("nvcc not found (set NVCC or CUDA_HOME) to build the CUDA Viterbi kernel")
    return found


def build(arch: str) -> Path:
    """Compile the kernel for `arch` (e.g. "90") into the cache, atomically; returns the shared library."""
    nvcc = _nvcc()
    version = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    flags = ["-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    try:
        return compile_cached(
            f"viterbi-cuda-sm{arch}",
            [nvcc, *flags, str(_SOURCE)],
            [_SOURCE.read_bytes(), " ".join(flags).encode(), version.encode()],
        )
    except subprocess.CalledProcessError as err:
        raise CudaViterbiUnavailable(f"nvcc failed building {_SOURCE.name}: {err.stderr[-2000:]}") from None


@lru_cache(maxsize=4)
def load_kernel(arch: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(arch)))
    lib.exl3_viterbi_cuda.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.exl3_viterbi_cuda.restype = ctypes.c_int
    lib.exl3_viterbi_cuda_error.argtypes = [ctypes.c_int]
    lib.exl3_viterbi_cuda_error.restype = ctypes.c_char_p
    return lib


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def cuda_viterbi_available() -> bool:
    """True when a CUDA device is visible and the kernel builds for it."""
    if not torch.cuda.is_available():
        return False
    try:
        load_kernel(device_arch(torch.device("cuda")))
    except (CudaViterbiUnavailable, OSError, subprocess.CalledProcessError):
        return False
    return True


@lru_cache(maxsize=32)
def codebook_pairs(codebook: Codebook, bits: int, device: torch.device) -> torch.Tensor:
    """The fp16 codebook as int32 words holding the values of states (2c << 16-K | e) and (2c+1 << 16-K | e)."""
    values = codebook_values(codebook).view(torch.int16)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    pairs = values.view(1 << (bits - 1), 2, 1 << (16 - bits)).transpose(1, 2).contiguous()
    return pairs.view(torch.int32).squeeze(-1).to(device)


@lru_cache(maxsize=8)
def fixed_values(codebook: Codebook, device: torch.device) -> torch.Tensor:
    """The fp16 codebook x 16, one value per state (the fixed-point search's table)."""
    return (codebook_values(codebook) * FIXED_SCALE).to(device)


@lru_cache(maxsize=8)
def codebook_peak(codebook: Codebook) -> float:
    """The codebook's largest |value|."""
    return codebook_values(codebook).float().abs().max().item()


class _Scratch(threading.local):
    """Per-thread, per-device history and seam buffers, grown on demand and reused across calls. Per thread: an
    encode's write-behind thread may encode (retained linears) on the same stream while the main thread does, and
    shared buffers would let one call's kernels overwrite the other's history between its forward and trace
    launches. A thread's buffers are freed when it ends."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, str], torch.Tensor] = {}

    def get(self, device: torch.device, name: str, nbytes: int) -> torch.Tensor:
        buf = self.buffers.get((device, name))
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop((device, name), None)
            buf = self.buffers[(device, name)] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return buf


_SCRATCH = _Scratch()


def _batch_tiles(n: int, device: torch.device) -> int:
    """Tiles per launch: whole waves of one block per SM (no half-empty last wave), 32 waves at most, with history
    scratch under ~1/8 of free memory."""
    free, _ = torch.cuda.mem_get_info(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    waves = max(1, min(32, free // 8 // HIST_BYTES_PER_TILE // sms))
    return max(1, min(n, sms * waves))


def viterbi_cuda(
    tiles: torch.Tensor, bits: int, codebook: Codebook, before: int = PASS1_BEFORE, after: int = PASS1_AFTER
) -> torch.Tensor:
    """(n, 256) fp32 ring-ordered tiles on a CUDA device -> (n, 256) int32 states (closed tail-biting rings)."""
    if not tiles.is_cuda:
        raise ValueError("viterbi_cuda needs tiles on a CUDA device")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")
    x = tiles.float().contiguous()
    n = x.shape[0]
    states = torch.empty((n, 256), dtype=torch.int32, device=x.device)
    if n == 0:
        return states
    peak = x.abs().max().item()
    if not peak < MAX_TARGET:  # also catches NaN
        raise ValueError(f"Viterbi targets must be finite and below {MAX_TARGET:g} in magnitude, got max |x| = {peak}")
    lib = load_kernel(device_arch(x.device))
    batch = _batch_tiles(n, x.device)
    hist = _SCRATCH.get(x.device, "hist", batch * HIST_BYTES_PER_TILE)
    edges = _SCRATCH.get(x.device, "edges", batch * 4)
    book = Codebook(codebook)
    table = fixed_values(book, x.device) if bits <= FIXED_MAX_BITS else codebook_pairs(book, bits, x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        rc = lib.exl3_viterbi_cuda(
            x.data_ptr(),
            n,
            table.data_ptr(),
            codebook_peak(book),
            bits,
            before,
            after,
            states.data_ptr(),
            hist.data_ptr(),
            edges.data_ptr(),
            batch,
            stream,
        )
    if rc != 0:
        reason = "bad arguments" if rc < 0 else lib.exl3_viterbi_cuda_error(rc).decode()
        raise RuntimeError(f"CUDA Viterbi kernel failed (bits={bits}, tiles={n}): {reason}")
    return states
