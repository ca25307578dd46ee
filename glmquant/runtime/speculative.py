"""MTP speculative decoding: the model's own MTP layer drafts k tokens (1..3), the target verifies them in one
forward over the last token and the k drafts, and every draft up to the first that greedy decoding would not
pick is accepted, plus the target's own next token after them. Greedy output is the target's token for token.

    options: RuntimeOptions(speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    CLI:     glmquant serve ART --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'

Rollback after a rejection: the sparse-MLA layers' latent and indexer caches are cut back to the accepted
length (`crop`); the KDA layers' recurrent and conv states cannot be cut, so they are saved before the verify
forward, put back, and the accepted tokens are run again (one more forward, only when a draft was rejected).
Sampling (temperature > 0) decodes without speculation: verification here is greedy only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from glmquant.errors import UsageError

if TYPE_CHECKING:
    from glmquant.runtime.generate import PromptInputs

SPECULATIVE_METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys: `method` (only "mtp": the checkpoint's own MTP layer) and
    `num_speculative_tokens`, the drafts per step (1..3; one MTP layer drafts several by feeding itself); and our
    `draft_head`, a file from `glmquant draft-head` whose EXL3 lm_head the drafts read instead of the artifact's (the
    verify keeps the artifact's, so the output does not change)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1
    draft_head: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise UsageError(
                f"--speculative-config method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise UsageError(
                f"--speculative-config num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {k!r}"
            )
        if self.draft_head is not None and (not isinstance(self.draft_head, str) or not self.draft_head):
            raise UsageError(f"--speculative-config draft_head must be a file path, got {self.draft_head!r}")

    def as_json(self) -> dict[str, object]:
        """The JSON object `parse` takes, without the keys left unset (vLLM's two when there is no draft head)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the CLI's JSON object, e.g. '{"method": "mtp", "num_speculative_tokens": 2}'."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--speculative-config is not JSON ({exc}): {text!r}") from None
        if not isinstance(raw, dict):
            raise UsageError(f"--speculative-config must be a JSON object, got {text!r}")
        unknown = sorted(set(raw) - {"method", "num_speculative_tokens", "draft_head"})
        if unknown:
            raise UsageError(
                f"--speculative-config: unknown key(s) {unknown}; known: method, num_speculative_tokens, draft_head"
            )
        return cls(**raw)


@dataclass
class SpecStats:
    """Counts of one generation: `steps` verify forwards, `drafted` and `accepted` draft tokens."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens each verify forward yields: the accepted drafts plus the target's own token (vLLM's mean
        acceptance length); 1.0 is plain decoding."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@runtime_checkable
class SpeculativeDecoder(Protocol):
    """A `Decoder` that can also `speculate(token)`: feed `token`, draft and verify, and return the logits of
    each next token it now holds: [after token, after draft 1, ..., after draft n] for the n drafts accepted,
    where draft i is the argmax of the logits before it (greedy picks exactly these)."""

    device: torch.device
    stats: SpecStats

    def prefill(self, prompt: PromptInputs) -> torch.Tensor: ...

    def step(self, token: int) -> torch.Tensor: ...

    def speculate(self, token: int) -> list[torch.Tensor]: ...
