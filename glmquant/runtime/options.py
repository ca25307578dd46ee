"""RuntimeOptions: how to run an artifact, built once at the CLI edge (or by a test) and passed down."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmquant.errors import UsageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class RuntimeOptions:
    """`dtype` is that of the activations and of every tensor transformers keeps in the model dtype;
    `expert_cache` counts decoded virtual experts the torch backend keeps (0: decode on every use)."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    expert_cache: int = 256
    backend: str = "torch"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.expert_cache < 0:
            raise UsageError(f"--expert-cache must be >= 0, got {self.expert_cache}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise UsageError(f"--device {self.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
