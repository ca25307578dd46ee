"""GLM output conventions: where the final answer is once reasoning and box markers are removed.

A server with a reasoning parser returns reasoning apart from `content`; one without leaves
`<think>...</think>` (or, when the template opened `<think>` in the prompt, a bare `...</think>`) in
the content. GLM-V may wrap answers in `<|begin_of_box|>...<|end_of_box|>`.
"""

from __future__ import annotations

import re

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
BOX_MARKERS = ("<|begin_of_box|>", "<|end_of_box|>")
TOOL_CALL_MARKUP = "<tool_call>"


def strip_reasoning(content: str) -> str:
    """The content outside reasoning; an unclosed `<think>` means everything after it is unfinished reasoning."""
    text = _THINK_BLOCK.sub("", content)
    if "</think>" in text:  # reasoning opened by the prompt template, closed in the content
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text


def strip_box(text: str) -> str:
    for marker in BOX_MARKERS:
        text = text.replace(marker, "")
    return text


def final_answer(content: str) -> str:
    """What the model finally answered: reasoning and box markers removed, outer whitespace trimmed."""
    return strip_box(strip_reasoning(content)).strip()


def unfinished_reasoning(content: str) -> bool:
    """True when the content opens a `<think>` block that never closes (the answer was never reached)."""
    return "<think>" in _THINK_BLOCK.sub("", content)
