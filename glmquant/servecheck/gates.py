"""The request-and-score gates, exactly as serve-check-gates.md specifies them: each case pairs one chat
request with the pure function that judges its response."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from glmquant.servecheck.chat import ChatRequest, ChatResult
from glmquant.servecheck.fixtures import IMAGES, VIDEOS, MediaFixture
from glmquant.servecheck.scoring import Verdict, score_exact_text, score_json_answer, score_tool_call

IDENTITY_PROMPT = "Return exactly FINAL_BASELINE_OK as your final answer, with no punctuation or surrounding text."
IDENTITY_ANSWER = "FINAL_BASELINE_OK"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
}
WEATHER_PROMPT = "Use the weather tool for Paris, France."
WEATHER_ARGUMENTS = {"city": "Paris", "country": "France"}
ECHO_TEXTS = {"arabic": "مرحبا بالعالم", "chinese": "你好，世界", "polish": "Witaj, świecie"}
ECHO_PROMPT = "Reply with exactly the following text and nothing else, no quotes or punctuation added: {text}"


@dataclass(frozen=True)
class Case:
    """One request of a gate and the pure function that scores its response."""

    gate: str
    name: str
    request: ChatRequest
    expected: Any
    score: Callable[[ChatResult], Verdict]


def _user(content: Any) -> tuple[dict[str, Any], ...]:
    return ({"role": "user", "content": content},)


def text_identity_cases(max_tokens: int | None) -> list[Case]:
    request = ChatRequest(_user(IDENTITY_PROMPT), max_tokens=max_tokens, thinking=True)
    return [
        Case(
            "text", "identity", request, IDENTITY_ANSWER, functools.partial(score_exact_text, expected=IDENTITY_ANSWER)
        )
    ]


def tools_cases(max_tokens: int | None) -> list[Case]:
    request = ChatRequest(_user(WEATHER_PROMPT), tools=(WEATHER_TOOL,), max_tokens=max_tokens)
    expected = {"name": "get_weather", "arguments": WEATHER_ARGUMENTS}
    return [
        Case(
            "tools",
            "get_weather",
            request,
            expected,
            functools.partial(score_tool_call, name="get_weather", arguments=WEATHER_ARGUMENTS),
        )
    ]


def multilingual_cases(max_tokens: int | None) -> list[Case]:
    return [
        Case(
            "multilingual",
            language,
            ChatRequest(_user(ECHO_PROMPT.format(text=text)), max_tokens=max_tokens),
            text,
            functools.partial(score_exact_text, expected=text),
        )
        for language, text in ECHO_TEXTS.items()
    ]


def _media_case(gate: str, fixture: MediaFixture, max_tokens: int | None) -> Case:
    part = "image_url" if fixture.kind == "image" else "video_url"
    content = [{"type": part, part: {"url": fixture.data_url()}}, {"type": "text", "text": fixture.question}]
    return Case(
        gate,
        fixture.name,
        ChatRequest(_user(content), max_tokens=max_tokens),
        fixture.expected,
        functools.partial(score_json_answer, expected=fixture.expected),
    )


def image_cases(max_tokens: int | None) -> list[Case]:
    return [_media_case("images", f, max_tokens) for f in IMAGES]


def video_cases(max_tokens: int | None) -> list[Case]:
    return [_media_case("video", f, max_tokens) for f in VIDEOS]


CHAT_GATES: dict[str, Callable[[int | None], list[Case]]] = {
    "text": text_identity_cases,
    "tools": tools_cases,
    "multilingual": multilingual_cases,
    "images": image_cases,
    "video": video_cases,
}
