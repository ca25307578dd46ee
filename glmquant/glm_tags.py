"""GLM's output markup, in one place: reasoning, tool calls and GLM-V's answer box.

<think>reasoning</think>content
<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>
<|begin_of_box|>boxed answer<|end_of_box|>
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY_OPEN = "<arg_key>"
# the tags whose tokens carry the output's structure (kept when other special tokens are dropped)
OUTPUT_MARKUP = (
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_OPEN,
    TOOL_CLOSE,
    ARG_KEY_OPEN,
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
TOOL_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
BOX_MARKERS = ("<|begin_of_box|>", "<|end_of_box|>")
