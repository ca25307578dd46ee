"""The model's own tokenizer and chat template: sizes long prompts and predicts the server's prompt_tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glmquant.errors import UsageError


class PromptTokenizer:
    """Renders messages with the model's chat template and counts tokens as an OpenAI-compatible server does
    (template rendered to text, then encoded without adding special tokens again)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def from_dir(cls, path: str | Path) -> PromptTokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: cannot load the model's tokenizer ({exc})") from None
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"{path}: the tokenizer has no chat template")
        return cls(tokenizer)

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        return self._tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def count_text(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False))

    def count(self, messages: Sequence[dict[str, Any]]) -> int:
        """Prompt tokens of a chat request."""
        return self.count_text(self.render(messages))

    def lengths(self, pieces: Sequence[str]) -> list[int]:
        """Token count of each text piece encoded on its own."""
        return [len(ids) for ids in self._tok(list(pieces), add_special_tokens=False)["input_ids"]]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))
