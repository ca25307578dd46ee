"""Chat requests through the official `openai` client, streamed, with usage and stream timings collected.

Reasoning arrives as `reasoning_content` (vLLM, glmquant serve) or `reasoning` (newer vLLM) beside
`content`; tool calls arrive as indexed fragments (name first, arguments in pieces) and are joined here.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import openai

from glmquant.errors import UsageError
from glmquant.servecheck.chat import ChatRequest, ChatResult, Speculation, Timings, ToolCall, Usage

_REASONING_FIELDS = ("reasoning_content", "reasoning")


class ChatClient:
    def __init__(self, base_url: str, api_key: str = "EMPTY", timeout_s: float = 1800.0) -> None:
        self.base_url = base_url
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)

    def close(self) -> None:
        """Close the pooled connections (before the embedded server stops, so none is reset)."""
        self._client.close()

    def first_model(self) -> str:
        """The id of the first model the server lists (servers of one model list just that one)."""
        try:
            models = list(self._client.models.list())
            first = models[0].id if models else None
        except openai.APIError as exc:
            raise UsageError(f"{self.base_url}: cannot list the served models ({exc})") from None
        except _MALFORMED as exc:
            raise UsageError(f"{self.base_url}: {_not_openai('GET /models', exc)}") from None
        if not models:
            raise UsageError(f"{self.base_url}: the server lists no models; name one with --model")
        if not isinstance(first, str):
            raise UsageError(f"{self.base_url}: {_not_openai('GET /models', TypeError(f'model id {first!r}'))}")
        return first

    def max_model_len(self, model: str) -> int | None:
        """The context length the server states for `model` in its listing (vLLM's `max_model_len`), if any."""
        try:
            entry = next((m for m in self._client.models.list() if m.id == model), None)
            value = (entry.model_extra or {}).get("max_model_len") if entry is not None else None
        except openai.APIError:
            return None
        except _MALFORMED:  # a listing of another shape states no context length
            return None
        return value if isinstance(value, int) and value > 0 else None

    def complete(self, model: str, request: ChatRequest) -> ChatResult:
        """Send one request at temperature 0 and collect the stream; transport failures become `error`."""
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": list(request.messages),
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            kwargs["tools"] = list(request.tools)
        if request.max_tokens is not None:
            kwargs["max_tokens"] = request.max_tokens
        if request.thinking is not None:
            kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": request.thinking}}
        start = time.perf_counter()
        collected = _Collector(start)
        try:
            for chunk in self._client.chat.completions.create(**kwargs):
                collected.add(chunk, time.perf_counter())
        except _STREAM_ERRORS as exc:
            return collected.result(time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
        except _MALFORMED as exc:
            return collected.result(time.perf_counter(), error=_not_openai("the chat completion stream", exc))
        return collected.result(time.perf_counter())


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's base error (openai 1.x uses httpx, 3.x httpx2): failures mid-stream, not bugs of ours."""
    for name in ("httpx2", "httpx"):
        try:
            return (importlib.import_module(name).HTTPError,)
        except ImportError:
            continue
    return ()


# the server's errors, and transport failures mid-stream
_STREAM_ERRORS: tuple[type[BaseException], ...] = (openai.APIError, *_transport_errors())
# what an endpoint answering something else than the OpenAI API makes the client raise: text that is not JSON
# (JSONDecodeError is a ValueError), or JSON of another shape (the client builds its models without validating them,
# so a wrong shape surfaces as a TypeError or AttributeError where it is read)
_MALFORMED: tuple[type[Exception], ...] = (ValueError, TypeError, AttributeError, KeyError)


def _not_openai(what: str, exc: Exception) -> str:
    return f"{what} is not an OpenAI API answer ({type(exc).__name__}: {exc})"


class _Collector:
    """Accumulates stream chunks into one ChatResult."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, list[str]] = {}  # tool call index -> [name, arguments]
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.first: float | None = None
        self.last: float | None = None

    def add(self, chunk: Any, now: float) -> None:
        if chunk.usage is not None:
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            self.usage = Usage(
                chunk.usage.prompt_tokens,
                chunk.usage.completion_tokens,
                getattr(details, "cached_tokens", None),
                Speculation.parse((chunk.usage.model_extra or {}).get("speculative")),
            )
        for choice in chunk.choices:
            delta = choice.delta
            produced = False
            if delta.content:
                self.content.append(delta.content)
                produced = True
            for name in _REASONING_FIELDS:
                piece = getattr(delta, name, None)
                if piece:
                    self.reasoning.append(piece)
                    produced = True
            for call in delta.tool_calls or []:
                slot = self.calls.setdefault(call.index, ["", ""])
                if call.function is not None:
                    slot[0] += call.function.name or ""
                    slot[1] += call.function.arguments or ""
                produced = True
            if produced:
                self.first = self.first if self.first is not None else now
                self.last = now
            if choice.finish_reason is not None:
                self.finish = choice.finish_reason

    def result(self, end: float, error: str | None = None) -> ChatResult:
        calls = tuple(ToolCall(name, args) for _, (name, args) in sorted(self.calls.items()))
        return ChatResult(
            "".join(self.content),
            "".join(self.reasoning),
            calls,
            self.finish,
            self.usage,
            Timings(self.start, self.first, self.last, end),
            error,
        )
