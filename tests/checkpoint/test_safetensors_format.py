"""The header parser: agrees with files the safetensors library writes, and names the file for every defect."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glmquant.checkpoint.safetensors_format import MAX_HEADER_BYTES, TensorSpec, build_header, parse_header
from glmquant.errors import CheckpointFormatError


def _raw_file(path: Path, header: dict, data: bytes, pad: bool = True) -> Path:
    blob = json.dumps(header).encode()
    if pad:
        blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def test_parses_library_file(tmp_path: Path) -> None:
    tensors = {
        "w": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.randn(7),
        "i": torch.tensor(7, dtype=torch.int32),
        "e": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = parse_header(path)
    raw = path.read_bytes()
    assert header.metadata == {"format": "pt"} and header.file_size == len(raw)
    for name, t in tensors.items():
        begin, end = header.span(name)
        assert header.tensors[name].spec.shape == tuple(t.shape)
        assert raw[begin:end] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    # the builder and the parser agree on the same specs
    prefix, placed = build_header(header.specs, {"format": "pt"})
    assert raw.startswith(prefix) and [p.begin for p in placed] == sorted(p.begin for p in header.tensors.values())


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = {"a": _entry("F32", [2], 0, 8), "b": _entry("I16", [2], 8, 12)}


@pytest.mark.parametrize(
    "header,data,message",
    [
        ({"a": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "unknown dtype 'F99'"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "needs 12 bytes but data_offsets"),
        ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, bytes(12), "overlapping data"),
        (GOOD, bytes(10), "run past the end of the data"),
        # a tensor whose offsets point past the end is named, not the gap its bytes leave before the next one
        (
            {"a": _entry("F32", [2], 1000, 1008), "b": _entry("I16", [2], 8, 12)},
            bytes(12),
            r"tensor 'a' data_offsets \[1000, 1008\] run past the end of the data \(12 bytes",
        ),
        (GOOD, bytes(16), "4 bytes after the last tensor"),
        ({"a": _entry("F32", [2], 4, 12)}, bytes(12), "4 unaccounted bytes before tensor 'a'"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), "invalid data_offsets"),
        ({"a": [1, 2]}, b"", "is not an object"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__ must map strings to strings"),
    ],
)
def test_malformed_headers(tmp_path: Path, header: dict, data: bytes, message: str) -> None:
    path = _raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointFormatError, match=message) as err:
        parse_header(path)
    assert str(path) in str(err.value)


def test_header_length_past_end(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointFormatError, match=f"{path}: header length 1000 runs past the end"):
        parse_header(path)


def test_header_too_large(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 8) + b"{}")
    with pytest.raises(CheckpointFormatError, match="exceeds the 100000000 byte limit"):
        parse_header(path)


@pytest.mark.parametrize(
    "blob,message",
    [
        (b"{not json}   ", "not valid JSON"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b"\xff\xfe\x00\x00\x00\x00\x00\x00", "not valid JSON"),
        (b"[1, 2]  ", "not a JSON object"),
    ],
)
def test_bad_json(tmp_path: Path, blob: bytes, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointFormatError, match=message):
        parse_header(path)


def test_too_short_and_missing(tmp_path: Path) -> None:
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(CheckpointFormatError, match="too short"):
        parse_header(tmp_path / "tiny.safetensors")
    with pytest.raises(CheckpointFormatError, match="cannot read"):
        parse_header(tmp_path / "absent.safetensors")


def test_unpadded_header_still_parses(tmp_path: Path) -> None:
    """Other writers do not pad the JSON; offsets are relative to wherever the header ends."""
    path = _raw_file(tmp_path / "unpadded.safetensors", GOOD, bytes(range(12)), pad=False)
    header = parse_header(path)
    begin, end = header.span("b")
    assert path.read_bytes()[begin:end] == bytes(range(8, 12))
    assert header.specs[0] == TensorSpec("a", "F32", (2,))
