"""Each gate's scoring against model-shaped responses: right, wrong, malformed, truncated, thinking-only,
raw markup, wrong finish reason."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from glmquant.servecheck.answer import final_answer
from glmquant.servecheck.chat import ChatResult, Timings, ToolCall, Usage
from glmquant.servecheck.gates import (
    IDENTITY_ANSWER,
    WEATHER_ARGUMENTS,
    image_cases,
    multilingual_cases,
    text_identity_cases,
    tools_cases,
    video_cases,
)
from glmquant.servecheck.scoring import json_equal, score_json_answer

REASONING = "The user wants the literal token. I will answer with it and nothing else."


def reply(
    content: str = "",
    reasoning: str = "",
    finish: str | None = "stop",
    tool_calls: Sequence[ToolCall] = (),
    error: str | None = None,
) -> ChatResult:
    return ChatResult(content, reasoning, tuple(tool_calls), finish, Usage(21, 9), Timings(0.0, 0.4, 1.3, 1.3), error)


def identity(result: ChatResult):
    return text_identity_cases(None)[0].score(result)


def weather(result: ChatResult):
    return tools_cases(None)[0].score(result)


@pytest.mark.parametrize(
    "result, passed, reason",
    [
        (reply(IDENTITY_ANSWER, REASONING), True, "ok"),
        (reply(f"<think>{REASONING}</think>\n\n{IDENTITY_ANSWER}"), True, "ok"),  # no reasoning parser
        (reply(f"{REASONING}</think>{IDENTITY_ANSWER}"), True, "ok"),  # template opened <think> in the prompt
        (reply(f"{IDENTITY_ANSWER}."), False, "answered 'FINAL_BASELINE_OK.'"),
        (reply("The answer is FINAL_BASELINE_OK"), False, "answered"),
        (reply("", REASONING, finish="stop"), False, "thinking-only: no final content"),
        (reply(f"<think>{REASONING}", finish="length"), False, "truncated (finish_reason 'length'), thinking-only"),
        (reply("FINAL_BASE", finish="length"), False, "truncated (finish_reason 'length') after 'FINAL_BASE'"),
        (reply(IDENTITY_ANSWER, finish="tool_calls"), False, "finish_reason 'tool_calls', expected 'stop'"),
        (reply(IDENTITY_ANSWER, finish=None), False, "finish_reason None"),
        (reply("", finish="stop"), False, "empty response"),
        (reply(error="APIConnectionError: Connection refused"), False, "request failed: APIConnectionError"),
    ],
)
def test_text_identity(result: ChatResult, passed: bool, reason: str) -> None:
    verdict = identity(result)
    assert verdict.passed is passed
    assert verdict.reason.startswith(reason)


def test_identity_request_enables_thinking() -> None:
    case = text_identity_cases(64)[0]
    assert case.request.thinking is True and case.request.max_tokens == 64


def call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments)


@pytest.mark.parametrize(
    "result, passed, reason",
    [
        (
            reply("", REASONING, "tool_calls", [call("get_weather", '{"city": "Paris", "country": "France"}')]),
            True,
            "ok",
        ),
        (reply("", "", "tool_calls", [call("get_weather", '{"country":"France","city":"Paris"}')]), True, "ok"),
        (
            reply("", "", "tool_calls", [call("weather", '{"city": "Paris", "country": "France"}')]),
            False,
            "called 'weather', expected 'get_weather'",
        ),
        (
            reply("", "", "tool_calls", [call("get_weather", '{"city": "Paris"}')]),
            False,
            'tool arguments {"city": "Paris"}',
        ),
        (
            reply("", "", "tool_calls", [call("get_weather", '{"city": "Paris", "country": "France", "units": "C"}')]),
            False,
            "tool arguments",
        ),
        (
            reply("", "", "tool_calls", [call("get_weather", '{"city": "Paris", "country": ')]),
            False,
            "tool arguments are not valid JSON",
        ),
        (
            reply("", "", "tool_calls", [call("get_weather", '{"city": "Paris", "country": "France"}')] * 2),
            False,
            "2 tool calls (get_weather, get_weather), expected exactly one",
        ),
        (
            reply("", "", "stop", [call("get_weather", '{"city": "Paris", "country": "France"}')]),
            False,
            "finish_reason 'stop', expected 'tool_calls'",
        ),
        (
            reply("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
            False,
            "raw GLM <tool_call> markup left in content",
        ),
        (reply("", REASONING, "length"), False, "truncated (finish_reason 'length') before any tool call"),
        (reply("", REASONING, "stop"), False, "thinking-only: no tool call"),
        (reply("It is sunny in Paris."), False, "no tool call; content 'It is sunny in Paris.'"),
    ],
)
def test_structured_tools(result: ChatResult, passed: bool, reason: str) -> None:
    verdict = weather(result)
    assert verdict.passed is passed
    assert verdict.reason.startswith(reason)
    if passed:
        assert verdict.got == WEATHER_ARGUMENTS


def test_multilingual_exact_echo() -> None:
    cases = {c.name: c for c in multilingual_cases(None)}
    assert set(cases) == {"arabic", "chinese", "polish"}
    assert cases["chinese"].score(reply("你好，世界")).passed
    assert cases["polish"].score(reply("  Witaj, świecie\n")).passed  # outer whitespace only
    assert not cases["polish"].score(reply("Witaj, swiecie")).passed  # a lost diacritic fails
    assert not cases["arabic"].score(reply("مرحبا بالعالم!")).passed
    assert "Witaj, świecie" in cases["polish"].request.messages[0]["content"]


@pytest.mark.parametrize(
    "content, finish, passed, reason",
    [
        ('{"text": "A7K2"}', "stop", True, "ok"),
        ('<|begin_of_box|>{"text": "A7K2"}<|end_of_box|>', "stop", True, "ok"),
        ('<think>It reads A7K2.</think><|begin_of_box|>{"text": "A7K2"}<|end_of_box|>', "stop", True, "ok"),
        ('{"text": "B9Q4"}', "stop", False, 'answered {"text": "B9Q4"}, expected {"text": "A7K2"}'),
        ('{"text": "a7k2"}', "stop", False, "answered"),
        ('{"text": "A7K2", "confidence": 1}', "stop", False, "answered"),
        ('```json\n{"text": "A7K2"}\n```', "stop", False, "final content is not valid JSON"),
        ('{"text": "A7K2"', "stop", False, "final content is not valid JSON"),
        ("The text says A7K2.", "stop", False, "final content is not valid JSON"),
        ('{"text": "A7', "length", False, "truncated (finish_reason 'length')"),
    ],
)
def test_image_json_answers(content: str, finish: str, passed: bool, reason: str) -> None:
    case = next(c for c in image_cases(None) if c.name == "text-A7K2")
    verdict = case.score(reply(content, finish=finish))
    assert verdict.passed is passed
    assert verdict.reason.startswith(reason)


def test_counts_are_typed_exactly() -> None:
    case = next(c for c in image_cases(None) if c.name == "circles-3-red")
    assert case.score(reply('{"count": 3, "colour": "red"}')).passed
    assert not case.score(reply('{"count": "3", "colour": "red"}')).passed
    assert not case.score(reply('{"count": 3.0, "colour": "red"}')).passed
    assert not case.score(reply('{"count": 5, "colour": "red"}')).passed
    assert not json_equal(True, 1) and json_equal({"a": [1, "x"]}, {"a": [1, "x"]})


def test_video_cases_send_video_parts() -> None:
    cases = video_cases(None)
    assert [c.expected["direction"] for c in cases] == ["left_to_right", "right_to_left"]
    part = cases[0].request.messages[0]["content"][0]
    assert part["type"] == "video_url" and part["video_url"]["url"].startswith("data:video/mp4;base64,")
    good = '{"direction": "left_to_right", "start_colour": "red", "end_colour": "blue"}'
    assert cases[0].score(reply(good)).passed
    assert not cases[1].score(reply(good)).passed  # the pair differs exactly in what is asked
    assert not cases[0].score(reply("", "The square moves right and turns blue.")).passed


def test_final_answer_conventions() -> None:
    assert final_answer("<think>a</think>x<think>b</think>y") == "xy"
    assert final_answer("<|begin_of_box|>42<|end_of_box|>") == "42"
    assert final_answer("<think>never closed") == ""


def test_json_answer_direct() -> None:
    verdict = score_json_answer(reply('{"a": 1}'), {"a": 1})
    assert verdict.passed and verdict.got == {"a": 1}
