"""write_safetensors: byte-identical to the safetensors library, streaming, and atomic under failure."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name, tensor_to_bytes
from glmquant.checkpoint.writer import Provided, atomic_write_text, write_safetensors
from glmquant.errors import CheckpointFormatError, GlmquantError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.w": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "model.layers.0.bias": torch.randn(7, generator=g),
        "a.trellis": torch.randint(-32768, 32767, (2, 3, 32), generator=g, dtype=torch.int16),
        "a.suh": torch.randn(32, generator=g).half(),
        "a.mcg": torch.tensor(-877912083, dtype=torch.int32),
        "z.empty": torch.zeros(0, 3, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64),
        "f64": torch.randn(2, generator=g, dtype=torch.float64),
    }


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(k, dtype_name(v), tuple(v.shape)) for k, v in tensors.items()]


@pytest.mark.parametrize("kind", ["tensor", "bytes", "streamer"])
def test_byte_identical_to_library(tmp_path: Path, kind: str) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "lib.safetensors"))

    def provide(spec: TensorSpec):
        t = tensors[spec.name]
        if kind == "tensor":
            return t
        if kind == "bytes":
            return bytes(tensor_to_bytes(t))
        return lambda f: f.write(bytes(tensor_to_bytes(t)))

    size = write_safetensors(tmp_path / "ours.safetensors", _specs(tensors), provide)
    lib = (tmp_path / "lib.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").read_bytes() == lib and size == len(lib)


def test_non_contiguous_tensor(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    save_file({"t": t.contiguous()}, str(tmp_path / "lib.safetensors"))
    write_safetensors(tmp_path / "ours.safetensors", [TensorSpec("t", "F32", (4, 3))], lambda s: t)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()


def _no_files_left(directory: Path) -> bool:
    return list(directory.iterdir()) == []


@pytest.mark.parametrize(
    "bad,message",
    [
        (torch.zeros(5, 7, dtype=torch.float16), "provided as F16 \\[5, 7\\], header says BF16 \\[5, 7\\]"),
        (b"short", "provided 5 bytes, expected 70"),
        (lambda f: f.write(b"x" * 3), "streamed 3 bytes, expected 70"),
    ],
)
def test_wrong_provider_output(tmp_path: Path, bad: Provided, message: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointFormatError, match=message):
        write_safetensors(out / "x.safetensors", [TensorSpec("w", "BF16", (5, 7))], lambda s: bad)
    assert _no_files_left(out)


def test_interrupt_leaves_nothing(tmp_path: Path) -> None:
    tensors = _tensors()
    calls = []

    def provide(spec: TensorSpec) -> torch.Tensor:
        calls.append(spec.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return tensors[spec.name]

    with pytest.raises(KeyboardInterrupt):
        write_safetensors(tmp_path / "x.safetensors", _specs(tensors), provide)
    assert _no_files_left(tmp_path) and len(calls) == 3


def test_interrupt_keeps_previous_complete_file(tmp_path: Path) -> None:
    """Rewriting a file that exists: the old complete file stays until the new one is complete."""
    path = tmp_path / "x.safetensors"
    write_safetensors(path, [TensorSpec("w", "F32", (2,))], lambda s: torch.ones(2))
    before = path.read_bytes()

    def fail(spec: TensorSpec) -> bytes:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_safetensors(path, [TensorSpec("w", "F32", (2,))], fail)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_disk_full_is_a_clear_error(tmp_path: Path) -> None:
    def provide(spec: TensorSpec):
        def stream(f) -> int:
            f.write(b"\0" * 8)
            raise OSError(errno.ENOSPC, "No space left on device")

        return stream

    with pytest.raises(GlmquantError, match="x.safetensors: disk full while writing") as err:
        write_safetensors(tmp_path / "x.safetensors", [TensorSpec("w", "F32", (4,))], provide)
    assert isinstance(err.value.__cause__, OSError) and _no_files_left(tmp_path)


def test_atomic_write_text(tmp_path: Path) -> None:
    atomic_write_text(tmp_path / "a.json", "{}\n")
    assert (tmp_path / "a.json").read_text() == "{}\n" and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(GlmquantError, match="write failed"):
        atomic_write_text(tmp_path / "missing-dir" / "a.json", "x")
