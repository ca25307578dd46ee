"""The model's own tokenizer and chat template: sizes long prompts and predicts the server's prompt_tokens.

Locally from the model's tokenizer files (`PromptTokenizer`), or through the endpoint's own `/tokenize` (vLLM's
API, which `glmquant serve` offers too) when no tokenizer is at hand (`ServerTokenizer`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glmquant.errors import GlmquantError, UsageError


class PromptTokenizer:
    """Renders messages with the model's chat template and counts tokens as an OpenAI-compatible server does
    (template rendered to text, then encoded without adding special tokens again)."""

    renders = True  # can show the rendered prompt (needle positions are measured on it)

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


class ServerTokenizer:
    """Counts through the endpoint's `/tokenize`, exactly as the server will count the prompt. The rendered prompt
    is not available this way, so the needle gate reports no token positions."""

    renders = False

    def __init__(self, root_url: str, model: str, timeout_s: float = 60.0) -> None:
        self.url = root_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout_s = timeout_s
        self._pieces: dict[str, int] = {}

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        data = json.dumps({"model": self.model, **body}).encode()
        request = urllib.request.Request(self.url, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return list(json.loads(response.read())["tokens"])
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
            raise GlmquantError(
                f"{self.url}: no usable /tokenize ({exc}); give --tokenizer DIR (the model's "
                "tokenizer files) to size prompts locally"
            ) from None

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        raise GlmquantError("the rendered prompt is not available through /tokenize")

    def count_text(self, text: str) -> int:
        return len(self.encode(text))

    def count(self, messages: Sequence[dict[str, Any]]) -> int:
        return len(self._tokens({"messages": list(messages), "add_generation_prompt": True}))

    def lengths(self, pieces: Sequence[str]) -> list[int]:
        """Each piece's count, asked once per distinct piece (filler sentences repeat)."""
        for piece in set(pieces) - set(self._pieces):
            self._pieces[piece] = self.count_text(piece)
        return [self._pieces[p] for p in pieces]

    def encode(self, text: str) -> list[int]:
        return self._tokens({"prompt": text, "add_special_tokens": False})


Tokenizer = PromptTokenizer | ServerTokenizer  # what the gates size prompts with
