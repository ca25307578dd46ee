"""Token rows: deterministic packing of mixed sources, chat rendering, SHA-256, save/load, reuse."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from glmquant.calibration import TokenRows, build_token_rows, load_recipe, reuse_or_build
from glmquant.calibration.build import split_rows
from glmquant.errors import UsageError

RECIPES = Path(__file__).resolve().parents[2] / "calibration"


@pytest.fixture(scope="module")
def tokenizer(tiny_source: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_source))


def test_split_rows_sums_exactly() -> None:
    assert split_rows(16, [3, 3, 3, 2, 4, 1]) == [3, 3, 3, 2, 4, 1]
    assert split_rows(7, [1, 1, 1]) == [3, 2, 2]
    assert sum(split_rows(600, [4, 3, 3, 2, 3, 2, 0.5, 0.5, 0.25])) == 600


def test_default_recipe_rows(tokenizer) -> None:
    recipe = load_recipe(RECIPES / "default.yaml")
    rows = build_token_rows(recipe, tokenizer)
    (lane,) = rows.lanes
    assert lane.ids.shape == (16, 128) and lane.ids.dtype == torch.int32
    assert sorted(set(lane.row_sources)) == ["chat", "code", "math", "multilingual", "prose", "random"]
    assert lane.row_sources.count("chat") == 4
    text = "".join(tokenizer.decode(r.tolist()) for r, s in zip(lane.ids, lane.row_sources) if s == "chat")
    assert "<|user|>" in text and "<|assistant|>" in text  # rendered with the model's chat template
    random_row = lane.ids[lane.row_sources.index("random")]
    assert not set(random_row.tolist()) & set(tokenizer.all_special_ids)
    again = build_token_rows(recipe, tokenizer)
    assert again.sha256 == rows.sha256 and torch.equal(again.lanes[0].ids, lane.ids)
    reseeded = build_token_rows(replace(recipe, seed=1), tokenizer)
    assert reseeded.sha256 != rows.sha256


def test_sha256_is_of_the_int32_bytes(tokenizer, tmp_path: Path) -> None:
    import hashlib

    rows = build_token_rows(load_recipe(RECIPES / "default.yaml").with_shape(rows=3, tokens=10), tokenizer)
    ids = rows.lanes[0].ids
    assert rows.sha256 == hashlib.sha256(ids.numpy().astype("<i4").tobytes()).hexdigest()
    rows.save(tmp_path)
    info = json.loads((tmp_path / "token_rows.json").read_text())
    assert info["token_rows_sha256"] == rows.sha256 and info["lanes"][0]["rows"] == 3
    assert info["sources"]["prose"]["sha256"] and info["tokenizer_sha256"]
    loaded = TokenRows.load(tmp_path)
    assert torch.equal(loaded.lanes[0].ids, ids) and loaded.recipe_sha256 == rows.recipe_sha256


def test_tampered_rows_are_refused(tokenizer, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    build_token_rows(load_recipe(RECIPES / "default.yaml").with_shape(rows=2, tokens=8), tokenizer).save(tmp_path)
    save_file({"lane.mix": torch.zeros(2, 8, dtype=torch.int32)}, str(tmp_path / "token_rows.safetensors"))
    with pytest.raises(UsageError, match="do not match the SHA-256"):
        TokenRows.load(tmp_path)


def test_saved_rows_are_reused_only_for_the_same_recipe(
    tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from glmquant.calibration import build

    recipe = load_recipe(RECIPES / "default.yaml").with_shape(rows=2, tokens=8)
    first = reuse_or_build(recipe, tokenizer, tmp_path)
    assert not (tmp_path / "token_rows.json").exists()  # building never writes: the caller saves
    first.save(tmp_path)
    monkeypatch.setattr(build, "build_token_rows", lambda *a: pytest.fail("saved rows should be reused"))
    assert reuse_or_build(recipe, tokenizer, tmp_path).sha256 == first.sha256
    monkeypatch.undo()
    assert reuse_or_build(recipe.with_shape(tokens=9), tokenizer, tmp_path).lanes[0].ids.shape == (2, 9)


def _write_recipe(tmp_path: Path, sources: str, mix: str, rows: int = 4, tokens: int = 16) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        f"name: t\nsources:\n{sources}\nlanes:\n  - {{name: l, rows: {rows}, tokens: {tokens}, mix: [{mix}]}}\n"
    )
    return path


def test_local_jsonl_parquet_and_hf_json(tokenizer, tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="hf sources stream through the datasets package")
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"q": f"question {i}", "a": f"answer {i}"}) for i in range(5)) + "\n"
    )
    pq.write_table(pa.table({"body": [f"parquet document {i} " * 3 for i in range(5)]}), tmp_path / "b.parquet")
    (tmp_path / "c.json").write_text("\n".join(json.dumps({"text": f"hf streamed {i} " * 4}) for i in range(5)))
    sources = (
        "  pairs: {kind: jsonl, path: a.jsonl, field: q, response_field: a, format: chat}\n"
        "  table: {kind: parquet, path: b.parquet, field: body}\n"
        "  hub: {kind: hf, dataset: json, data_files: [c.json], field: text}"
    )
    path = _write_recipe(
        tmp_path,
        sources.replace("[c.json]", f"[{tmp_path / 'c.json'}]"),
        "{source: pairs}, {source: table}, {source: hub}",
        rows=3,
        tokens=64,
    )
    rows = build_token_rows(load_recipe(path), tokenizer)
    lane = rows.lanes[0]
    decoded = {s: tokenizer.decode(r.tolist()) for r, s in zip(lane.ids, lane.row_sources)}
    assert "<|assistant|>" in decoded["pairs"] and "answer" in decoded["pairs"]
    assert "parquet document" in decoded["table"] and "hf streamed" in decoded["hub"]


def test_short_sources_cycle_and_empty_ones_fail(tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("abc\n\ndef")
    path = _write_recipe(tmp_path, "  t: {kind: text, path: tiny.txt}", "{source: t}", rows=2, tokens=32)
    rows = build_token_rows(load_recipe(path), tokenizer)
    assert rows.sources["t"]["epochs"] > 1 and rows.lanes[0].ids.shape == (2, 32)
    (tmp_path / "tiny.txt").write_text("\n\n")
    with pytest.raises(UsageError, match="source t: produced no text"):
        build_token_rows(load_recipe(path), tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    bad = _write_recipe(tmp_path, "  j: {kind: jsonl, path: bad.jsonl}", "{source: j}")
    with pytest.raises(UsageError, match="has no field 'text'"):
        build_token_rows(load_recipe(bad), tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"text": "unterminated\n')
    with pytest.raises(UsageError, match="bad.jsonl: not valid jsonl"):
        build_token_rows(load_recipe(bad), tokenizer)


def test_unreachable_hub_dataset_is_a_usage_error(tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets", reason="hf sources stream through the datasets package")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'glmquant-test/no-such-dataset' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    path = _write_recipe(tmp_path, "  w: {kind: hf, dataset: glmquant-test/no-such-dataset}", "{source: w}")
    with pytest.raises(UsageError, match="cannot stream Hugging Face dataset 'glmquant-test/no-such-dataset'"):
        build_token_rows(load_recipe(path), tokenizer)
