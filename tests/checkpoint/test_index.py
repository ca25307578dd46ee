"""model.safetensors.index.json: deterministic text, and plain shard names only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmquant.checkpoint.index import SafetensorsIndex, index_text, read_index, write_index
from glmquant.errors import CheckpointFormatError


def test_round_trip_and_determinism(tmp_path: Path) -> None:
    shards = {"b.weight": "model-00002-of-00002.safetensors", "a.weight": "model-00001-of-00002.safetensors"}
    index = SafetensorsIndex(shards, 96)
    write_index(tmp_path / "i.json", index)
    text = (tmp_path / "i.json").read_text()
    assert text == index_text(SafetensorsIndex(dict(reversed(list(index.weight_map.items()))), 96))
    assert text.endswith("}\n") and text.index('"a.weight"') < text.index('"b.weight"')
    back = read_index(tmp_path / "i.json")
    assert back == SafetensorsIndex(dict(index.weight_map), 96)
    assert back.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    "body,message",
    [
        ({"weight_map": {"a": "../evil.safetensors"}}, "plain file names"),
        ({"weight_map": {"a": "/abs.safetensors"}}, "plain file names"),
        ({"weight_map": {"a": 3}}, "must map tensor names"),
        ({"metadata": {"total_size": -1}, "weight_map": {}}, "non-negative integer"),
        ({"metadata": "x", "weight_map": {}}, "'metadata' must be an object, got str"),
        ({"metadata": [1], "weight_map": {}}, "'metadata' must be an object, got list"),
        ([], "must map tensor names"),
    ],
)
def test_rejects_bad_index(tmp_path: Path, body: object, message: str) -> None:
    (tmp_path / "i.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointFormatError, match=message):
        read_index(tmp_path / "i.json")
    (tmp_path / "j.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="j.json: not valid JSON"):
        read_index(tmp_path / "j.json")
