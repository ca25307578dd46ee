"""Packing: documents -> one token stream (documents joined by the end-of-text token) -> rows of T tokens.

No padding anywhere: every row is T real tokens, so the layer-streamed forward needs no attention mask.
A document longer than a row continues into the next row. When a source runs out before its share of
rows is filled it starts over in a new seeded order (an "epoch", recorded in token_rows.json).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from glmquant.errors import UsageError


@dataclass(frozen=True)
class Packed:
    ids: torch.Tensor  # [rows, tokens] int32
    epochs: int  # passes over the source's documents (1 = no document used twice)


def pack_rows(
    docs_for_epoch: Callable[[int], Iterator[str]], tokenizer: Any, rows: int, tokens: int, source: str
) -> Packed:
    """Fill `rows` x `tokens` from the documents; `docs_for_epoch(e)` yields epoch e's documents."""
    need, epoch = rows * tokens, 0
    stream: list[int] = []
    separator = _separator(tokenizer)
    while len(stream) < need:
        produced = False
        for doc in docs_for_epoch(epoch):
            ids = tokenizer.encode(doc, add_special_tokens=False)
            if ids:
                stream.extend(ids)
                stream.append(separator)
                produced = True
            if len(stream) >= need:
                break
        if not produced:
            raise UsageError(f"source {source}: produced no text to calibrate on")
        epoch += 1
    return Packed(torch.tensor(stream[:need], dtype=torch.int32).view(rows, tokens), epoch)


def random_rows(tokenizer: Any, rows: int, tokens: int, seed: int) -> Packed:
    """Uniformly random ordinary (non-special) token ids: the "random tokens" lane ExLlamaV3 also uses."""
    special = set(tokenizer.all_special_ids)
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in special], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    return Packed(allowed[torch.randint(len(allowed), (rows, tokens), generator=gen)], 1)


def _separator(tokenizer: Any) -> int:
    eos = tokenizer.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise UsageError("the model's tokenizer defines no end-of-text token to separate packed documents")
    return int(eos)
