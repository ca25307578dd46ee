"""The proxy corpus: documents of every kind, disjoint splits chosen by hash, the same corpus from the same files,
and a tokenizer trained on it that round-trips any text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from proxy_helpers import write_mo

from glmquant.calibration import load_recipe
from glmquant.calibration.build import build_token_rows, tokenizer_sha256
from glmquant.errors import UsageError
from glmquant.proxy.corpus import (
    LOCK_NAME,
    build_corpus,
    cut,
    load_corpus_recipe,
    read_corpus_lock,
    read_split,
    split_recipe,
)
from glmquant.proxy.tokenizer import train_tokenizer
from glmquant.proxy.train import split_rows


def test_corpus_splits_are_disjoint_and_reproducible(corpus_recipe: Path, tmp_path: Path) -> None:
    recipe = load_corpus_recipe(corpus_recipe)
    first = build_corpus(recipe, tmp_path / "a")
    second = build_corpus(recipe, tmp_path / "b")
    assert {s: v["sha256"] for s, v in first["splits"].items()} == {s: v["sha256"] for s, v in second["splits"].items()}
    paths = {
        s: {json.loads(line)["path"] for line in (tmp_path / "a" / f"{s}.jsonl").read_text().splitlines()}
        for s in ("train", "calibration", "heldout")
    }
    assert (
        all(paths.values())
        and not (paths["train"] & paths["heldout"])
        and not (paths["calibration"] & paths["heldout"])
    )
    assert {"python", "en", "de", "pl"} <= set(first["languages"])
    assert first["sources"]["code"]["files"] > 0 and not any("_header" in p for p in paths["train"])
    sizes = {name: s["bytes"] for name, s in first["sources"].items()}
    assert all(sizes[n] <= first["sources"][n]["budget_bytes"] for n in sizes)
    # the recipe and its catalogs (a root beside it) moved elsewhere: the same corpus, split for split
    moved = shutil.copytree(corpus_recipe.parent, tmp_path / "elsewhere" / "recipe")
    third = build_corpus(load_corpus_recipe(moved / corpus_recipe.name), tmp_path / "c")
    assert third["sources"]["translations"]["roots"] == {"locale": str(moved / "locale")}
    assert {s: v["sha256"] for s, v in third["splits"].items()} == {s: v["sha256"] for s, v in first["splits"].items()}


def test_a_corpus_lock_keeps_its_documents_or_names_those_missing(corpus_recipe: Path, tmp_path: Path) -> None:
    """Another set-up's files (here: catalogs added, one rewritten, one removed) change the corpus built from the
    recipe; built with the first build's lock it is the first corpus, or an error naming the documents that differ."""
    here = shutil.copytree(corpus_recipe.parent, tmp_path / "recipe")
    recipe = load_corpus_recipe(here / corpus_recipe.name)
    first = build_corpus(recipe, tmp_path / "first")
    lock = read_corpus_lock(tmp_path / "first" / LOCK_NAME, recipe)
    assert first["locked_by"] is None and sum(len(d) for d in lock.documents.values()) == sum(
        s["documents"] for s in first["sources"].values()
    )
    shas = {s: v["sha256"] for s, v in first["splits"].items()}
    for i in range(30):  # a set-up with more catalogs installed
        write_mo(here / "locale" / "de" / "LC_MESSAGES" / f"extra{i}.mo", {"m": f"Noch eine Meldung {i}"})
    unlocked = build_corpus(recipe, tmp_path / "unlocked")
    assert {s: v["sha256"] for s, v in unlocked["splits"].items()} != shas
    locked = build_corpus(recipe, tmp_path / "locked", lock)
    assert {s: v["sha256"] for s, v in locked["splits"].items()} == shas
    assert locked["locked_by"] == str(lock.path)
    assert (tmp_path / "locked" / LOCK_NAME).read_bytes() == (tmp_path / "first" / LOCK_NAME).read_bytes()
    catalogs = [p for p, _ in lock.documents["translations"]]
    rewritten = here / "locale" / "de" / "LC_MESSAGES" / "tool0.mo"
    assert any(p.startswith("locale:de/LC_MESSAGES/tool0.mo#") for p in catalogs)
    write_mo(rewritten, {"m": "Eine andere Meldung"})
    with pytest.raises(UsageError, match=r"'translations'.* with other text: locale:de/LC_MESSAGES/tool0\.mo#"):
        build_corpus(recipe, tmp_path / "rewritten", lock)
    rewritten.unlink()
    with pytest.raises(UsageError, match=r"not found: locale:de/LC_MESSAGES/tool0\.mo#"):
        build_corpus(recipe, tmp_path / "removed", lock)
    with pytest.raises(UsageError, match=r"locks the corpus of recipe .* another recipe file or --corpus-bytes"):
        read_corpus_lock(tmp_path / "first" / LOCK_NAME, recipe.scaled(recipe.max_bytes // 2))
    (tmp_path / "torn.json").write_text('{"recipe_sha256": "')
    with pytest.raises(UsageError, match=r"torn\.json: not a corpus lock"):
        read_corpus_lock(tmp_path / "torn.json", recipe)


def test_gettext_catalogs_give_their_translations(tmp_path: Path) -> None:
    write_mo(tmp_path / "loc" / "fr" / "LC_MESSAGES" / "x.mo", {"a": "Fichier introuvable", "b": "Accès refusé"})
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        json.dumps(
            {
                "name": "t",
                "max_bytes": 10_000,
                "doc_bytes": 100,
                "max_file_bytes": 10_000,
                "splits": {"calibration": 0.2, "heldout": 0.2},
                "sources": [
                    {
                        "name": "tr",
                        "kind": "gettext",
                        "lang": "from_path",
                        "roots": [str(tmp_path / "loc")],
                        "include": ["**/*.mo"],
                        "share": 1.0,
                    }
                ],
            }
        )
    )
    summary = build_corpus(load_corpus_recipe(recipe_file), tmp_path / "out")
    texts = [t for s in ("train", "calibration", "heldout") for t in read_split(tmp_path / "out", s)]
    assert summary["languages"] == ["fr"] and texts == ["Fichier introuvable\nAccès refusé"]


def test_recipe_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        json.dumps(
            {
                "name": "t",
                "max_bytes": 1,
                "doc_bytes": 1,
                "max_file_bytes": 1,
                "splits": {"calibration": 0.1, "heldout": 0.1},
                "sources": [
                    {"name": "x", "kind": "text", "lang": "from_path", "roots": ["/"], "include": ["*"], "share": 0.5}
                ],
            }
        )
    )
    with pytest.raises(UsageError, match=r"sources\[0\]\.lang: from_path applies to gettext"):
        load_corpus_recipe(bad)


def test_cut_keeps_whole_lines() -> None:
    text = "".join(f"line {i}\n" for i in range(100))
    parts = cut(text, 50)
    assert "\n".join(parts) == text.strip() and all(len(p) < 60 for p in parts)


def test_tokenizer_is_reproducible_and_round_trips(corpus_recipe: Path, tmp_path: Path) -> None:
    build_corpus(load_corpus_recipe(corpus_recipe), tmp_path)
    texts = read_split(tmp_path, "train")
    tok = train_tokenizer(texts, 400)
    assert tokenizer_sha256(tok) == tokenizer_sha256(train_tokenizer(texts, 400)) and len(tok) == 400
    sample = "Zugriff verweigert — 你好, مرحبا\n    return x"
    assert tok.decode(tok(sample)["input_ids"]) == sample
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0 and tok.chat_template


def test_split_rows_only_read_the_corpus(corpus_recipe: Path, tmp_path: Path) -> None:
    """A split's packed rows come from a recipe in a temporary directory: the corpus directory (with the proxy's own
    calibration.yaml) is left as it was, and the rows equal those of the recipe written beside the split."""
    corpus = tmp_path / "corpus"
    build_corpus(load_corpus_recipe(corpus_recipe), corpus)
    tok = train_tokenizer(read_split(corpus, "train"), 400)
    published = split_recipe(corpus, "calibration", 3, 32)
    before = {p.name: p.read_bytes() for p in corpus.iterdir()}
    rows = split_rows(corpus, "calibration", 2, 16, tok)
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == before  # calibration.yaml still the 3 x 32 one
    assert rows.shape == (2, 16)
    beside = build_token_rows(load_recipe(split_recipe(corpus, "calibration", 2, 16)), tok).lanes[0].ids.long()
    assert torch.equal(rows, beside) and published.is_file()
