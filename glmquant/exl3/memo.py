"""A directory of finished encodes keyed by everything an encode depends on, so that an encode repeated with the same
inputs (a recipe sweep's stocks, the retained costs and then the row that uses them, a benchmark run again) reads the
result back instead of encoding again. `encode_linears` keeps one where $GLMQUANT_ENCODE_MEMO names a directory.

The key covers the weight's and the Hessian's bytes, dtype and shape, K, codebook, seed, scale search, refit rounds,
the Viterbi backend (and ExLlamaV3's version for its own), the GPU's name or the CPU's flags and compiler, float32
matmul precision, torch's version and the codec's own source files, so an entry is only ever read back by an encode
that would compute the same bytes. An entry is one safetensors file written whole (a temporary file renamed into
place); an unreadable one is a miss and is written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from glmquant.environment import ENCODE_MEMO
from glmquant.exl3.backends import TileSearch
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.native import cpu_signature, cxx_compiler
from glmquant.exl3.tensor import EXL3Tensor

_SOURCES = ("*.py", "*.cpp", "*.cu")


@lru_cache(maxsize=1)
def _codec_digest() -> bytes:
    """The codec's source files and torch's version: a changed encoder never reads an old entry."""
    digest = hashlib.sha256(torch.__version__.encode())
    root = Path(__file__).parent
    for path in sorted(p for pattern in _SOURCES for p in root.glob(pattern)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _tensor_digest(tensor: torch.Tensor | None) -> bytes:
    digest = hashlib.sha256()
    if tensor is None:
        digest.update(b"none")
    else:
        flat = tensor.detach().contiguous().cpu()
        digest.update(f"{flat.dtype}{tuple(flat.shape)}\0".encode())
        digest.update(flat.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def _arithmetic(device: torch.device, search: TileSearch) -> dict[str, object]:
    """What decides the arithmetic beside the code: the GPU (by name) or the CPU (its flags, which -march=native builds
    the Viterbi kernel for) and compiler, float32 matmul precision, and ExLlamaV3's version where its backend runs."""
    facts: dict[str, object] = {"matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        facts |= {"device": f"cuda:{torch.cuda.get_device_name(device)}"}
        facts |= {"tf32": torch.backends.cuda.matmul.allow_tf32}
    else:
        facts |= {"device": device.type, "cpu": cpu_signature(), "cxx": cxx_compiler()}
    if search.name == "exllamav3":
        from importlib.metadata import version

        facts["exllamav3"] = version("exllamav3")
    return facts


class EncodeMemo:
    """Finished encodes in `directory`, one file per (weight, Hessian, settings)."""

    def __init__(
        self, directory: Path, settings: Mapping[str, object], device: torch.device, search: TileSearch
    ) -> None:
        """`settings`: the encode's options besides the weight and the Hessian; `search` the Viterbi backend."""
        self.directory = directory
        facts = {**settings, "backend": search.name, **_arithmetic(device, search)}
        self._head = hashlib.sha256(_codec_digest() + json.dumps(facts, sort_keys=True).encode())

    def keys(self, items: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> list[str]:
        """Each (weight, Hessian)'s key; a Hessian object that several weights share (gate/up) is hashed once."""
        hessians: dict[int, bytes] = {}
        out = []
        for weight, hessian in items:
            if id(hessian) not in hessians:
                hessians[id(hessian)] = _tensor_digest(hessian)
            digest = self._head.copy()
            digest.update(_tensor_digest(weight) + hessians[id(hessian)])
            out.append(digest.hexdigest())
        return out

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def get(self, key: str) -> tuple[EXL3Tensor, float, str | None, bool] | None:
        """(tensor, proxy error, fallback, calibrated) kept under `key`; None when absent or unreadable."""
        path = self._path(key)
        try:
            with safe_open(path, "pt") as entry:
                facts = json.loads(entry.metadata()["facts"])
                trellis, suh, svh = (entry.get_tensor(name) for name in ("trellis", "suh", "svh"))
            codebook = Codebook(facts["codebook"])
            tensor = EXL3Tensor(trellis, suh, svh, codebook, facts["in_features"], facts["out_features"])
        except (OSError, SafetensorError, KeyError, TypeError, ValueError):
            return None
        return tensor, float(facts["proxy_error"]), facts["fallback"], bool(facts["calibrated"])

    def put(self, key: str, tensor: EXL3Tensor, proxy_error: float, fallback: str | None, calibrated: bool) -> None:
        """Keep an encode under `key`, written whole or not at all."""
        facts = {
            "codebook": tensor.codebook.value,
            "in_features": tensor.in_features,
            "out_features": tensor.out_features,
            "proxy_error": proxy_error,
            "fallback": fallback,
            "calibrated": calibrated,
        }
        parts = {"trellis": tensor.trellis, "suh": tensor.suh, "svh": tensor.svh}
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.directory)
            os.close(fd)
            save_file({k: v.contiguous().cpu() for k, v in parts.items()}, tmp, {"facts": json.dumps(facts)})
            os.replace(tmp, self._path(key))
        except (OSError, SafetensorError) as err:  # a full disk costs the memo an entry, not the encode its result
            warnings.warn(f"{ENCODE_MEMO} {self.directory}: an encode was not kept ({err})", stacklevel=2)
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
