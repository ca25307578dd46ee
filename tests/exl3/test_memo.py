"""$GLMQUANT_ENCODE_MEMO: a repeated encode reads its result back, bit for bit what encoding again gives; anything
the result depends on is part of the key; a damaged entry is encoded again; a full disk costs the entry only."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError

from glmquant.environment import ENCODE_MEMO, check_environment
from glmquant.errors import UsageError
from glmquant.exl3 import EncodedLinear, encode_linears
from glmquant.exl3 import encode as encode_module
from glmquant.exl3 import memo as memo_module
from glmquant.exl3.backends import select_backend
from glmquant.exl3.memo import EncodeMemo
from glmquant.exl3.scale_search import EXLLAMAV3_SEARCH


def _items() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(512, 128, generator=gen)
    weight = torch.randn(64, 128, generator=gen)
    return [(weight, x.T @ x / 512), (weight.to(torch.bfloat16), None)]


def _same(a: EncodedLinear, b: EncodedLinear) -> bool:
    parts = ("trellis", "suh", "svh")
    return all(torch.equal(getattr(a.tensor, p), getattr(b.tensor, p)) for p in parts) and (
        (a.proxy_error, a.fallback, a.calibrated, a.tensor.codebook)
        == (b.proxy_error, b.fallback, b.calibrated, b.tensor.codebook)
    )


def _refuse_encoding(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on every encode must come from the memo, except those counted: the batch sizes encoded."""
    encoded: list[int] = []
    real = encode_module._encode_linears

    def counted(items: list, *args: Any) -> list[EncodedLinear]:
        encoded.append(len(items))
        return real(items, *args)

    monkeypatch.setattr(encode_module, "_encode_linears", counted)
    return encoded


def test_repeated_encodes_read_back_what_encoding_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    items = _items()
    other = (items[0][0] * 0.5, items[0][1])
    fresh = encode_linears([*items, other], 2)  # no memo: tests/exl3 compute every encode
    monkeypatch.setenv(ENCODE_MEMO, str(tmp_path / "memo"))
    first = encode_linears(items, 2)
    assert len(list((tmp_path / "memo").glob("*.safetensors"))) == 2
    encoded = _refuse_encoding(monkeypatch)
    again = encode_linears(items, 2)
    assert encoded == [] and all(_same(a, b) for a, b in zip(fresh, first)) and all(map(_same, fresh, again))
    assert again[1].fallback == "no_hessian" and not again[1].calibrated and again[0].calibrated
    # a batch of a kept encode and a new one encodes the new one alone, in its place
    mixed = encode_linears([other, items[0]], 2)
    assert encoded == [1] and _same(mixed[1], fresh[0]) and _same(mixed[0], fresh[2])


@pytest.mark.parametrize(
    ("bits", "options", "changed"),
    [
        (3, {}, None),
        (2, {"codebook": "3inst"}, None),
        (2, {"seed": 1}, None),
        (2, {"refit_rounds": 0}, None),
        (2, {"scale_search": EXLLAMAV3_SEARCH}, None),
        (2, {}, "matmul precision"),
        (2, {}, "hessian"),  # the first item's
        (2, {}, "dtype"),  # the second item's weight: the same values in float32
    ],
)
def test_whatever_the_result_depends_on_is_in_the_key(
    bits: int, options: dict[str, Any], changed: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENCODE_MEMO, str(tmp_path / "memo"))
    (weight, hessian), (other, _) = items = _items()
    encode_linears(items, 2)
    encoded = _refuse_encoding(monkeypatch)
    if changed == "hessian" and hessian is not None:
        items = [(weight, hessian * 2), items[1]]
    elif changed == "dtype":
        items = [items[0], (other.float(), None)]
    elif changed == "matmul precision":
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if precision == "highest" else "highest")
    try:
        encode_linears(items, bits, **options)
    finally:
        if changed == "matmul precision":
            torch.set_float32_matmul_precision(precision)
    assert encoded == ([1] if changed in ("hessian", "dtype") else [2])


def test_a_damaged_entry_is_encoded_again_and_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENCODE_MEMO, str(tmp_path / "memo"))
    items = _items()[:1]
    (first,) = encode_linears(items, 2)
    (entry,) = (tmp_path / "memo").glob("*.safetensors")
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])  # as a killed writer without the rename would have left it
    encoded = _refuse_encoding(monkeypatch)
    (again,) = encode_linears(items, 2)
    assert encoded == [1] and _same(first, again) and entry.read_bytes() == whole


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),  # the temporary file's creation
        SafetensorError("Error while serializing: No space left on device (os error 28)"),  # safetensors' own write
    ],
)
def test_a_full_disk_costs_the_entry_not_the_encode(
    failure: Exception, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo = tmp_path / "memo"
    monkeypatch.setenv(ENCODE_MEMO, str(memo))

    def full(*_args: object, **_kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(memo_module, "save_file", full)
    with pytest.warns(UserWarning, match=r"GLMQUANT_ENCODE_MEMO .*memo: an encode was not kept .*No space left"):
        (result,) = encode_linears(_items()[:1], 2)
    monkeypatch.delenv(ENCODE_MEMO)
    assert _same(result, encode_linears(_items()[:1], 2)[0]) and list(memo.iterdir()) == []


def test_a_memo_that_is_not_a_directory_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(ENCODE_MEMO, str(tmp_path / "file"))
    with pytest.raises(UsageError, match=r"GLMQUANT_ENCODE_MEMO='.*file' must name a directory"):
        check_environment()
    with pytest.raises(UsageError, match=r"GLMQUANT_ENCODE_MEMO"):
        encode_linears(_items()[:1], 2)


def test_the_backend_and_the_machine_are_in_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another Viterbi backend (torch's, where the native kernel is the CPU's default), another CPU or compiler: other
    keys (each encode compared here would take minutes with torch's backend on the CPU)."""
    items = _items()

    def keys(backend: str = "native") -> list[str]:
        search = select_backend("cpu", backend)
        return EncodeMemo(tmp_path, {"bits": 2}, torch.device("cpu"), search).keys(items)

    native = keys()
    assert keys() == native and len(set(native)) == 2
    assert set(keys("torch")).isdisjoint(native)
    monkeypatch.setenv("CXX", "clang++")
    assert set(keys()).isdisjoint(native)
    monkeypatch.delenv("CXX")
    assert keys() == native
    # without $CXX, the g++ found on PATH (another version behind the same name is another compiler)
    other = tmp_path / "bin"
    other.mkdir()
    (other / "g++").symlink_to(shutil.which("true") or "/bin/true")
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{path}")
    assert set(keys()).isdisjoint(native)
    monkeypatch.setenv("PATH", path)
    monkeypatch.setattr(memo_module, "cpu_signature", lambda: "flags : another cpu")
    assert set(keys()).isdisjoint(native)
