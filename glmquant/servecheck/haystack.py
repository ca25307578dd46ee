"""Filler text sized to an exact prompt length with the model's own tokenizer (long-context and speed gates).

Sentences are drawn from a seeded generator, so a seed gives the same haystack; their standalone token
counts estimate the fill, and exact counts of the whole rendered prompt correct it (drop sentences when
over, then pad with a one-word piece), so the prompt lands on the target or a token or two below it.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from glmquant.errors import UsageError
from glmquant.servecheck.tokens import Tokenizer

_SUBJECTS = (
    "The harbour master",
    "A travelling merchant",
    "The village baker",
    "An old cartographer",
    "The night watchman",
    "A young botanist",
    "The river ferryman",
    "A quiet librarian",
    "The mountain guide",
    "A weaver from the coast",
)
_VERBS = (
    "described",
    "carefully mapped",
    "wrote a letter about",
    "argued about",
    "walked past",
    "painted",
    "measured",
    "remembered",
    "counted the stones of",
    "sang a song about",
)
_OBJECTS = (
    "the northern lighthouse",
    "a field of tall grass",
    "the old stone bridge",
    "the winter market",
    "a ship with grey sails",
    "the empty granary",
    "a garden of herbs",
    "the clock tower",
    "the salt marshes",
    "a narrow mountain pass",
)
_ENDINGS = (
    "before the rain began.",
    "while the bells were ringing.",
    "at the end of a long afternoon.",
    "under a pale sky.",
    "as the tide went out.",
    "long after supper.",
    "without saying a word.",
    "in the early morning.",
)
PAD_WORD = "so"
_BATCH = 512
_SETTLE_ROUNDS = 8

Render = Callable[["Filler"], Sequence[dict[str, Any]]]


def filler_sentences(seed: int) -> Iterator[str]:
    """An endless, seeded stream of plain sentences (no digits, no needle names)."""
    rng = random.Random(seed)
    while True:
        yield f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"


@dataclass(frozen=True)
class Filler:
    sentences: tuple[str, ...]
    lengths: tuple[int, ...]  # standalone token count of " " + sentence
    pad: int = 0  # PAD_WORD pieces appended after the sentences
    pad_tokens: int = 0  # tokens each pad piece adds

    def text(self, inserts: Sequence[tuple[int, str]] = ()) -> str:
        """The filler with each (index, text) insert placed before sentence `index`."""
        at: dict[int, list[str]] = {}
        for index, insert in inserts:
            at.setdefault(index, []).append(insert)
        parts: list[str] = []
        for i, sentence in enumerate(self.sentences):
            parts += at.get(i, [])
            parts.append(sentence)
        parts += at.get(len(self.sentences), []) + [PAD_WORD] * self.pad
        return " ".join(parts)

    def index_at(self, depth: float) -> int:
        """The sentence boundary nearest to `depth` (0..1) of the filler's tokens (padding included)."""
        boundaries = list(itertools.accumulate(self.lengths, initial=0))  # token offset before each sentence
        goal = depth * (boundaries[-1] + self.pad * self.pad_tokens)
        i = bisect.bisect_left(boundaries, goal)
        if i == len(boundaries) or (i > 0 and goal - boundaries[i - 1] <= boundaries[i] - goal):
            i -= 1
        return i

    def trimmed(self, tokens: int) -> Filler:
        """Without the last sentences holding at least `tokens` tokens, and without padding."""
        n = len(self.sentences)
        while n > 0 and tokens > 0:
            n -= 1
            tokens -= self.lengths[n]
        return Filler(self.sentences[:n], self.lengths[:n])


def fit_filler(tokenizer: Tokenizer, render: Render, target: int, seed: int) -> tuple[Filler, int]:
    """The filler whose rendered prompt has `target` tokens (or just below), and that prompt's exact count."""
    base = tokenizer.count(render(Filler((), ())))
    if base > target:
        raise UsageError(f"a {target}-token prompt is shorter than its fixed part ({base} tokens); ask for more")
    stream = filler_sentences(seed)
    sentences: list[str] = []
    lengths: list[int] = []
    budget = target - base
    while budget > 0:
        batch = [next(stream) for _ in range(_BATCH)]
        for sentence, n in zip(batch, tokenizer.lengths([" " + s for s in batch])):
            if n > budget:
                budget = 0
                break
            sentences.append(sentence)
            lengths.append(n)
            budget -= n
    return _settle(tokenizer, render, Filler(tuple(sentences), tuple(lengths)), target)


def _settle(tokenizer: Tokenizer, render: Render, filler: Filler, target: int) -> tuple[Filler, int]:
    """Replace the estimate by exact counts: trim while over the target, then pad up to it."""
    count = tokenizer.count(render(filler))
    for _ in range(_SETTLE_ROUNDS):
        if count <= target:
            break
        filler = filler.trimmed(count - target)
        count = tokenizer.count(render(filler))
    pad_cost = tokenizer.count(render(Filler(filler.sentences, filler.lengths, 1))) - count
    if count < target and pad_cost > 0:
        padded = Filler(filler.sentences, filler.lengths, (target - count) // pad_cost, pad_cost)
        padded_count = tokenizer.count(render(padded))
        if padded_count <= target:
            filler, count = padded, padded_count
    return filler, count
