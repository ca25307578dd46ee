"""Parse GLM output text: `<think>...</think>` reasoning apart from content, and GLM tool calls
`<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>` into OpenAI tool calls whose
arguments are typed by the tool's JSON schema (string parameters raw, every other type JSON-decoded).

One incremental parser serves streaming and non-streaming responses: `feed` text pieces as they are
generated and get deltas back; a tag split across pieces is held until it is complete.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmquant.glm_tags import ARG_KEY_OPEN, THINK_CLOSE, THINK_OPEN, TOOL_ARGUMENT, TOOL_CLOSE, TOOL_OPEN

# tags that end each state, and the state they lead to
_EXITS = {
    "content": ((THINK_OPEN, "reasoning"), (TOOL_OPEN, "tool")),
    "reasoning": ((THINK_CLOSE, "content"),),
    "tool": ((TOOL_CLOSE, "content"),),
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text, as OpenAI returns it


@dataclass(frozen=True)
class Delta:
    """One step of output: exactly one field is set."""

    content: str = ""
    reasoning: str = ""
    tool_call: ToolCall | None = None


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]


class GlmOutputParser:
    """Incremental parser; `starts_in_reasoning` when the prompt already opened `<think>`."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), starts_in_reasoning: bool = False) -> None:
        self._schemas = {_tool_name(t): _tool_params(t) for t in tools}
        self._state = "reasoning" if starts_in_reasoning else "content"
        self._buffer = ""  # text of the current state not yet emitted (tool bodies accumulate here)
        self._pending_space = {"content": "", "reasoning": ""}  # trailing whitespace held back
        self._started = {"content": False, "reasoning": False}  # leading whitespace is dropped

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            hit = _first_tag(self._buffer, _EXITS[self._state])
            if hit is None:
                break
            pos, tag, next_state = hit
            out += self._flush(self._buffer[:pos], closing=True)
            self._buffer, self._state = self._buffer[pos + len(tag) :], next_state
        if self._state != "tool":
            keep = _partial_tag_length(self._buffer, [tag for tag, _ in _EXITS[self._state]])
            out += self._flush(self._buffer[: len(self._buffer) - keep], closing=False)
            self._buffer = self._buffer[len(self._buffer) - keep :]
        return out

    def finish(self) -> list[Delta]:
        """Flush what is left; an unterminated tool call is returned as plain content."""
        if self._state == "tool":
            self._state, self._buffer = "content", TOOL_OPEN + self._buffer
        text, self._buffer = self._buffer, ""
        return self._flush(text, closing=False)

    def _flush(self, text: str, closing: bool) -> list[Delta]:
        """Emit `text` of the current state (a tool call only once `closing`: its end tag was seen)."""
        if self._state == "tool":
            return [Delta(tool_call=self._tool_call(text))] if closing else []
        channel = self._state
        if not self._started[channel]:
            text = text.lstrip()
        text = self._pending_space[channel] + text
        body = text.rstrip()
        self._pending_space[channel] = text[len(body) :]  # emitted only if more text follows
        if not body:
            return []
        self._started[channel] = True
        return [Delta(content=body) if channel == "content" else Delta(reasoning=body)]

    def _tool_call(self, body: str) -> ToolCall:
        name = body.split(ARG_KEY_OPEN, 1)[0].strip()
        params = self._schemas.get(name, {})
        args = {k.strip(): _typed(v, params.get(k.strip())) for k, v in TOOL_ARGUMENT.findall(body)}
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))


def parse_output(text: str, tools: Sequence[Mapping[str, Any]] = (), starts_in_reasoning: bool = False) -> ParsedOutput:
    """The whole output at once (the non-streaming response)."""
    parser = GlmOutputParser(tools, starts_in_reasoning)
    return collect(parser.feed(text) + parser.finish())


def collect(deltas: Sequence[Delta]) -> ParsedOutput:
    """Join a response's deltas into its final message."""
    return ParsedOutput(
        "".join(d.content for d in deltas),
        "".join(d.reasoning for d in deltas),
        tuple(d.tool_call for d in deltas if d.tool_call),
    )


def _typed(value: str, schema: Mapping[str, Any] | None) -> Any:
    """String-typed (or undeclared) parameters keep the raw text; others are JSON-decoded when valid."""
    types = (schema or {}).get("type", "string")
    types = types if isinstance(types, list) else [types]
    if "string" in types:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _tool_name(tool: Mapping[str, Any]) -> str:
    return str((tool.get("function") or tool).get("name", ""))


def _tool_params(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    params = (tool.get("function") or tool).get("parameters") or {}
    return params.get("properties") or {}


def _first_tag(text: str, exits: Sequence[tuple[str, str]]) -> tuple[int, str, str] | None:
    hits = [(text.find(tag), tag, state) for tag, state in exits if tag in text]
    return min(hits) if hits else None


def _partial_tag_length(text: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0
