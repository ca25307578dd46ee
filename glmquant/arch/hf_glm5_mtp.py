"""GLM-5.3-Flash's MTP layer as a module, built from transformers' attention and MoE modules.

GLM-5.3-Flash keeps one multi-token-prediction layer after its decoder layers (`num_nextn_predict_layers`: 1,
layer index `num_hidden_layers`), built like DeepSeek-V3's: for position i it takes the target model's final
hidden state h_i and the embedding of the next token t_{i+1}, normalizes each (`hnorm`, `enorm`), projects their
concatenation [enorm(e); hnorm(h)] back to the hidden size (`eh_proj`), runs one decoder block (sparse MLA with
its DSA indexer and a MoE, plain residuals: no mHC streams) and reads the logits of t_{i+2} through
`shared_head.norm` and the target's own `lm_head` (the embedding is the target's too). transformers has no module
for the layer, so this one assembles it on a one-layer copy of the text config and keeps its own cache. The
runtime drafts with it (`runtime.mtp`), observe captures its Hessians (`observe.streaming`) and the proxy trains it
(`proxy.train`).

What the layer reads as h_i: the target's last hidden state after its final norm, as vLLM's DeepSeek MTP takes
the target model's output hidden states; the release does not document its own choice. A different choice
would only lower the acceptance rate: verification keeps the output exactly the target's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from glmquant.arch.hf_glm5_next import cache_argument, modeling

if TYPE_CHECKING:
    from transformers import DynamicCache


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
