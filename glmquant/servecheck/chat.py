"""One chat-completions exchange as plain data: what a gate asks and what the server answered.

Scoring only ever sees these objects, so every gate can be judged on canned responses in tests
exactly as on a live server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatRequest:
    """A chat-completions request; always sent at temperature 0, streamed, with usage included."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] = ()
    max_tokens: int | None = None
    thinking: bool | None = None  # None: the server's default; True/False: chat_template_kwargs.enable_thinking


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the raw JSON text the server produced


@dataclass(frozen=True)
class Speculation:
    """The embedded server's `usage.speculative` (MTP speculative decoding), vLLM's spec-decode counts."""

    num_drafts: int  # verify steps
    num_draft_tokens: int
    num_accepted_tokens: int

    @classmethod
    def parse(cls, raw: Any) -> Speculation | None:
        """From the usage's extra field; None when absent or not the three counts."""
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        if not isinstance(raw, dict) or not all(isinstance(raw.get(k), int) for k in keys):
            return None
        return cls(*(int(raw[k]) for k in keys))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens, when the server reports it
    speculative: Speculation | None = None  # usage.speculative, from a server decoding with MTP speculation


@dataclass(frozen=True)
class Timings:
    """Wall-clock instants (time.perf_counter seconds) of one streamed request."""

    start: float
    first_token: float | None  # first chunk carrying content, reasoning or a tool call
    last_token: float | None
    end: float

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start


@dataclass(frozen=True)
class ChatResult:
    """Everything the server sent back for one request (or the transport error instead)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None

    @property
    def decode_tps(self) -> float | None:
        """completion_tokens / (last token time - first token time), as the gates doc defines it. When that span is
        empty (the whole completion came in one chunk, as speculative decoding of a short answer can send it, or as
        text that only the last chunk carried), the stream's wall time takes its place: a lower bound of the rate,
        so a slow server still fails and a fast one is not failed for lack of a measurement."""
        t, u = self.timings, self.usage
        if t is None or u is None or u.completion_tokens == 0:
            return None
        if t.first_token is not None and t.last_token is not None and t.last_token > t.first_token:
            return u.completion_tokens / (t.last_token - t.first_token)
        return u.completion_tokens / t.wall_s if t.wall_s > 0 else None
