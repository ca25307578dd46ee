"""`MtpDecoder`: a transformers GLM-5.3-Flash model and its MTP layer (`runtime.mtp`) as a `SpeculativeDecoder`
(`runtime.speculative`): draft with the MTP layer, verify in one target forward, roll the caches back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from glmquant.arch.hf_glm5_next import cache_argument
from glmquant.runtime.generate import PromptInputs
from glmquant.runtime.speculative import SpecStats

if TYPE_CHECKING:
    from transformers import DynamicCache

    from glmquant.arch.hf_glm5_mtp import MtpLayer


class MtpDecoder:
    """A transformers GLM-5.3-Flash model with its MTP layer as a `SpeculativeDecoder` (one sequence)."""

    def __init__(self, model: Any, mtp: MtpLayer, num_speculative_tokens: int) -> None:
        self.model = model  # Glm5NextForConditionalGeneration: its inner model and lm_head are called
        self.mtp = mtp
        self.k = num_speculative_tokens
        self.device = next(model.parameters()).device
        self.stats = SpecStats()
        self._cache_kw: dict[str, Any] = {}
        self._mtp_cache: DynamicCache | None = None
        # target hidden states the MTP layer has not read yet, and the tokens after each (one fewer: the last's
        # next token is the one the next step feeds)
        self._hidden: torch.Tensor | None = None
        self._next: list[int] = []

    def prefill(self, prompt: PromptInputs) -> torch.Tensor:
        from transformers import DynamicCache

        self.stats = SpecStats()
        self._cache_kw = {
            cache_argument(self.model.model): DynamicCache(config=self.model.config.get_text_config()),
            "use_cache": True,
        }
        self._mtp_cache = self.mtp.new_cache()
        vision = {k: v.to(self.device) for k, v in prompt.vision.items()}
        hidden = self._forward(prompt.input_ids.to(self.device), **vision)
        self._hidden, self._next = hidden, prompt.input_ids[0, 1:].tolist()
        return self.model.lm_head(hidden[:, -1])[0]

    def step(self, token: int) -> torch.Tensor:
        """One token without drafting (a sampled generation, which never speculates): the MTP layer stops
        following this sequence, and its pending hidden states are let go."""
        self._hidden, self._next = None, []
        return self.model.lm_head(self._forward(self._ids([token]))[:, -1])[0]

    def speculate(self, token: int) -> list[torch.Tensor]:
        drafts = self._draft(token)
        ids = [token, *drafts]
        saved = _save_recurrent(self._cache)
        hidden = self._forward(self._ids(ids))  # [1, k + 1, H]
        logits = self.model.lm_head(hidden)[0]  # [k + 1, V]
        greedy = logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        out = list(logits[: n + 1])
        if n < len(drafts):  # back to before the verify forward, then the accepted tokens again
            _restore(self._cache, saved, len(ids))
            hidden = self._forward(self._ids(ids[: n + 1]))
            # the next token from the forward the cache now holds: with no draft accepted, exactly plain decoding's
            # one-token step (a k + 1-token forward rounds differently in 16-bit); the accepted drafts' logits stay
            # the verify forward's, whose argmax they are
            out[n] = self.model.lm_head(hidden[:, -1])[0]
        self._hidden, self._next = hidden[:, : n + 1], drafts[:n]
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += n
        return out

    @property
    def _cache(self) -> DynamicCache:
        return next(v for k, v in self._cache_kw.items() if k != "use_cache")

    def _draft(self, token: int) -> list[int]:
        """k greedy drafts: the MTP layer reads every target hidden state not read yet (the last with `token`),
        then feeds its own output hidden state and draft k - 1 more times; those positions leave its cache."""
        if self._hidden is None or self._mtp_cache is None:
            raise RuntimeError("speculate() needs a prefill and no step() since: the MTP layer missed positions")
        logits, hidden = self.mtp(self._hidden, self._ids([*self._next, token]), self._mtp_cache)
        drafts = [int(logits[0, -1].argmax())]
        for _ in range(self.k - 1):
            logits, hidden = self.mtp(hidden[:, -1:], self._ids(drafts[-1:]), self._mtp_cache)
            drafts.append(int(logits[0, -1].argmax()))
        if self.k > 1:
            self._mtp_cache.crop(-(self.k - 1))
        return drafts

    def _forward(self, input_ids: torch.Tensor, **vision: torch.Tensor) -> torch.Tensor:
        """The target's final hidden states [1, S, H] (after its final norm) for `input_ids`, cache updated."""
        return self.model.model(input_ids=input_ids, **vision, **self._cache_kw).last_hidden_state

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)


def _save_recurrent(cache: DynamicCache) -> dict[int, list[torch.Tensor]]:
    """Copies of each linear-attention (KDA) layer's live state tensors (`_kda_state`)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return {
        i: [state.clone() for state in _kda_state(layer)]
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    }


def _restore(cache: DynamicCache, saved: dict[int, list[torch.Tensor]], tokens: int) -> None:
    """The cache as before the last `tokens` tokens: KDA states put back (in place: the cache's tensors keep their
    addresses), attention caches cut."""
    layers: list[Any] = list(cache.layers)
    for i, layer in enumerate(layers):
        if i in saved:
            for state, copy in zip(_kda_state(layer), saved[i], strict=True):
                state.copy_(copy)
        else:
            layer.crop(-tokens)


def _kda_state(layer: Any) -> list[torch.Tensor]:
    """A KDA cache layer's conv and recurrent state, and its token count where the layer keeps one
    (`cumulative_length_linear`, transformers >= 5.25: the cache's length, hence the positions of the next tokens, is
    read from the first layer, a KDA layer)."""
    conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
    assert conv is not None and recurrent is not None, "KDA states exist after the prefill"
    count = getattr(layer, "cumulative_length_linear", None)
    return [conv, recurrent, *([count] if isinstance(count, torch.Tensor) else [])]
