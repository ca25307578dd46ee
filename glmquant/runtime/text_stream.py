"""Incremental detokenization with stop strings: turn a growing list of token ids into safe text deltas.

Each step decodes only a short window of recent ids (TGI's prefix/read offsets), so the cost per token
is constant; text that could still become a stop string, or an incomplete UTF-8 sequence, is held back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    """Feed token ids one at a time; `push` returns the text that is now final (possibly empty)."""

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start / end of the ids already turned into text
        self._text = ""  # all text decoded so far
        self._emitted = 0  # characters of _text already returned
        self.stopped = False  # a stop string was found (text after it is dropped)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held back (called once the generation has ended)."""
        if self._read < len(self._ids):
            self._text += self._decode(self._ids[self._prefix :])[
                len(self._decode(self._ids[self._prefix : self._read])) :
            ]
            self._read = len(self._ids)
        return self._release(final=True)

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self._text.find(s, max(0, self._emitted - len(s))) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._text = self._text[: min(hits)]
            end = len(self._text)
        else:
            end = len(self._text) if final else len(self._text) - self._partial_stop()
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest
