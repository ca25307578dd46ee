"""Recipe + tokenizer -> TokenRows: each lane's rows split over its mixture, packed, then interleaved.

A lane of R rows gives source i round(R·wᵢ/Σw) rows (largest remainder, so the shares sum to R exactly),
packs them from that source's documents, and shuffles the rows of all sources together with the lane's
seed so every batch sees the whole mix. Every random choice derives from (recipe seed, lane, source,
epoch): the same recipe and tokenizer give the same rows, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from glmquant.calibration.packing import Packed, pack_rows, random_rows
from glmquant.calibration.recipe import Lane, Recipe
from glmquant.calibration.sources import derive_seed, documents, file_sha256
from glmquant.calibration.token_rows import INFO_FILE, LaneRows, TokenRows


def build_token_rows(recipe: Recipe, tokenizer: Any) -> TokenRows:
    epochs: dict[str, int] = {}
    lanes = tuple(_lane(recipe, lane, tokenizer, epochs) for lane in recipe.lanes)
    hashes = _data_hashes(recipe)
    sources = {
        name: {"kind": spec.kind, "sha256": hashes.get(name), "epochs": epochs.get(name, 0)}
        for name, spec in sorted(recipe.sources.items())
    }
    return TokenRows(lanes, recipe.describe(), recipe.sha256(hashes), tokenizer_sha256(tokenizer), sources)


def reuse_or_build(recipe: Recipe, tokenizer: Any, out_dir: Path) -> TokenRows:
    """The rows saved in `out_dir` when they came from this recipe and tokenizer, else freshly built
    (not saved: the caller decides, once it knows the rows may replace what is there).

    Reusing saved rows lets a resumed run skip re-streaming remote datasets.
    """
    if (out_dir / INFO_FILE).is_file():
        saved = TokenRows.load(out_dir)
        if saved.recipe_sha256 == recipe.sha256(_data_hashes(recipe)) and saved.tokenizer_sha256 == tokenizer_sha256(
            tokenizer
        ):
            return saved
    return build_token_rows(recipe, tokenizer)


def tokenizer_sha256(tokenizer: Any) -> str:
    """Identity of a tokenizer's behaviour: its full definition (vocab, merges, normalizer) and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    body += "\x00" + str(getattr(tokenizer, "chat_template", None))
    return hashlib.sha256(body.encode()).hexdigest()


def _data_hashes(recipe: Recipe) -> dict[str, str]:
    return {name: h for name, spec in recipe.sources.items() if (h := file_sha256(spec))}


def split_rows(rows: int, weights: Sequence[float]) -> list[int]:
    """Integer shares of `rows` proportional to `weights` that sum to `rows` (largest remainder)."""
    total = sum(weights)
    exact = [rows * w / total for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[: rows - sum(shares)]:
        shares[i] += 1
    return shares


def _lane(recipe: Recipe, lane: Lane, tokenizer: Any, epochs: dict[str, int]) -> LaneRows:
    parts: list[torch.Tensor] = []
    origin: list[str] = []
    for entry, count in zip(lane.mix, split_rows(lane.rows, [m.weight for m in lane.mix])):
        if count == 0:
            continue
        packed = _pack(recipe, lane, entry.source, count, tokenizer)
        epochs[entry.source] = max(epochs.get(entry.source, 0), packed.epochs)
        parts.append(packed.ids)
        origin += [entry.source] * count
    order = torch.randperm(lane.rows, generator=torch.Generator().manual_seed(derive_seed(recipe.seed, lane.name)))
    ids = torch.cat(parts)[order].contiguous()
    return LaneRows(lane.name, lane.use, ids, tuple(origin[i] for i in order.tolist()))


def _pack(recipe: Recipe, lane: Lane, source: str, rows: int, tokenizer: Any) -> Packed:
    spec = recipe.sources[source]
    if spec.kind == "random":
        return random_rows(tokenizer, rows, lane.tokens, derive_seed(recipe.seed, lane.name, source))
    return pack_rows(
        lambda epoch: documents(spec, derive_seed(recipe.seed, lane.name, source, epoch), tokenizer),
        tokenizer,
        rows,
        lane.tokens,
        source,
    )
