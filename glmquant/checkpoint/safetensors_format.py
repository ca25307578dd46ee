"""The safetensors container, byte for byte as the safetensors library (0.4-0.8) writes it.

Layout: u64 little-endian header length N, N bytes of compact JSON padded with spaces to a multiple of 8,
then the tensor data. The library orders tensors by dtype (widest first, as below), then by name, and
lays the data out in that order with no gaps. Matching this exactly lets `plan` predict file sizes and
lets the writer stream raw bytes while producing the same file the library would. The parser reads a
header without touching tensor data and rejects every malformed file with an error naming it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from json.encoder import encode_basestring
from math import prod
from pathlib import Path
from typing import NamedTuple, Protocol

from glmquant.arch.table import DTYPE_BYTES
from glmquant.errors import CheckpointFormatError

# Rank in the library's dtype enum; tensors are written in descending rank, then by name.
DTYPE_RANK = {
    name: rank
    for rank, name in enumerate(
        [
            "BOOL",
            "F4",
            "F6_E2M3",
            "F6_E3M2",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "F8_E8M0",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "C64",
            "F64",
            "I64",
            "U64",
        ]
    )
}


class TensorSpec(NamedTuple):
    """A tensor as a safetensors header describes it (a NamedTuple: a plan makes 583,090, a frozen dataclass
    takes five times as long to build)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class PlacedTensor:
    spec: TensorSpec
    begin: int  # offset inside the data section
    end: int


class TensorLike(Protocol):
    """What a header entry is made from: a TensorSpec, or a plan's OutputTensor (sized without a copy)."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


def data_order(specs: Sequence[TensorLike]) -> list[TensorLike]:
    """The order in which the library writes tensor data."""
    return sorted(specs, key=lambda s: (-DTYPE_RANK[s.dtype], s.name))


def _header_json(
    specs: Sequence[TensorLike],
    metadata: Mapping[str, str] | None,
) -> tuple[bytes, list[TensorLike], list[int]]:
    """The padded header JSON, the tensors in data order and the end offset of each.

    The text is what json.dumps(header, separators=(",", ":"), ensure_ascii=False) gives, written entry by
    entry: a plan sizes 583,090 entries, and a dict per entry plus one dumps call take four times as long.
    """
    names = {s.name for s in specs}
    if len(names) != len(specs):
        raise ValueError("duplicate tensor names in one safetensors file")
    ordered = data_order(specs)
    ends = list(accumulate(s.nbytes for s in ordered))
    entries = [
        f'{encode_basestring(s.name)}:{{"dtype":"{s.dtype}","shape":[{",".join(map(str, s.shape))}],'
        f'"data_offsets":[{end - s.nbytes},{end}]}}'
        for s, end in zip(ordered, ends)
    ]
    if metadata is not None:
        entries.insert(0, '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False))
    blob = ("{" + ",".join(entries) + "}").encode("utf-8")
    return blob + b" " * (-len(blob) % 8), ordered, ends


def build_header(
    specs: Sequence[TensorSpec],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[PlacedTensor]]:
    """The exact file prefix (length + padded JSON) and where each tensor's bytes go."""
    blob, ordered, ends = _header_json(specs, metadata)
    placed = [PlacedTensor(TensorSpec(s.name, s.dtype, s.shape), end - s.nbytes, end) for s, end in zip(ordered, ends)]
    return struct.pack("<Q", len(blob)) + blob, placed


def file_size(specs: Sequence[TensorLike], metadata: Mapping[str, str] | None = None) -> int:
    blob, _, ends = _header_json(specs, metadata)
    return 8 + len(blob) + (ends[-1] if ends else 0)


MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers too


@dataclass(frozen=True)
class ParsedHeader:
    """A validated safetensors header: tensors with offsets relative to `data_start`, in data order."""

    path: str
    data_start: int  # 8 + header length: absolute offset of the data section
    tensors: Mapping[str, PlacedTensor]
    metadata: Mapping[str, str] | None
    file_size: int

    def span(self, name: str) -> tuple[int, int]:
        """Absolute [begin, end) byte range of a tensor's data in the file."""
        placed = self.tensors[name]
        return self.data_start + placed.begin, self.data_start + placed.end

    @property
    def specs(self) -> list[TensorSpec]:
        return [p.spec for p in self.tensors.values()]


def parse_header(path: str | Path) -> ParsedHeader:
    """Read and validate one file's header; raise CheckpointFormatError naming the file on any defect."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(f"{path}: {size} bytes is too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointFormatError(f"{path}: header of {n} bytes exceeds the {MAX_HEADER_BYTES} byte limit")
            if 8 + n > size:
                raise CheckpointFormatError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
            blob = f.read(n)
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return parse_header_bytes(blob, size, str(path))


def parse_header_bytes(blob: bytes, file_size: int, path: str) -> ParsedHeader:
    """Validate a header's JSON against the file it came from (`blob` excludes the 8-byte length)."""
    try:
        raw = json.loads(blob.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    metadata = raw.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointFormatError(f"{path}: __metadata__ must map strings to strings")
    placed = sorted((_entry(path, name, value) for name, value in raw.items()), key=lambda p: (p.begin, p.end))
    data_start = 8 + len(blob)
    _check_layout(path, placed, file_size - data_start)
    return ParsedHeader(path, data_start, {p.spec.name: p for p in placed}, metadata, file_size)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _entry(path: str, name: str, value: object) -> PlacedTensor:
    """One header entry, with its dtype, shape and size checked against each other."""
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{path}: entry for tensor {name!r} is not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointFormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise CheckpointFormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    spec = TensorSpec(name, dtype, tuple(shape))
    if offsets[1] - offsets[0] != spec.nbytes:
        raise CheckpointFormatError(
            f"{path}: tensor {name!r} shape {list(shape)} {dtype} needs {spec.nbytes} bytes but data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}"
        )
    return PlacedTensor(spec, offsets[0], offsets[1])


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(path: str, placed: Sequence[PlacedTensor], data_bytes: int) -> None:
    """Tensors must tile the data section exactly: no overlap, no gap, nothing past the end or after it."""
    # past the end first: a tensor whose offsets were pushed past it is named, not the gap it leaves behind
    for p in placed:
        if p.end > data_bytes:
            raise CheckpointFormatError(
                f"{path}: tensor {p.spec.name!r} data_offsets [{p.begin}, {p.end}] run past the end of the data "
                f"({data_bytes} bytes; file truncated?)"
            )
    cursor, previous = 0, None
    for p in placed:
        if p.begin < cursor:
            raise CheckpointFormatError(f"{path}: tensors {previous!r} and {p.spec.name!r} have overlapping data")
        if p.begin > cursor:
            raise CheckpointFormatError(f"{path}: {p.begin - cursor} unaccounted bytes before tensor {p.spec.name!r}")
        cursor, previous = p.end, p.spec.name
    if cursor != data_bytes:
        raise CheckpointFormatError(f"{path}: {data_bytes - cursor} bytes after the last tensor's data")
