"""Run a GLM-5.3-Flash text model one decoder layer at a time, exactly as transformers' model does.

The model's forward: embeddings e [N,T,H] are copied into `hc_mult` hyper-connection streams
[N,T,hc,H]; each decoder layer maps streams to streams (attention mask all ones: calibration rows are
packed, never padded; NoPE, so no position embeddings); the end collapses the streams with the mean
(HyperHead) and applies the final RMSNorm. Here each stage is transformers' own module, built and filled
from the source shards only while it runs, so memory is one layer plus the hidden streams.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glmquant.arch import ModelSpec, load_model_spec, source_tensors, table_for
from glmquant.arch.hf_glm5_next import modeling
from glmquant.arch.module_map import LayerPlan, check_finite, fp32_names, layer_plan, read_layer_state
from glmquant.arch.roles import TensorRole
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.errors import ConfigError, UsageError
from glmquant.observe.layer_loader import load_decoder_layer, model_dtype, text_config


@dataclass(frozen=True)
class TextModel:
    """A source checkpoint opened for streaming: config and tensor locations, no weights held."""

    ckpt: SourceCheckpoint
    spec: ModelSpec
    cfg: Any  # transformers Glm5NextTextConfig
    device: torch.device

    @classmethod
    def open(
        cls, source: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> TextModel:
        """`dtype`: compute in it instead of the config's (e.g. float32, to measure small differences)."""
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for but torch sees no CUDA device")
        spec = load_model_spec(Path(source) / "config.json")
        cfg = text_config(source)
        if "shared" in (getattr(cfg, "indexer_types", None) or []):
            raise ConfigError(
                f"{source}: 'shared' DSA indexer layers carry top-k indices across layers; "
                "layer streaming supports only 'full' indexer layers (as GLM-5.3-Flash has)"
            )
        if dtype is not None:
            cfg.dtype = dtype
        ckpt = SourceCheckpoint.open(source)
        ckpt.check_specs(source_tensors(spec), dtypes=False)  # read in any float dtype, computed in the model's
        return cls(ckpt, spec, cfg, device)

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.cfg)

    @property
    def num_layers(self) -> int:
        return self.spec.num_hidden_layers

    def plan(self, layer: int) -> LayerPlan:
        return layer_plan(self.spec, layer, self.cfg.moe_intermediate_size)

    def layer(self, layer: int) -> nn.Module:
        return load_decoder_layer(self.ckpt, self.spec, self.cfg, layer, self.device)

    def mtp_layer(self) -> nn.Module:
        """The MTP layer (`arch.hf_glm5_mtp.MtpLayer`, layer index `num_hidden_layers`) with its source weights, on the
        source's embedding; its `block` gives the hidden states observe hooks (the head is not needed there)."""
        from glmquant.arch.hf_glm5_mtp import MtpLayer

        if not self.spec.mtp_layers:
            raise ConfigError(f"{self.ckpt.directory}: the model has no MTP layer (num_nextn_predict_layers is 0)")
        glm, layer = modeling(), self.spec.mtp_layers[0]
        embed = nn.Embedding.from_pretrained(self._tensor("embed_tokens.weight"), freeze=True)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                module = MtpLayer(self.cfg, embed, nn.Identity())
        finally:
            torch.set_default_dtype(previous)
        module.config._attn_implementation = self.cfg._attn_implementation  # as the decoder layers run
        module.config._experts_implementation = self.cfg._experts_implementation
        keep_fp32 = fp32_names(glm.Glm5NextPreTrainedModel._keep_in_fp32_modules_strict)
        state = read_layer_state(self.ckpt, self.plan(layer), module.state_dict(), keep_fp32, self.device)
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()

    def _tensor(self, suffix: str) -> torch.Tensor:
        name = table_for(self.spec).text_prefix + suffix
        tensor = self.ckpt.read_tensor(name).to(self.device, self.dtype)
        check_finite(self.ckpt, name, tensor)
        return tensor

    def embed(self, batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Token ids [B,T] -> hyper-connection streams [B,T,hc,H], reading the embedding once."""
        weight = self._tensor("embed_tokens.weight")
        for ids in batches:
            emb = F.embedding(ids.to(self.device, torch.long), weight)
            yield emb.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()

    def head_weight(self) -> torch.Tensor:
        """lm_head's weight (the input embedding's where they are tied) in the compute dtype."""
        if self.spec.tie_word_embeddings:
            return self._tensor("embed_tokens.weight")
        heads = [t for t in source_tensors(self.spec) if t.role is TensorRole.LM_HEAD and len(t.shape) == 2]
        if len(heads) != 1:
            raise ConfigError(
                f"{self.spec.architecture}: {len(heads)} 2-D lm_head weights in its tensor table, not one"
            )
        tensor = self.ckpt.read_tensor(heads[0].name).to(self.device, self.dtype)
        check_finite(self.ckpt, heads[0].name, tensor)
        return tensor

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [B,T,hc,H] -> last hidden state [B,T,H] (HyperHead mean, then the final norm)."""
        glm = modeling()

        norm = glm.Glm5NextTextRMSNorm(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps)
        norm.weight = nn.Parameter(self._tensor("norm.weight"), requires_grad=False)
        return norm(glm.Glm5NextTextHyperHead()(streams))


def run_layer(module: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """One decoder layer over unpadded rows: streams [B,T,hc,H] -> [B,T,hc,H]."""
    batch, tokens = streams.shape[:2]
    mask = torch.ones(batch, tokens, dtype=torch.bool, device=streams.device)
    positions = torch.arange(tokens, device=streams.device).unsqueeze(0)
    with torch.no_grad():
        out = module(streams, attention_mask=mask, position_ids=positions, position_embeddings=None)
    return out[0] if isinstance(out, tuple) else out


def stream_final_hidden(
    source_dir: str | Path, input_ids: torch.Tensor, device: str = "cpu", batch_rows: int | None = None
) -> torch.Tensor:
    """The model's last hidden state [N,T,H] for `input_ids` [N,T], holding one decoder layer at a time.

    Equal (bit for bit on one device) to `Glm5NextForConditionalGeneration.from_pretrained(source_dir,
    dtype=bf16).model(input_ids).last_hidden_state`. Rows go through each layer `batch_rows` at a time.
    """
    if input_ids.dim() != 2:
        raise UsageError(f"input_ids must be [rows, tokens], got shape {list(input_ids.shape)}")
    model = TextModel.open(source_dir, device)
    step = batch_rows or input_ids.shape[0]
    with model.ckpt, torch.no_grad():
        streams = torch.cat(list(model.embed(input_ids.split(step))))
        for i in range(model.num_layers):
            module = model.layer(i)
            streams = torch.cat([run_layer(module, part) for part in streams.split(step)])
            del module
        return model.collapse(streams)


def kda_implementation() -> str:
    """Which KDA kernels transformers' GLM-5.3-Flash module runs: flash-linear-attention's Triton kernels when
    `fla.ops.kda` imports (transformers resolves `chunk_kda` there when it first imports the model), else its
    reference PyTorch loop (about 5x slower at real widths, and far more memory)."""
    import importlib.metadata

    try:
        from fla.ops.kda import chunk_kda  # noqa: F401 - imported only to see that it imports
    except Exception:  # noqa: BLE001 - absent, or present but broken (no Triton, no einops): the fallback runs
        return "torch reference"
    try:
        return f"flash-linear-attention (fla-core {importlib.metadata.version('fla-core')})"
    except importlib.metadata.PackageNotFoundError:
        return "flash-linear-attention"
