"""Builds and calls the C++ Viterbi kernel (viterbi_kernel.cpp) through ctypes.

Compiled once per machine with the system C++ compiler into a cache folder; ctypes drops the GIL
during calls, so a small thread pool runs one contiguous block of tiles per core.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

_SOURCE = Path(__file__).with_name("viterbi_kernel.cpp")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-Wno-psabi"]


def _cache_dir() -> Path:
    root = os.environ.get("GLMQUANT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "glmquant"
    )
    return Path(root) / "exl3"


@lru_cache(maxsize=1)
def cpu_signature() -> str:
    """-march=native output is only valid on the CPU that built it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def compile_cached(name: str, command: list[str], key: list[bytes]) -> Path:
    """Run `command + ["-o", tmp]` once per `key` (source, flags, compiler...) and keep the library in the cache
    as `name-<hash>.so`; atomic, so concurrent builders never load a partial file. A failed build raises
    subprocess.CalledProcessError with the compiler's output."""
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([*command, "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _build(compiler: str) -> Path:
    key = [_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), compiler.encode(), cpu_signature().encode()]
    return compile_cached("viterbi", [compiler, *_FLAGS, str(_SOURCE)], key)


def cxx_compiler() -> str | None:
    """The C++ compiler the kernel is built with: $CXX, else g++ or c++ from PATH, resolved to its file (g++ is
    often a link to a versioned one)."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    return None if found is None else os.path.realpath(shutil.which(found) or found)


@lru_cache(maxsize=1)
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) when no compiler is available or the build fails."""
    compiler = cxx_compiler()
    if compiler is None:
        warnings.warn("no C++ compiler found; EXL3 Viterbi falls back to the slow torch path", stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warnings.warn(f"building the EXL3 Viterbi kernel failed, using torch: {detail[-2000:]}", stacklevel=2)
        return None
    lib.exl3_viterbi.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.exl3_viterbi.restype = ctypes.c_int
    lib.exl3_viterbi_scratch_bytes.argtypes = [ctypes.c_int]
    lib.exl3_viterbi_scratch_bytes.restype = ctypes.c_int64
    lib.exl3_viterbi_lanes.restype = ctypes.c_int64
    return lib


_local = threading.local()


def _scratch(lib: ctypes.CDLL, bits: int) -> np.ndarray:
    """Per-thread work buffer (costs + traceback history, tens of MB), kept for reuse across calls."""
    size = lib.exl3_viterbi_scratch_bytes(bits)
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.nbytes < size:
        buf = _local.scratch = np.empty(size, dtype=np.uint8)
    return buf


@lru_cache(maxsize=4)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="exl3-viterbi")


def viterbi_native(lib: ctypes.CDLL, targets: torch.Tensor, lut: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, 256) fp32 ring-ordered targets -> (n, 256) int32 states, one block of whole lane groups per thread."""
    x = np.ascontiguousarray(targets.detach().cpu().numpy(), dtype=np.float32)
    table = np.ascontiguousarray(lut.cpu().numpy(), dtype=np.float32)
    n = x.shape[0]
    out = np.empty((n, 256), dtype=np.uint16)
    lanes = int(lib.exl3_viterbi_lanes())
    groups = -(-n // lanes)
    workers = max(1, min(torch.get_num_threads(), groups))
    per = -(-groups // workers) * lanes

    def run(start: int) -> None:
        stop = min(n, start + per)
        rc = lib.exl3_viterbi(
            x[start:].ctypes.data,
            stop - start,
            table.ctypes.data,
            bits,
            out[start:].ctypes.data,
            _scratch(lib, bits).ctypes.data,
        )
        if rc != 0:
            raise ValueError(f"EXL3 Viterbi kernel rejected bits={bits}")

    if workers == 1:
        run(0)
    else:
        list(_pool(workers).map(run, range(0, n, per)))
    return torch.from_numpy(out.astype(np.int32))
