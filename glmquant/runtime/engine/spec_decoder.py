"""EngineMtpDecoder: one cache slot of an `Engine` with its MTP layer as a `SpeculativeDecoder`
(`runtime.speculative`): the engine's counterpart of `runtime.mtp_decoder.MtpDecoder`, step for step.

One step from the last token t at position L (the slot holds L positions):

1. Draft: the MTP layer reads every target hidden state it has not read yet, paired with the next token (the
   last with t), and drafts d1; for k > 1 it drafts d2..dk from its own output at positions L + 1.. (its static
   cache keeps them until later positions overwrite them: cutting it is only not counting them).
2. Verify: `Engine.verify` runs [t, d1..dk] at positions L..L + k in one forward on the decode math: k + 1
   logits, and each KDA layer's state after every token.
3. Roll back after a rejection at draft n + 1: the MLA caches need nothing (positions past L + n are rewritten
   before they are read); each KDA layer takes back its state and conv inputs as they were after d_n
   (`Engine.keep_verified`, a copy). The verify's logits at t, d1..dn stand: the target's next token is the
   last's argmax. (Before, the states were put back to before the verify and t, d1..dn re-run: a whole decode
   step, 34 ms of the H200's 43 ms verify at k = 1.)

Where the engine has CUDA graphs (`graphs`, the default), drafts and verify steps replay one graph per token
count: eager, a verify step of the full model costs ~7x its graph (docs/speculative.md).
"""

from __future__ import annotations

import threading

import torch

from glmquant.runtime.engine.decoder import EngineDecoder
from glmquant.runtime.engine.model import Engine
from glmquant.runtime.generate import PromptInputs
from glmquant.runtime.speculative import SpecStats


class EngineMtpDecoder(EngineDecoder):
    """A cache slot of an engine loaded with its MTP layer (`Engine.load(..., mtp=True)`), drafting k tokens."""

    def __init__(
        self,
        engine: Engine,
        num_speculative_tokens: int,
        slot: int = 0,
        lock: threading.Lock | None = None,
        graphs: bool = True,
    ) -> None:
        super().__init__(engine, slot, lock)
        self.k = num_speculative_tokens
        self.graphs = graphs  # drafts, verify steps and re-runs replay CUDA graphs where the engine has them
        self.stats = SpecStats()
        # target hidden states [m, H] the MTP layer has not read yet, from position `_hidden_at`, and the tokens
        # after each but the last (whose next token the next step feeds)
        self._hidden: torch.Tensor | None = None
        self._hidden_at = 0
        self._next: list[int] = []

    def prefill(self, prompt: PromptInputs) -> torch.Tensor:
        if prompt.vision:
            return super().prefill(prompt)  # refused there
        self.stats = SpecStats()
        ids = prompt.input_ids.view(-1)
        with self.lock:
            hidden = self.engine.prefill_hidden(self.slot, ids)
            logits = self.engine.lm_head(hidden[-1])
        self.position = ids.numel()
        self._hidden, self._hidden_at, self._next = hidden, 0, ids[1:].tolist()
        return logits

    def step(self, token: int) -> torch.Tensor:
        """One token without drafting (a sampled generation): the MTP layer stops following this sequence."""
        self._hidden, self._next = None, []
        return super().step(token)

    def speculate(self, token: int) -> list[torch.Tensor]:
        with self.lock:
            return self._speculate(token)

    def _speculate(self, token: int) -> list[torch.Tensor]:
        engine, start = self.engine, self.position
        drafts = self._draft(token)
        ids = [token, *drafts]
        logits, hidden = engine.verify(self.slot, self._ids(ids), start, self.graphs)  # [k + 1, V], [k + 1, H]
        greedy = logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == greedy[n]:
            n += 1
        if n < len(drafts):
            engine.keep_verified(self.slot, n + 1)  # the KDA states after t, d1..dn: the rejected drafts undone
        out = list(logits[: n + 1])
        self.position = start + n + 1
        self._hidden, self._hidden_at, self._next = hidden[: n + 1], start, drafts[:n]
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += n
        return out

    def _draft(self, token: int) -> list[int]:
        """k greedy drafts: the MTP layer reads every target hidden state not read yet (the last with `token`),
        then its own output hidden state and draft k - 1 more times (positions it will overwrite later)."""
        if self._hidden is None:
            raise RuntimeError("speculate() needs a prefill and no step() since: the MTP layer missed positions")
        engine, at = self.engine, self._hidden_at
        logits, hidden = engine.draft(self.slot, self._hidden, self._ids([*self._next, token]), at, self.graphs)
        at += self._hidden.shape[0]
        drafts = [int(logits[-1].argmax())]
        for _ in range(self.k - 1):
            logits, hidden = engine.draft(self.slot, hidden[-1:], self._ids(drafts[-1:]), at, self.graphs)
            at += 1
            drafts.append(int(logits[-1].argmax()))
        return drafts

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)
