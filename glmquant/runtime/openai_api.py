"""The OpenAI chat-completions wire format: request validation into a typed request, response bodies,
stream chunks and OpenAI-style errors `{"error": {"message", "type", "param", "code"}}`.

Status codes: 400 malformed request (bad JSON, bad media, prompt longer than the context), 404 unknown
model or route, 413 body too large, 422 well-formed JSON with invalid fields.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmquant.errors import UsageError
from glmquant.runtime.generate import Generation, SamplingParams
from glmquant.runtime.glm_output import ParsedOutput, ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to answer it with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:  # noqa: A002  (OpenAI's field name)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    template_kwargs: Mapping[str, Any]
    max_tokens_given: bool  # otherwise the budget is what the context leaves


def parse_chat_request(body: Any, model_id: str, defaults: SamplingParams) -> ChatRequest:
    """Validate a decoded JSON body; raises ApiError (404 unknown model, 422 invalid fields)."""
    if not isinstance(body, dict):
        raise ApiError(422, "the request body must be a JSON object")
    if body.get("model") not in (None, model_id):
        raise ApiError(404, f"The model '{body['model']}' does not exist; this server serves '{model_id}'",
                       "model", "model_not_found")
    messages = _messages(body.get("messages"))
    if _get(body, "n", int, 1) != 1:
        raise ApiError(422, "only n=1 is supported", "n")
    tools = _tools(body.get("tools"))
    if body.get("tool_choice") == "none":
        tools = ()
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ApiError(422, "stop must be a string or a list of strings", "stop")
    options = body.get("stream_options") or {}
    try:
        sampling = SamplingParams(
            max_tokens=_get(body, "max_tokens", int, defaults.max_tokens, max_tokens),
            temperature=_get(body, "temperature", (int, float), defaults.temperature),
            top_p=_get(body, "top_p", (int, float), defaults.top_p),
            seed=_get(body, "seed", int, None), stop=tuple(stop), stop_token_ids=defaults.stop_token_ids)
    except UsageError as exc:  # SamplingParams' own range checks
        raise ApiError(422, str(exc)) from None
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    return ChatRequest(messages, tools, sampling, bool(_get(body, "stream", bool, False)),
                       bool(isinstance(options, dict) and options.get("include_usage")), kwargs, max_tokens is not None)


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, value: Any = None) -> Any:
    value = body.get(key) if value is None else value
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(422, f"'{key}' has the wrong type ({type(value).__name__})", key)
    return value


def _messages(messages: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(422, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(422, f"messages[{i}] needs a role among {', '.join(ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(422, f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")
        if isinstance(content, list) and not all(isinstance(p, dict) and "type" in p for p in content):
            raise ApiError(422, f"messages[{i}].content parts must be objects with a 'type'", f"messages[{i}].content")
    return tuple({**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages)


def _tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise ApiError(422, "'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    return tuple(tools)


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(generation: Generation) -> dict[str, int]:
    return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens}


def finish_reason(generation: Generation, tool_calls: Sequence[ToolCall]) -> str:
    return "tool_calls" if tool_calls and generation.finish_reason == "stop" else generation.finish_reason


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def completion_body(cid: str, model_id: str, generation: Generation, parsed: ParsedOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None,
                               "reasoning_content": parsed.reasoning or None}
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in parsed.tool_calls]
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": finish_reason(generation, parsed.tool_calls)}
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
            "choices": [choice], "usage": usage(generation)}


def chunk_body(cid: str, model_id: str, delta: Mapping[str, Any] | None, finish: str | None = None,
               usage_: Mapping[str, int] | None = None, include_usage: bool = False) -> dict[str, Any]:
    """One `chat.completion.chunk`; delta None is the final usage-only chunk (empty choices)."""
    body: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model_id,
                            "choices": [] if delta is None else [{"index": 0, "delta": dict(delta), "logprobs": None,
                                                                  "finish_reason": finish}]}
    if include_usage:
        body["usage"] = dict(usage_) if usage_ is not None else None
    return body
