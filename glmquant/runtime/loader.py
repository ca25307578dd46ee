"""Build transformers' GLM-5.3-Flash model from an artifact, with quantized experts in place of the BF16 ones.

The model is created on the meta device (no memory for the ~640 GB of BF16 experts), each MoE layer's
`mlp.experts` is replaced by a `QuantizedExperts` bound to one shared backend, and the retained tensors
are read one decoder layer at a time and assigned as they are (converted to module names by the same
layer plan the observe stage uses, `glmquant.arch.module_map`: renames, q/k/v convolutions concatenated).
Every other computation is transformers' own `model(...)` forward, so the non-expert math is exactly the reference.
The MTP layer is loaded only for MTP speculative decoding (`--speculative-config`, `runtime.mtp`): transformers
has no module for it and plain decoding does not use it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from rich.progress import track
from torch import nn

from glmquant.arch import table_for
from glmquant.arch.hf_glm5_next import modeling
from glmquant.arch.module_map import ATTN_IMPLEMENTATION, fp32_names, layer_plan, read_layer_state
from glmquant.devices import require_visible
from glmquant.errors import CheckpointFormatError, ConfigError, UsageError
from glmquant.runtime import torch_backend  # noqa: F401  (registers the "torch" backend)
from glmquant.runtime.artifact import Artifact, open_artifact
from glmquant.runtime.generate import Decoder
from glmquant.runtime.options import RuntimeOptions, decoded_at_load
from glmquant.runtime.quantized_experts import BACKENDS, ExpertBackend, QuantizedExperts
from glmquant.runtime.retained_linears import Exl3Linear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from glmquant.arch.hf_glm5_mtp import MtpLayer


@dataclass(frozen=True)
class LoadedModel:
    """A ready model: transformers' module tree plus the backend its quantized experts share, and its MTP layer
    when the options ask for speculative decoding."""

    model: nn.Module
    artifact: Artifact
    backend: ExpertBackend
    options: RuntimeOptions
    mtp: MtpLayer | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.options.device)

    def close(self) -> None:
        """Release the artifact's open shard files (experts are read from them on demand while serving)."""
        self.artifact.checkpoint.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[nn.Module | Decoder]:
        """What one generation runs on: the model itself (each generation makes its own cache), or with
        speculative decoding a fresh `MtpDecoder` over it."""
        spec = self.options.speculative_config
        if self.mtp is None or spec is None:
            yield self.model
        else:
            from glmquant.runtime.mtp_decoder import MtpDecoder

            yield MtpDecoder(self.model, self.mtp, spec.num_speculative_tokens)


def load_artifact(path: str | Path, options: RuntimeOptions) -> Artifact:
    """The artifact at `path`; with `--load-format dummy` the one `plan` predicts from the config there (weights
    made on `options.device`, no files read)."""
    if options.load_format == "dummy":
        from glmquant.runtime.dummy import dummy_artifact

        return dummy_artifact(path, device=options.device)
    return open_artifact(path)


def load_model(source: str | Path | Artifact, options: RuntimeOptions = RuntimeOptions()) -> LoadedModel:
    """The artifact at `source` (or already open) as transformers' model in eval mode on `options.device`."""
    artifact = source if isinstance(source, Artifact) else load_artifact(source, options)
    if artifact.spec.family != "glm5_next":
        raise ConfigError(f"{artifact.path}: the runtime serves glm5_next artifacts, not {artifact.spec.family}")
    require_visible(options.device)
    options = options.resolved_for(artifact.config)
    dtype = options.torch_dtype
    with _default_dtype(dtype), torch.device("meta"):
        model = _model_class(artifact)(hf_config(artifact, options.dtype))
    backend = make_backend(artifact, options)
    table = table_for(artifact.spec)
    for layer in artifact.quantized_layers:
        model.set_submodule(f"{table.layer_prefix(layer)}mlp.experts", QuantizedExperts(layer, artifact.ranks, backend))
    _place_retained_linears(model, artifact, options, dtype)
    _load_retained(model, artifact, dtype, torch.device(options.device))
    _materialize_buffers(model, torch.device(options.device))
    loaded = LoadedModel(model.eval(), artifact, backend, options)
    if options.speculative_config is None:
        return loaded
    from glmquant.runtime.mtp import load_mtp

    return replace(loaded, mtp=load_mtp(loaded))


def hf_config(artifact: Artifact, dtype: str):
    """transformers' config from the artifact's config.json, without the quantization block it cannot parse,
    in `dtype` (sub-models are built in their own config's dtype, so every level gets it)."""
    from transformers import AutoConfig

    raw = {k: v for k, v in artifact.config.items() if k != "quantization_config"}
    raw = {k: {**v, "dtype": dtype} if isinstance(v, dict) and "model_type" in v else v for k, v in raw.items()}
    config = AutoConfig.for_model(**{**raw, "dtype": dtype})
    config._attn_implementation = ATTN_IMPLEMENTATION
    return config


def make_backend(artifact: Artifact, options: RuntimeOptions) -> ExpertBackend:
    """The expert backend named by `options.backend` (GPU kernels register themselves on import)."""
    if options.backend not in BACKENDS and importlib.util.find_spec("glmquant.runtime.kernels") is not None:
        importlib.import_module("glmquant.runtime.kernels")
    if options.backend not in BACKENDS:
        raise UsageError(f"unknown expert backend {options.backend!r}; available: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[options.backend](artifact, options)


def _model_class(artifact: Artifact) -> type[PreTrainedModel]:
    import transformers

    if artifact.spec.architecture == "Glm5NextForConditionalGeneration":
        modeling()  # its KDA and conv kernels follow the tensors' device (a CPU model beside CUDA kernels)
    cls = getattr(transformers, artifact.spec.architecture, None)
    if cls is None:
        raise ConfigError(
            f"{artifact.path}/config.json: transformers {transformers.__version__} has no {artifact.spec.architecture}"
        )
    return cls


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters without an explicit dtype are created in `dtype`, as from_pretrained(dtype=...) leaves them."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def retained_linear_mode(backend: str) -> str:
    """How EXL3 retained linears run with an expert backend: the Triton backends' kernels, else decoded once."""
    return "kernel" if backend.startswith("triton") else "decode"


def _place_retained_linears(
    model: PreTrainedModel, artifact: Artifact, options: RuntimeOptions, dtype: torch.dtype
) -> None:
    """Replace the `nn.Linear` of every retained linear stored as EXL3 (the speed tier), lm_head included, by an
    `Exl3Linear` (the MTP layer reads the head through the model's `lm_head`, so it gets the same one); with the
    Triton backends those of at most `options.dense_linear_max_weights` weights are decoded once, as the engine's."""
    if not artifact.retained_linears:
        return
    device, backend_mode = torch.device(options.device), retained_linear_mode(options.backend)
    for name, linear in artifact.retained_linear_modules().items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear) or old.bias is not None:
            raise CheckpointFormatError(f"{artifact.path}: {name} is not a bias-free linear; cannot hold {linear.key}")
        mode = "decode" if decoded_at_load(linear, options.dense_linear_max_weights) else backend_mode
        model.set_submodule(name, Exl3Linear(artifact.read_linear(linear, device), mode, dtype, linear.source))


def _load_retained(model: PreTrainedModel, artifact: Artifact, dtype: torch.dtype, device: torch.device) -> None:
    """Assign every retained tensor, one decoder layer at a time; unknown or missing tensors fail closed."""
    spec, ckpt = artifact.spec, artifact.checkpoint
    table = table_for(spec)
    keep_fp32 = (
        fp32_names(getattr(model, "_keep_in_fp32_modules_strict", None))
        if dtype in (torch.float16, torch.bfloat16)
        else None
    )
    retained = set(artifact.retained_names())
    exl3_sources = {lin.source for lin in artifact.retained_linears.values()}  # placed by _place_retained_linears
    placed: set[str] = set()
    for layer in track(range(spec.num_hidden_layers), description="loading layers", transient=True):
        plan = layer_plan(spec, layer, spec.moe_intermediate_size)
        kept = type(plan)(
            layer,
            tuple(
                p for p in plan.placements if not p.target.startswith("mlp.experts.") and p.source not in exl3_sources
            ),
        )
        module = model.get_submodule(table.layer_prefix(layer).rstrip("."))
        module.load_state_dict(read_layer_state(ckpt, kept, module.state_dict(), keep_fp32, device), assign=True)
        placed.update(p.source for p in kept.placements)
    params, top = dict(model.named_parameters()), {}
    for name in sorted(retained - placed):
        target = params.get(name)
        if target is None:
            raise CheckpointFormatError(f"{artifact.path}: tensor {name} has no place in {spec.architecture}")
        fp32 = keep_fp32 is not None and keep_fp32.search(name) is not None
        top[name] = ckpt.read_tensor(name).to(device=device, dtype=torch.float32 if fp32 else target.dtype)
    model.load_state_dict(top, strict=False, assign=True)
    if spec.tie_word_embeddings and "lm_head.weight" not in retained:
        cast(nn.Linear, model.lm_head).weight = cast(nn.Embedding, model.get_input_embeddings()).weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointFormatError(
            f"{artifact.path}: {len(missing)} model tensor(s) not in the artifact, e.g. {missing[:3]}"
        )


def _materialize_buffers(model: PreTrainedModel, device: torch.device) -> None:
    """Non-persistent buffers (vision rotary frequencies) are computed, not stored: let transformers init them."""
    for name, module in model.named_modules():
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            if any(True for _ in module.parameters(recurse=False)):
                raise CheckpointFormatError(f"module {name} has buffers missing from the artifact")
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)
