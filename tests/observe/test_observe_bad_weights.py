"""A NaN or Inf in a source weight stops observe with an error naming the shard file and the tensor."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.cli import app

BF16_NAN, BF16_INF = 0x7FC0, 0x7F80
PREFIX = "model.language_model."


def poison(source: Path, name: str, element: int, bits: int) -> Path:
    """Overwrite one BF16 element of tensor `name` in its shard with `bits`; returns the shard."""
    with SourceCheckpoint.open(source) as ckpt:
        assert ckpt.spec(name).dtype == "BF16"
        shard = source / ckpt.shard_of(name)
        begin, _ = ckpt.headers[ckpt.shard_of(name)].span(name)
    with open(shard, "r+b") as f:
        f.seek(begin + 2 * element)
        f.write(struct.pack("<H", bits))
    return shard


@pytest.mark.parametrize(
    "name,element,bits",
    [
        # used to fail as "layer 1: routing.route disagrees with the model's router (transformers changed ...)"
        (PREFIX + "layers.1.self_attn.b_proj.weight", 3, BF16_NAN),
        # used to fail as "tensor hidden streams leaving layer 1 (lane mix, rows 0-4) has 60416 non-finite ..."
        (PREFIX + "layers.1.mlp.experts.1.gate_proj.weight", 5, BF16_INF),
        # an embedding row no calibration token selects: used to pass, the NaN going on into the artifact
        (PREFIX + "embed_tokens.weight", -1, BF16_NAN),
    ],
)
def test_a_non_finite_weight_is_named_with_its_file(
    tiny_source: Path, tmp_path: Path, name: str, element: int, bits: int
) -> None:
    source = Path(shutil.copytree(tiny_source, tmp_path / "source"))
    if element < 0:  # counted from the end
        with SourceCheckpoint.open(source) as ckpt:
            element += ckpt.read_tensor(name).numel()
    shard = poison(source, name, element, bits)
    result = CliRunner().invoke(
        app, ["observe", str(source), "--out", str(tmp_path / "obs"), "--rows", "2", "--tokens", "16"]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 1, output
    assert f"error: {shard}: tensor {name} has 1 non-finite value(s) (NaN/Inf)" in output
    assert "Traceback" not in output and not list((tmp_path / "obs").glob("layer-*"))
