"""RuntimeOptions: how to run an artifact, built once at the CLI edge (or by a test) and passed down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from glmquant.errors import UsageError
from glmquant.runtime.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from glmquant.checkpoint.layouts import RetainedLinear
    from glmquant.exl3.tensor import EXL3Tensor

# vLLM's --dtype names; "auto" is the checkpoint's own 16-bit dtype (BF16 for a float32 config)
DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
}
DTYPE_CHOICES = ("auto", *DTYPES)
LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: "auto" reads the artifact's weight files
MODEL_IMPLS = ("transformers", "glmquant")  # vLLM's --model-impl: whose modules run the model
# EXL3 retained linears of at most this many weights run decoded: 192 of GLM-5.3-Flash's 529 (KDA's f_a/f_b/g_a/
# g_b/b, the indexer's wk and weights_proj; 123.1 M weights, +175.8 MB read per token in BF16), each otherwise
# three launches whatever its size (~9 us on the H200, 62e2343's profile)
DENSE_LINEAR_MAX_WEIGHTS = 1 << 20


def decoded_at_load(linear: RetainedLinear | EXL3Tensor, max_weights: int) -> bool:
    """Whether the Triton backends run this EXL3 retained linear (or a draft file's EXL3 tensor) decoded
    (`dense_linear_max_weights`), in the engine and in transformers' modules alike."""
    return linear.in_features * linear.out_features <= max_weights


@dataclass(frozen=True)
class RuntimeOptions:
    """`dtype` is that of the activations and of every tensor transformers keeps in the model dtype;
    `expert_cache` counts decoded virtual experts the torch backend keeps (0: decode on every use);
    `load_format` "dummy" makes the weights from the config (`runtime.dummy`) instead of reading files;
    `model_impl` "glmquant" runs the runtime's own forward (`runtime.engine`) instead of transformers' modules;
    `speculative_config` (vLLM's `--speculative-config`) drafts tokens with the model's MTP layer;
    `compile_decode` runs the engine's decode-step math through torch.compile (fewer, fused kernels per step);
    `dense_linear_max_weights`: with the Triton backends, EXL3 retained linears of at most this many weights are
    decoded to dense weights at load (in the engine adjacent dense blocks of a projection become one matrix
    product) instead of running the EXL3 kernels on them (0: none)."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    expert_cache: int = 256
    backend: str = "torch"
    load_format: str = "auto"
    model_impl: str = "transformers"
    speculative_config: SpeculativeConfig | None = None
    compile_decode: bool = False
    dense_linear_max_weights: int = DENSE_LINEAR_MAX_WEIGHTS

    def __post_init__(self) -> None:
        if self.dense_linear_max_weights < 0:
            raise UsageError(f"--dense-linear-max-weights must be >= 0, got {self.dense_linear_max_weights}")
        if self.compile_decode and self.model_impl != "glmquant":
            raise UsageError("--compile-decode compiles the runtime's own forward: it needs --model-impl glmquant")
        if self.dtype not in DTYPE_CHOICES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.expert_cache < 0:
            raise UsageError(f"--expert-cache must be >= 0, got {self.expert_cache}")
        for option, value, choices in (
            ("--load-format", self.load_format, LOAD_FORMATS),
            ("--model-impl", self.model_impl, MODEL_IMPLS),
        ):
            if value not in choices:
                raise UsageError(f"{option} must be one of {', '.join(choices)}, got {value!r}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise UsageError(f"--device {self.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise UsageError("dtype 'auto' names no torch dtype until resolved against a config (resolved_for)")
        return DTYPES[self.dtype]

    def resolved_for(self, config: Mapping[str, Any]) -> RuntimeOptions:
        """These options with "auto" replaced by the config's dtype (float16 stays, anything else is
        bfloat16, as vLLM does) and aliases by their torch names (half -> float16, float -> float32)."""
        if self.dtype != "auto":
            name = str(DTYPES[self.dtype]).removeprefix("torch.")
        else:
            nested = config.get("text_config")
            text = nested if isinstance(nested, Mapping) else {}
            declared = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
            name = "float16" if declared == "float16" else "bfloat16"
        return replace(self, dtype=name)
