"""Greedy and sampled generation through a `Decoder`: one prefill forward, then one token per forward. A plain
transformers model runs with its own cache (KDA recurrent state, MLA KV and DSA indexer state in one
`DynamicCache`); the runtime's own engine brings its decoder (`runtime.engine.EngineDecoder`). A `SpeculativeDecoder`
(`runtime.speculative`) yields several tokens per forward when decoding greedily: the same tokens.

Stops on the model's EOS ids, on stop strings (the text before the stop string is kept), after
`max_tokens`, or when `should_stop` says so (finish reason "abort": a server shutting down).
Sampling (temperature, top-p) draws from a torch.Generator seeded per request, so a fixed
seed gives the same tokens on the same device.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from glmquant.arch.hf_glm5_next import cache_argument
from glmquant.errors import NumericalError, UsageError
from glmquant.runtime.speculative import SpecStats, SpeculativeDecoder
from glmquant.runtime.text_stream import Decode, TextStream


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; `seed` None draws a fresh seed."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class PromptInputs:
    """A tokenized prompt: input_ids [1, S] plus the vision tensors the prefill forward takes."""

    input_ids: torch.Tensor
    vision: Mapping[str, torch.Tensor] = field(default_factory=dict)  # pixel_values, image_grid_thw, ...

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str  # "stop" (EOS id or stop string) | "length" | "abort"
    prompt_tokens: int
    first_token_at: float | None = None  # time.perf_counter() when the first token was drawn
    finished_at: float = 0.0  # time.perf_counter() at the end
    speculative: SpecStats | None = None  # drafts and acceptances, when a speculative decoder ran greedily

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Decoder(Protocol):
    """One sequence at a time: `prefill` starts it from a prompt, `step` feeds one more token; both return the
    logits [V] of the next token."""

    device: torch.device

    def prefill(self, prompt: PromptInputs) -> torch.Tensor: ...

    def step(self, token: int) -> torch.Tensor: ...


class TransformersDecoder:
    """A transformers model as a `Decoder`, with a fresh `DynamicCache` per prompt."""

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # a transformers model: its config and cache keyword are read
        self.device = next(model.parameters()).device
        self.cache_kw: dict[str, object] = {}

    def prefill(self, prompt: PromptInputs) -> torch.Tensor:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config.get_text_config())
        self.cache_kw = {cache_argument(self.model): cache, "use_cache": True}
        vision = {k: v.to(self.device) for k, v in prompt.vision.items()}
        return self.model(
            input_ids=prompt.input_ids.to(self.device), logits_to_keep=1, **vision, **self.cache_kw
        ).logits[0, -1]

    def step(self, token: int) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([[token]], device=self.device), **self.cache_kw).logits[0, -1]


@torch.no_grad()
def generate(
    model: nn.Module | Decoder,
    prompt: PromptInputs,
    params: SamplingParams,
    decode: Decode,
    on_text: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Generation:
    """Generate from `prompt` with a `Decoder` (a transformers model is wrapped in one); `on_text` receives each
    final piece of text as soon as it is known; `should_stop` is asked before each decode step (True ends the
    generation with reason "abort")."""
    decoder = model if isinstance(model, Decoder) else TransformersDecoder(model)
    speculate = isinstance(decoder, SpeculativeDecoder) and params.temperature == 0
    gen = torch.Generator(device=decoder.device)
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    stream, reason, first_token_at = TextStream(decode, params.stop), "length", None
    tokens: list[int] = []
    pending = [decoder.prefill(prompt)]  # logits of the next tokens the decoder holds (several when speculating)
    while len(tokens) < params.max_tokens:
        token = next_token(finite_logits(pending.pop(0), len(tokens)), params, gen)
        first_token_at = first_token_at or time.perf_counter()
        if token in params.stop_token_ids:
            reason = "stop"
            break
        tokens.append(token)
        _emit(stream.push(token), on_text)
        if stream.stopped:
            reason = "stop"
            break
        if len(tokens) < params.max_tokens and not pending:
            if should_stop is not None and should_stop():
                reason = "abort"
                break
            pending = cast(SpeculativeDecoder, decoder).speculate(token) if speculate else [decoder.step(token)]
    _emit(stream.finish(), on_text)
    stats = cast(SpeculativeDecoder, decoder).stats if speculate else None
    return Generation(tuple(tokens), stream.text, reason, prompt.num_tokens, first_token_at, time.perf_counter(), stats)


def finite_logits(logits: torch.Tensor, generated: int) -> torch.Tensor:
    """`logits`, or NumericalError when any is NaN/Inf: a token drawn from them would be garbage, silently."""
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise NumericalError(
            f"the model's logits after {generated} generated tokens hold {bad} NaN/Inf values of {logits.numel()}: "
            "an activation overflowed (the triton backend's GEMV core sums rotated expert inputs in fp16, good to "
            "about 2,000) or a weight is NaN/Inf"
        )
    return logits


def next_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """Argmax at temperature 0, else a draw from the temperature-scaled, top-p-truncated distribution."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p  # mass before this token already enough
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=gen))


def stop_token_ids(eos: int | Sequence[int] | None) -> tuple[int, ...]:
    """The config's eos_token_id (one id or a list) as a tuple."""
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


def _emit(text: str, on_text: Callable[[str], None] | None) -> None:
    if text and on_text is not None:
        on_text(text)
