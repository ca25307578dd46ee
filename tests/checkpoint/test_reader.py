"""SourceCheckpoint on the sharded tiny source: same tensors and bytes as the safetensors library reads,
only the requested ranges, and clear errors for an index that disagrees with its shards."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmquant.checkpoint import reader as reader_module
from glmquant.checkpoint.reader import SourceCheckpoint, assert_finite
from glmquant.errors import CheckpointFormatError, NumericalError, UsageError


def test_sharded_source_matches_library(tiny_source: Path) -> None:
    index = json.loads((tiny_source / "model.safetensors.index.json").read_text())["weight_map"]
    with SourceCheckpoint.open(tiny_source) as ckpt:
        assert sorted(ckpt.names()) == sorted(index) and ckpt.config_path == tiny_source / "config.json"
        for shard in sorted(set(index.values())):
            with safe_open(tiny_source / shard, "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has keys() but no __iter__
                    expected = f.get_tensor(name)
                    got = ckpt.read_tensor(name)
                    assert ckpt.shard_of(name) == shard
                    assert got.dtype == expected.dtype and torch.equal(got, expected), name
                    assert ckpt.spec(name).shape == tuple(expected.shape)
                    raw = expected.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    assert ckpt.read_raw(name) == raw


def test_copy_raw_streams_in_chunks(tiny_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_module, "COPY_CHUNK", 1000)  # force many chunks, one partial
    with SourceCheckpoint.open(tiny_source) as ckpt:
        name = "model.language_model.embed_tokens.weight"
        buf = io.BytesIO()
        assert ckpt.copy_raw_into(name, buf) == ckpt.spec(name).nbytes
        assert buf.getvalue() == ckpt.read_raw(name)
        part = io.BytesIO()
        ckpt.copy_raw_into(name, part, start=256, length=2500)
        assert part.getvalue() == ckpt.read_raw(name)[256:2756]
        with pytest.raises(ValueError, match="outside tensor"):
            ckpt.copy_raw_into(name, part, start=1, length=ckpt.spec(name).nbytes)


def test_read_finite_float_returns_float32_or_names_the_shard_and_tensor(tmp_path: Path) -> None:
    """The weight encode reads: float32 of the stored values, or a NaN/Inf refused naming the shard and the tensor."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bad = w.clone()
    bad[1, 2] = float("nan")
    save_file({"w": w.bfloat16(), "bad": bad.bfloat16()}, str(tmp_path / "model.safetensors"))
    with SourceCheckpoint.open(tmp_path) as ckpt:
        read = ckpt.read_finite_float("w")
        assert read.dtype == torch.float32 and torch.equal(read, w)
        with pytest.raises(NumericalError) as err:
            ckpt.read_finite_float("bad")
    assert str(err.value) == f"{tmp_path / 'model.safetensors'}: tensor bad has 1 non-finite value(s) (NaN/Inf) of 12"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_copy_raw_refuses_non_finite_values_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With finite=True a copy stops at a NaN/Inf, naming the file and the tensor (counted over every chunk); the
    rows it does not copy, integer tensors, and a copy that does not ask are not checked."""
    monkeypatch.setattr(reader_module, "COPY_CHUNK", 64)  # several chunks per tensor
    w = torch.ones(8, 16)
    w[5, 3] = float("nan")
    w[7, 0] = float("inf") if dtype != torch.float8_e4m3fn else float("nan")  # e4m3fn has no Inf
    save_file({"w": w.to(dtype), "ids": torch.arange(8)}, str(tmp_path / "model.safetensors"))
    row = 16 * w.to(dtype).element_size()
    with SourceCheckpoint.open(tmp_path) as ckpt:
        with pytest.raises(NumericalError) as err:
            ckpt.copy_raw_into("w", io.BytesIO(), finite=True)
        assert (
            str(err.value) == f"{tmp_path / 'model.safetensors'}: tensor w has 2 non-finite value(s) (NaN/Inf) of 128"
        )
        with pytest.raises(NumericalError, match="tensor w has 1 non-finite value.* in the 16 copied"):
            ckpt.copy_raw_into("w", io.BytesIO(), 5 * row, row, finite=True)
        assert ckpt.copy_raw_into("w", io.BytesIO(), 0, 5 * row, finite=True) == 5 * row
        assert ckpt.copy_raw_into("w", io.BytesIO()) == 8 * row
        assert ckpt.copy_raw_into("ids", io.BytesIO(), finite=True) == 64


def test_single_file_forms(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for target in (tmp_path, tmp_path / "model.safetensors"):
        with SourceCheckpoint.open(target) as ckpt:
            assert sorted(ckpt.names()) == ["a", "b"] and torch.equal(ckpt.read_tensor("a"), tensors["a"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="neither model.safetensors.index.json nor model.safetensors"):
        SourceCheckpoint.open(empty)
    with pytest.raises(UsageError, match="no such checkpoint"):
        SourceCheckpoint.open(tmp_path / "nowhere")


def _edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index, dst)
    index_path.write_text(json.dumps(index))
    return dst


def test_missing_shard(tiny_source: Path, tmp_path: Path) -> None:
    ckpt = _edited_copy(tiny_source, tmp_path / "c", lambda i, d: (d / "model-00002-of-00015.safetensors").unlink())
    with pytest.raises(CheckpointFormatError, match="shard model-00002-of-00015.safetensors is listed but missing"):
        SourceCheckpoint.open(ckpt)


def test_name_in_index_not_in_header(tiny_source: Path, tmp_path: Path) -> None:
    def edit(index: dict, _: Path) -> None:
        index["weight_map"]["model.ghost.weight"] = "model-00001-of-00015.safetensors"

    with pytest.raises(CheckpointFormatError, match="model.ghost.weight is mapped to model-00001-of-00015"):
        SourceCheckpoint.open(_edited_copy(tiny_source, tmp_path / "c", edit))


def test_header_name_not_in_index(tiny_source: Path, tmp_path: Path) -> None:
    def edit(index: dict, _: Path) -> None:
        del index["weight_map"]["lm_head.weight"]

    with pytest.raises(CheckpointFormatError, match="not in the index, e.g. lm_head.weight"):
        SourceCheckpoint.open(_edited_copy(tiny_source, tmp_path / "c", edit))


def test_duplicate_across_shards(tiny_source: Path, tmp_path: Path) -> None:
    def edit(index: dict, d: Path) -> None:
        save_file({"lm_head.weight": torch.zeros(2)}, str(d / "model-00099-of-00099.safetensors"))
        index["weight_map"]["extra"] = "model-00099-of-00099.safetensors"

    with pytest.raises(CheckpointFormatError, match="lm_head.weight appears in both"):
        SourceCheckpoint.open(_edited_copy(tiny_source, tmp_path / "c", edit))


def test_truncated_shard_named(tiny_source: Path, tmp_path: Path) -> None:
    def edit(_: dict, d: Path) -> None:
        shard = d / "model-00003-of-00015.safetensors"
        shard.write_bytes(shard.read_bytes()[:-10])

    with pytest.raises(CheckpointFormatError, match="model-00003-of-00015.safetensors: .* run past the end"):
        SourceCheckpoint.open(_edited_copy(tiny_source, tmp_path / "c", edit))


def test_assert_finite() -> None:
    assert_finite("ok", torch.ones(3, dtype=torch.bfloat16))
    assert_finite("ints", torch.tensor([1, 2]))
    bad = torch.tensor([1.0, float("nan"), float("inf")]).to(torch.bfloat16)
    with pytest.raises(NumericalError, match="tensor layers.3.w has 2 non-finite value"):
        assert_finite("layers.3.w", bad)


def _relabelled_copy(source: Path, out: Path, name: str, **change: object) -> Path:
    """A copy of `source` whose header gives tensor `name` another dtype or shape, the data untouched (the header
    re-serialized in place, padded with spaces as safetensors allows)."""
    shutil.copytree(source, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    path = out / index[name]
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header[name].update(change)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    data[8 : 8 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(
    "change, says",
    [
        ({"dtype": "F16"}, "is F16 [512, 128], but its config gives BF16 [512, 128]"),
        ({"shape": [128, 512]}, "is BF16 [128, 512], but its config gives BF16 [512, 128]"),
    ],
)
def test_a_header_unlike_the_config_is_refused_naming_the_shard_and_tensor(
    tiny_source: Path, tmp_path: Path, change: dict, says: str
) -> None:
    """A routed expert's header relabelled F16 (same bytes) or transposed: encode refuses it before any work, naming
    the shard and the tensor (it wrote an artifact of other numbers); observe refuses the transposed one (it reads
    any float dtype, an F32 reference among them, converting each tensor to the model's)."""
    from typer.testing import CliRunner

    from glmquant.arch import load_model_spec, source_tensors
    from glmquant.cli import app

    name = "model.language_model.layers.1.mlp.experts.0.gate_proj.weight"
    expected = {t.name: t for t in source_tensors(load_model_spec(tiny_source))}[name]
    assert (expected.dtype, list(expected.shape)) == ("BF16", [512, 128])  # the fixture's: the message below
    source = _relabelled_copy(tiny_source, tmp_path / "src", name, **change)
    with SourceCheckpoint.open(source) as ckpt:  # the file itself is well formed
        shard = source / ckpt.shard_of(name)
        with pytest.raises(CheckpointFormatError, match=re.escape(f"{shard}: tensor {name} {says}")):
            ckpt.check_specs(source_tensors(load_model_spec(source)))
    commands = [["encode", str(source), "--uncalibrated", "--out", str(tmp_path / "art")]]
    if "shape" in change:
        commands.append(["observe", str(source), "--out", str(tmp_path / "obs")])
    for argv in commands:
        result = CliRunner().invoke(app, argv)
        assert result.exit_code != 0 and f"tensor {name} {says}" in " ".join(result.output.split()), result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)  # an error, not a traceback
    assert not (tmp_path / "art" / "EXL3_MANIFEST.json").exists()
