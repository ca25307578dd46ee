"""Documents of one calibration source, in a seeded order, as text ready for the tokenizer.

Local files (text, jsonl, parquet) are small corpora: their documents are read once and shuffled with
the seed. Hugging Face datasets are streamed (`datasets.load_dataset(..., streaming=True)`) through a
seeded shuffle buffer, so nothing is downloaded in full. Chat-format records (a list of {role, content}
messages) are rendered with the model's own chat template.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from glmquant.calibration.recipe import SourceSpec
from glmquant.errors import UsageError


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any labels (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def documents(spec: SourceSpec, seed: int, tokenizer: Any) -> Iterator[str]:
    """The source's documents as text, shuffled by `seed` (a new seed gives a new order)."""
    records: Iterable[Any]
    if spec.kind == "hf":
        records = _hf_records(spec, seed)
    else:
        local = _local_records(spec)
        random.Random(seed).shuffle(local)
        records = local
    for record in records:
        text = _render(spec, record, tokenizer)
        if text:
            yield text


def file_sha256(spec: SourceSpec) -> str | None:
    if spec.path is None:
        return None
    try:
        return hashlib.sha256(Path(spec.path).read_bytes()).hexdigest()
    except OSError as exc:
        raise UsageError(f"source {spec.name}: cannot read {spec.path} ({exc.strerror or exc})") from None


def _local_records(spec: SourceSpec) -> list[Any]:
    path = Path(spec.path or "")
    try:
        if spec.kind == "text":
            text = path.read_text(encoding="utf-8")
            parts = text.split(spec.separator) if spec.separator else [text]
            return [p.strip() for p in parts if p.strip()]
        if spec.kind == "jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            return [_field(spec, json.loads(line), f"{path}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[spec.field] + ([spec.response_field] if spec.response_field else []))
        return [_field(spec, row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]
    except OSError as exc:
        raise UsageError(f"source {spec.name}: cannot read {path} ({exc.strerror or exc})") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, bad parquet or a missing parquet column
        raise UsageError(f"source {spec.name}: {path}: not valid {spec.kind} ({exc})") from None


def _hf_records(spec: SourceSpec, seed: int) -> Iterator[Any]:
    import datasets

    try:
        ds = datasets.load_dataset(
            spec.dataset, spec.subset, split=spec.split, streaming=True, data_files=list(spec.data_files) or None
        )
        stream = ds.shuffle(seed=seed % 2**32, buffer_size=spec.shuffle_buffer)
        for i, row in enumerate(stream):
            yield _field(spec, row, f"{spec.dataset} row {i}")
    except (OSError, ValueError) as exc:  # offline (ConnectionError), unknown dataset, bad subset or split
        raise UsageError(
            f"source {spec.name}: cannot stream Hugging Face dataset {spec.dataset!r} "
            f"(offline, or a wrong name/subset/split?): {exc}"
        ) from None


def _field(spec: SourceSpec, record: Any, where: str) -> Any:  # record: parsed JSON or a parquet row
    """The record's text (or messages); a prompt/response pair becomes a two-message chat."""
    wanted = [spec.field] + ([spec.response_field] if spec.response_field else [])
    missing = [f for f in wanted if not isinstance(record, dict) or f not in record]
    if missing:
        raise UsageError(f"source {spec.name}: {where}: record has no field {missing[0]!r}")
    if spec.response_field:
        return [
            {"role": "user", "content": record[spec.field]},
            {"role": "assistant", "content": record[spec.response_field]},
        ]
    return record[spec.field]


def _render(spec: SourceSpec, value: Any, tokenizer: Any) -> str:
    if spec.format == "text":
        if not isinstance(value, str):
            raise UsageError(
                f"source {spec.name}: field {spec.field!r} holds {type(value).__name__}, not text "
                "(use format: chat for message lists)"
            )
        return value
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise UsageError(
            f"source {spec.name}: format chat needs {spec.field!r} to be a list of {{role, content}} messages"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"source {spec.name}: the model's tokenizer has no chat template to render chat samples")
    return tokenizer.apply_chat_template(value, tokenize=False)
