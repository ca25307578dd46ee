"""EngineDecoder: one cache slot of an `Engine` as the `Decoder` that `generate` drives."""

from __future__ import annotations

import threading

import torch

from glmquant.errors import UsageError
from glmquant.runtime.engine.model import Engine
from glmquant.runtime.generate import PromptInputs


class EngineDecoder:
    """Text prompts only (the engine runs no vision tower). Decoders of one engine may run in several threads:
    `lock` lets one forward run at a time (its graphs share one memory pool and one stream)."""

    def __init__(self, engine: Engine, slot: int = 0, lock: threading.Lock | None = None) -> None:
        self.engine, self.slot = engine, slot
        self.lock = lock or threading.Lock()
        self.device = engine.device
        self.position = 0

    def prefill(self, prompt: PromptInputs) -> torch.Tensor:
        if prompt.vision:
            raise UsageError("the runtime's own engine serves text only; images and videos need the transformers path")
        with self.lock:
            logits = self.engine.prefill(self.slot, prompt.input_ids.view(-1))
        self.position = prompt.num_tokens
        return logits

    def step(self, token: int) -> torch.Tensor:
        tokens = torch.tensor([token], device=self.device)
        positions = torch.tensor([self.position], device=self.device)
        with self.lock:
            logits = self.engine.decode(tokens, positions, self.position + 1, self.slot)[0].clone()
        self.position += 1
        return logits
