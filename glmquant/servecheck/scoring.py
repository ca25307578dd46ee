"""Pure scoring of one response against a gate's pass rule (serve-check-gates.md), with the reason it failed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from glmquant.glm_tags import TOOL_OPEN
from glmquant.servecheck.answer import final_answer, unfinished_reasoning
from glmquant.servecheck.chat import ChatResult


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str  # "ok", or the first rule the response broke
    got: Any = None  # what was compared against the expectation (answer text, parsed JSON, tool call)


def clip(text: str, limit: int = 80) -> str:
    """A short quotable excerpt of a (possibly huge) response for a failure reason."""
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def json_equal(a: Any, b: Any) -> bool:
    """Exact JSON equality: 3 != 3.0 != true, key sets equal, lists in order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _answer_or_failure(result: ChatResult) -> tuple[str, str | None]:
    """The final answer, or why there is none (transport error, truncation, thinking only, empty)."""
    if result.error is not None:
        return "", f"request failed: {result.error}"
    answer = final_answer(result.content)
    if not answer:
        thinking = bool(result.reasoning) or unfinished_reasoning(result.content)
        what = "thinking-only: no final content" if thinking else "empty response"
        if result.finish_reason == "length":
            return "", f"truncated (finish_reason 'length'), {what}"
        return "", what
    if result.finish_reason == "length":
        return answer, f"truncated (finish_reason 'length') after {clip(answer)}"
    if result.finish_reason != "stop":
        return answer, f"finish_reason {result.finish_reason!r}, expected 'stop'"
    return answer, None


def score_exact_text(result: ChatResult, expected: str) -> Verdict:
    """Pass when the final content is exactly `expected` (outer whitespace ignored) and finish is stop."""
    answer, failure = _answer_or_failure(result)
    if failure is not None:
        return Verdict(False, failure, answer)
    if answer != expected:
        return Verdict(False, f"answered {clip(answer)}, expected {expected!r}", answer)
    return Verdict(True, "ok", answer)


def score_json_answer(result: ChatResult, expected: dict[str, Any]) -> Verdict:
    """Pass when the final content (box markers stripped) parses to exactly `expected` and finish is stop."""
    answer, failure = _answer_or_failure(result)
    if failure is not None:
        return Verdict(False, failure, answer)
    try:
        parsed = json.loads(answer)
    except json.JSONDecodeError as exc:
        return Verdict(False, f"final content is not valid JSON ({exc.msg}): {clip(answer)}", answer)
    if not json_equal(parsed, expected):
        return Verdict(
            False,
            f"answered {json.dumps(parsed, ensure_ascii=False)}, expected {json.dumps(expected, ensure_ascii=False)}",
            parsed,
        )
    return Verdict(True, "ok", parsed)


def score_tool_call(result: ChatResult, name: str, arguments: dict[str, Any]) -> Verdict:
    """Pass on exactly one structured tool call `name` whose JSON arguments equal `arguments`."""
    if result.error is not None:
        return Verdict(False, f"request failed: {result.error}")
    calls = result.tool_calls
    if not calls:
        if TOOL_OPEN in result.content:
            why = "raw GLM <tool_call> markup left in content (the server did not parse tool calls)"
        elif result.finish_reason == "length":
            why = "truncated (finish_reason 'length') before any tool call"
        elif not final_answer(result.content) and (result.reasoning or unfinished_reasoning(result.content)):
            why = "thinking-only: no tool call and no final content"
        else:
            why = f"no tool call; content {clip(final_answer(result.content))}"
        return Verdict(False, why)
    if len(calls) != 1:
        return Verdict(False, f"{len(calls)} tool calls ({', '.join(c.name for c in calls)}), expected exactly one")
    call = calls[0]
    if call.name != name:
        return Verdict(False, f"called {call.name!r}, expected {name!r}", call)
    try:
        parsed = json.loads(call.arguments)
    except json.JSONDecodeError as exc:
        return Verdict(False, f"tool arguments are not valid JSON ({exc.msg}): {clip(call.arguments)}", call)
    if not json_equal(parsed, arguments):
        return Verdict(
            False,
            f"tool arguments {json.dumps(parsed, ensure_ascii=False)}, expected "
            f"{json.dumps(arguments, ensure_ascii=False)}",
            parsed,
        )
    if result.finish_reason != "tool_calls":
        return Verdict(False, f"finish_reason {result.finish_reason!r}, expected 'tool_calls'", parsed)
    return Verdict(True, "ok", parsed)
