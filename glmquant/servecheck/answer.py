"""The final answer in a chat response's content, once GLM reasoning and box markers are removed (the
client-side view: the runtime's own streaming parser is glmquant/runtime/glm_output.py).

A server with a reasoning parser returns reasoning apart from `content`; one without leaves
`<think>...</think>` (or, when the template opened `<think>` in the prompt, a bare `...</think>`) in
the content. GLM-V may wrap answers in `<|begin_of_box|>...<|end_of_box|>`.
"""

from __future__ import annotations

from glmquant.glm_tags import BOX_MARKERS, THINK_BLOCK, THINK_CLOSE, THINK_OPEN


def strip_reasoning(content: str) -> str:
    """The content outside reasoning; an unclosed `<think>` means everything after it is unfinished reasoning."""
    text = THINK_BLOCK.sub("", content)
    if THINK_CLOSE in text:  # reasoning opened by the prompt template, closed in the content
        text = text.rsplit(THINK_CLOSE, 1)[1]
    if THINK_OPEN in text:
        text = text.split(THINK_OPEN, 1)[0]
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
    return THINK_OPEN in THINK_BLOCK.sub("", content)
