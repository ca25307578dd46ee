"""GLM output parsing: reasoning apart from content, tool calls typed by the tool schema, and the same
result whether the text arrives at once or one character at a time."""

from __future__ import annotations

import json

import pytest

from glmquant.runtime.glm_output import GlmOutputParser, collect, parse_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"]},
                    "options": {"type": "object"},
                    "hourly": {"type": "boolean"},
                    "code": {"type": "string"},
                },
            },
        },
    }
]
TEXT = (
    "<think>\nThe user wants weather.\n</think>\nLet me check.<tool_call>get_weather\n"
    "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key><arg_value>3</arg_value>"
    '<arg_key>options</arg_key><arg_value>{"lang": ["fr"]}</arg_value><arg_key>hourly</arg_key>'
    "<arg_value>true</arg_value><arg_key>code</arg_key><arg_value>007</arg_value><arg_key>units</arg_key>"
    "<arg_value>metric</arg_value></tool_call>"
)


def test_reasoning_content_and_typed_tool_call():
    parsed = parse_output(TEXT, TOOLS)
    assert parsed.reasoning == "The user wants weather."
    assert parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) == {
        "city": "Paris",
        "days": 3,
        "options": {"lang": ["fr"]},
        "hourly": True,
        "code": "007",
        "units": "metric",
    }  # strings stay raw: "007", not 7


def test_character_by_character_equals_whole_text():
    parser = GlmOutputParser(TOOLS)
    deltas = [d for ch in TEXT for d in parser.feed(ch)] + parser.finish()
    streamed, whole = collect(deltas), parse_output(TEXT, TOOLS)
    assert (streamed.content, streamed.reasoning) == (whole.content, whole.reasoning)
    assert [json.loads(c.arguments) for c in streamed.tool_calls] == [json.loads(c.arguments) for c in whole.tool_calls]
    assert all("<" not in d.content and "<" not in d.reasoning for d in deltas)  # no tag fragments leak


@pytest.mark.parametrize(
    "text, content, reasoning",
    [
        ("just an answer", "just an answer", ""),
        ("<think></think>\n\nFINAL_BASELINE_OK\n", "FINAL_BASELINE_OK", ""),
        ("a < b and c <th", "a < b and c <th", ""),  # a tag prefix at the end is released by finish()
    ],
)
def test_plain_text_cases(text, content, reasoning):
    parsed = parse_output(text)
    assert (parsed.content, parsed.reasoning, parsed.tool_calls) == (content, reasoning, ())


def test_prompt_that_opened_think_starts_in_reasoning():
    parsed = parse_output("pondering</think>answer", starts_in_reasoning=True)
    assert (parsed.reasoning, parsed.content) == ("pondering", "answer")


def test_undeclared_parameters_are_raw_and_bad_json_falls_back_to_text():
    parsed = parse_output(
        "<tool_call>other<arg_key>n</arg_key><arg_value>5</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>",
        TOOLS,
    )
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"n": "5"}, {"days": "three"}]


def test_unterminated_tool_call_is_returned_as_content():
    parsed = parse_output("ok <tool_call>get_weather<arg_key>city", TOOLS)
    assert parsed.tool_calls == () and parsed.content == "ok <tool_call>get_weather<arg_key>city"
