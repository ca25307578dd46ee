"""The checkpoint's MTP layer as a module: the drafter of MTP speculative decoding (`runtime.speculative`).

GLM-5.3-Flash keeps one multi-token-prediction layer after its decoder layers (`num_nextn_predict_layers`: 1,
layer index `num_hidden_layers`), built like DeepSeek-V3's: for position i it takes the target model's final
hidden state h_i and the embedding of the next token t_{i+1}, normalizes each (`hnorm`, `enorm`), projects their
concatenation [enorm(e); hnorm(h)] back to the hidden size (`eh_proj`), runs one decoder block (sparse MLA with
its DSA indexer and a MoE, plain residuals: no mHC streams) and reads the logits of t_{i+2} through
`shared_head.norm` and the target's own `lm_head` (the embedding is the target's too; an EXL3 head, `encode
--head-bits`, is that same module). Its weights are retained (BF16) in the artifact, experts included; transformers
has no module for the layer, so this one assembles it from transformers' attention and MoE modules on a one-layer
copy of the text config, and keeps its own cache.

What the layer reads as h_i: the target's last hidden state after its final norm, as vLLM's DeepSeek MTP takes
the target model's output hidden states; the release does not document its own choice. A different choice
would only lower the acceptance rate: verification keeps the output exactly the target's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from glmquant.arch import ModelSpec, table_for
from glmquant.arch.hf_glm5_next import modeling
from glmquant.arch.module_map import TensorSource, fp32_names, layer_plan, read_layer_state
from glmquant.checkpoint.draft_head import DraftMtpTensors, read_draft_head, read_draft_mtp
from glmquant.errors import ConfigError
from glmquant.exl3.decode import decode_weight
from glmquant.runtime.generate import cache_argument
from glmquant.runtime.loader import retained_linear_mode
from glmquant.runtime.retained_linears import Exl3Linear

if TYPE_CHECKING:
    from transformers import DynamicCache

    from glmquant.runtime.loader import LoadedModel


class MtpLayer(nn.Module):
    """One MTP layer: `forward(hidden [B, S, H], next_ids [B, S], cache)` -> (logits [B, S, V], hidden [B, S, H]).

    Submodules carry the checkpoint's names (after transformers' renames), so `module_map.layer_plan` fills them.
    Without a cache it runs causally over whole sequences, differentiably: the proxy trains it so
    (`proxy.train`; the indexer is not trained, as transformers runs it without gradients).
    """

    def __init__(self, text_config: Any, embed: nn.Embedding, lm_head: nn.Module) -> None:
        hf = modeling()

        super().__init__()
        self.config = one_layer_config(text_config)
        h, eps = self.config.hidden_size, self.config.rms_norm_eps
        self.enorm = hf.Glm5NextTextRMSNorm(h, eps)
        self.hnorm = hf.Glm5NextTextRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = hf.Glm5NextTextRMSNorm(h, eps)
        self.self_attn = hf.Glm5NextTextAttention(self.config, 0)
        self.post_attention_layernorm = hf.Glm5NextTextRMSNorm(h, eps)
        self.mlp = hf.Glm5NextTextMoE(self.config)
        self.shared_head = SharedHead(hf.Glm5NextTextRMSNorm(h, eps))
        self._cache_kw = cache_argument(self.self_attn)  # `past_key_values` before transformers 5.2x: else ignored
        # the target's own tensors, shared (kept out of this module's state_dict)
        self._embed = [embed]
        self._lm_head = [lm_head]

    def new_cache(self) -> DynamicCache:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def forward(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: DynamicCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.block(hidden, next_ids, cache)
        return self._lm_head[0](self.shared_head.norm(x)), x

    def block(self, hidden: torch.Tensor, next_ids: torch.Tensor, cache: DynamicCache | None) -> torch.Tensor:
        """The layer's output hidden states [B, S, H], before its head (what `observe` captures Hessians over)."""
        x = self.eh_proj(torch.cat([self.enorm(self._embed[0](next_ids)), self.hnorm(hidden)], dim=-1))  # [B, S, H]
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)  # no padding: the indexer's valid keys
        attn, _, _ = self.self_attn(
            hidden_states=self.input_layernorm(x), attention_mask=mask, **{self._cache_kw: cache}
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """`shared_head.norm`: the norm before the target's lm_head (the head itself is shared, not stored)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm


def one_layer_config(text_config: Any) -> Any:
    """The text config of a model made of the MTP layer alone: one sparse-MLA layer with its own indexer and MoE,
    so transformers' modules and `DynamicCache` build exactly that layer at index 0. The layer type is the target's
    own MLA layers' name: transformers releases name it differently ("indexed_attention" in 5.24; 5.17's
    `DynamicCache` has no layer of that name), and the target's cache builds with it."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    config.layer_types = [next(t for t in text_config.layer_types if t != "linear_attention")]
    config.indexer_types = ["full"]
    config.mlp_layer_types = ["sparse"]
    return config


class DecodedCopies:
    """A checkpoint whose tensors named in `decoded` read as those instead (a `module_map.TensorSource`): the MTP
    layer filled from a draft file's copy, decoded, and the artifact's other tensors."""

    def __init__(self, base: TensorSource, decoded: dict[str, torch.Tensor]) -> None:
        self.base, self.decoded = base, decoded

    @property
    def directory(self) -> Path:
        return self.base.directory

    def __contains__(self, name: str) -> bool:
        return name in self.decoded or name in self.base

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.decoded[name] if name in self.decoded else self.base.read_tensor(name)

    def shard_of(self, name: str) -> str:
        return self.base.shard_of(name)

    @classmethod
    def of(cls, base: TensorSource, mtp_copy: DraftMtpTensors, spec: ModelSpec, dtype: torch.dtype) -> DecodedCopies:
        """`base` with `mtp_copy`'s linears and routed experts decoded to `dtype` under their weights' names."""
        table = table_for(spec)
        decoded = {f"{key}.weight": decode_weight(t, dtype) for key, t in mtp_copy.linears.items()}
        for e, projections in enumerate(mtp_copy.experts):
            for proj, t in projections.items():
                decoded[table.expert_name(mtp_copy.layer, e, proj)] = decode_weight(t, dtype)
        return cls(base, decoded)


def load_mtp(loaded: LoadedModel) -> MtpLayer:
    """The artifact's MTP layer on the loaded model's device and dtype, sharing its embedding and lm_head (or
    reading the speculative config's `draft_head`, run as the retained EXL3 linears are)."""
    artifact, model = loaded.artifact, cast(Any, loaded.model)
    spec = artifact.spec
    if not spec.mtp_layers:
        raise ConfigError(f"{artifact.path}: the model has no MTP layer (num_nextn_predict_layers is 0)")
    device, dtype = loaded.device, loaded.options.torch_dtype
    head, speculative = model.lm_head, loaded.options.speculative_config
    draft_head = speculative.draft_head if speculative is not None else None
    if draft_head is not None:
        tensor = read_draft_head(draft_head, spec.hidden_size, spec.vocab_size, device)
        head = Exl3Linear(tensor, retained_linear_mode(loaded.options.backend), dtype, source=str(draft_head))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            mtp = MtpLayer(model.config.get_text_config(), model.get_input_embeddings(), head)
    finally:
        torch.set_default_dtype(previous)
    mtp.config._attn_implementation = model.config.get_text_config()._attn_implementation
    keep_fp32 = (
        fp32_names(getattr(model, "_keep_in_fp32_modules_strict", None))
        if dtype in (torch.float16, torch.bfloat16)
        else None
    )
    layer = spec.mtp_layers[0]
    plan = layer_plan(spec, layer, spec.moe_intermediate_size)
    source: TensorSource = artifact.checkpoint
    mtp_copy = None if draft_head is None else read_draft_mtp(draft_head, spec, "cpu")
    if mtp_copy is not None:  # the drafts read the copy, decoded (as the torch backend runs EXL3 linears)
        source = DecodedCopies.of(artifact.checkpoint, mtp_copy, spec, dtype)
    state = read_layer_state(source, plan, mtp.state_dict(), keep_fp32, device)
    mtp.load_state_dict(state, assign=True)
    missing = [n for n, p in mtp.named_parameters() if p.is_meta]
    if missing:
        prefix = table_for(spec).layer_prefix(layer)
        raise ConfigError(f"{artifact.path}: MTP layer {prefix} leaves {missing[:3]} unfilled")
    return mtp.eval()
