"""Viterbi backend selection: the C++ kernel on CPU, our CUDA kernel on NVIDIA GPUs (ExLlamaV3's when asked for
or when ours cannot be built), torch otherwise.

Every backend maps (n, 256) fp32 ring-ordered tiles to (n, 256) int32 states; the caller decodes the
values with the codebook, so backends can only differ in the path they choose.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from glmquant.exl3.codebooks import Codebook, device_codebook
from glmquant.exl3.cuda_viterbi import cuda_viterbi_available, viterbi_cuda
from glmquant.exl3.native import load_kernel, viterbi_native
from glmquant.exl3.viterbi import viterbi_torch

BACKENDS = ("native", "torch", "cuda", "exllamav3")
ENV_VAR = "GLMQUANT_EXL3_BACKEND"


@dataclass(frozen=True)
class TileSearch:
    """A named Viterbi implementation; call it with (tiles, bits, codebook)."""

    name: str
    run: Callable[[torch.Tensor, int, Codebook], torch.Tensor]

    def __call__(self, tiles: torch.Tensor, bits: int, codebook: Codebook) -> torch.Tensor:
        if tiles.shape[0] == 0:
            return torch.empty((0, 256), dtype=torch.int32, device=tiles.device)
        return self.run(tiles.float().contiguous(), bits, codebook)


@lru_cache(maxsize=16)
def _lut(codebook: Codebook, device: torch.device) -> torch.Tensor:
    """fp32 codebook on a device, shared read-only by every call (cast there from the cached fp16 copy)."""
    return device_codebook(codebook, device).float()


def _native(tiles: torch.Tensor, bits: int, codebook: Codebook) -> torch.Tensor:
    lib = load_kernel()
    assert lib is not None  # checked by select_backend
    return viterbi_native(lib, tiles, _lut(codebook, torch.device("cpu")), bits).to(tiles.device)


def _torch(tiles: torch.Tensor, bits: int, codebook: Codebook) -> torch.Tensor:
    chunk = 1024 if tiles.is_cuda else 32
    return viterbi_torch(tiles, _lut(codebook, tiles.device), bits, chunk=chunk)


def _cuda(tiles: torch.Tensor, bits: int, codebook: Codebook) -> torch.Tensor:
    return viterbi_cuda(tiles if tiles.is_cuda else tiles.to("cuda"), bits, codebook).to(tiles.device)


def _exllamav3(tiles: torch.Tensor, bits: int, codebook: Codebook) -> torch.Tensor:
    from exllamav3.modules.quant.exl3_lib.quantize import (
        quantize_tiles,  # lazy: optional, CUDA only
    )

    args = {"K": bits, "mcg": codebook is Codebook.MCG, "mul1": codebook is Codebook.MUL1}
    x = tiles.to("cuda") if not tiles.is_cuda else tiles
    # ExLlamaV3 itself never sends more than 65,536 tiles per call
    idx = torch.cat([quantize_tiles(x[i : i + 32768].contiguous(), args)[1] for i in range(0, x.shape[0], 32768)])
    return (idx.to(torch.int32) & 0xFFFF).to(tiles.device)


def exllamav3_available() -> bool:
    """True when exllamav3 and its compiled extension import (needs CUDA)."""
    try:
        import exllamav3.modules.quant.exl3_lib.quantize  # noqa: F401 - imported only to see that it imports
    except Exception:  # noqa: BLE001 - an absent package or a failed extension build: "not available"
        return False
    return torch.cuda.is_available()


def select_backend(device: str | torch.device = "cpu", name: str | None = None) -> TileSearch:
    """The backend `name` (or $GLMQUANT_EXL3_BACKEND), else the fastest one for `device`."""
    name = name or os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown EXL3 backend {name!r}; choose one of {BACKENDS}")
    is_cuda = torch.device(device).type == "cuda"
    if name is None:
        if is_cuda:
            name = "cuda" if cuda_viterbi_available() else "exllamav3" if exllamav3_available() else "torch"
        else:
            name = "native" if load_kernel() is not None else "torch"
    if name == "native" and load_kernel() is None:
        raise RuntimeError("the native EXL3 Viterbi kernel could not be built (see the warning above)")
    if name == "cuda" and not cuda_viterbi_available():
        raise RuntimeError("backend 'cuda' needs a CUDA device and nvcc to build the kernel")
    if name == "exllamav3" and not exllamav3_available():
        raise RuntimeError("backend 'exllamav3' needs the exllamav3 package and a CUDA device")
    return TileSearch(name, {"native": _native, "torch": _torch, "cuda": _cuda, "exllamav3": _exllamav3}[name])


def quantize_tiles(
    search: TileSearch, tiles: torch.Tensor, bits: int, codebook: Codebook
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp32, states int32) for (n, 256) ring-ordered tiles."""
    states = search(tiles, bits, codebook).to(tiles.device)
    return _lut(codebook, tiles.device)[states.long()], states
