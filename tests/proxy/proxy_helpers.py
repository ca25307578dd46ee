"""A small corpus recipe over a few standard-library modules and a hand-made translation catalog, and the
smoke-size training options, shared by the proxy tests."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from glmquant.proxy import train
from glmquant.proxy.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
# the rows the CPU benchmark measures, in its canonical order (each a real encode: the CPU's Viterbi is slow, so a few;
# the composed test measures uniform K3 and the untuned depth tiers from its stocks)
SMOKE_ROWS = ("seed", "depth-tiers-tuned", "blend-0.5", "retained-layer-cost-head5", "prune25-k3")

# the script's CPU smoke proxy with a smaller vocabulary and indexer window, for test speed
SMOKE_SHAPE = replace(train.SMOKE_SHAPE, vocab_size=400, index_topk=8)
SMOKE_COST_BITS = (2, 4)  # the K the smoke's retained-layer-cost row measures (uniform K4's bytes its budget)


def write_mo(path: Path, messages: dict[str, str]) -> Path:
    """A GNU .mo catalog (little-endian) of `messages` (original -> translation)."""
    keys = sorted(messages)
    ids = b"".join(k.encode() + b"\0" for k in keys)
    strs = b"".join(messages[k].encode() + b"\0" for k in keys)
    n = len(keys)
    start = 28 + 16 * n
    offsets, pos = [], start
    for k in keys:
        offsets.append((len(k.encode()), pos))
        pos += len(k.encode()) + 1
    trans, pos = [], start + len(ids)
    for k in keys:
        trans.append((len(messages[k].encode()), pos))
        pos += len(messages[k].encode()) + 1
    header = struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0)
    body = b"".join(struct.pack("<II", *o) for o in offsets) + b"".join(struct.pack("<II", *t) for t in trans)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + body + ids + strs)
    return path


def small_corpus_recipe(tmp: Path) -> Path:
    """A recipe over json/, email/ and the Python reference topics of the standard library, plus German and
    Polish catalogs under `tmp`/locale."""
    sentences = {
        "de": ["Die Datei wurde nicht gefunden.", "Zugriff verweigert: {name}", "Ungültige Option"],
        "pl": ["Nie znaleziono pliku.", "Odmowa dostępu: {name}", "Nieprawidłowa opcja"],
    }
    for lang, texts in sentences.items():
        for i in range(30):
            write_mo(
                tmp / "locale" / lang / "LC_MESSAGES" / f"tool{i}.mo",
                {f"msg{j}": f"{t} ({i}.{j})" for j, t in enumerate(texts * 8)},
            )
    recipe = {
        "name": "test-corpus",
        "seed": 0,
        "max_bytes": 1_200_000,
        "doc_bytes": 3000,
        "max_file_bytes": 400_000,
        "splits": {"calibration": 0.1, "heldout": 0.1},
        "sources": [
            {
                "name": "code",
                "kind": "text",
                "lang": "python",
                "roots": ["stdlib"],
                "include": ["json/*.py", "email/*.py"],
                "exclude": ["email/_header*"],
                "share": 0.5,
            },
            {
                "name": "docs",
                "kind": "docstrings",
                "lang": "en",
                "roots": ["stdlib"],
                "include": ["collections/*.py"],
                "share": 0.2,
            },
            {
                "name": "reference",
                "kind": "pydoc_topics",
                "lang": "en",
                "roots": ["stdlib"],
                "include": ["pydoc_data/topics.py"],
                "share": 0.2,
            },
            {
                "name": "translations",
                "kind": "gettext",
                "lang": "from_path",
                "roots": ["locale"],  # beside the recipe: the same corpus wherever `tmp` is
                "include": ["**/*.mo"],
                "share": 0.1,
            },
        ],
    }
    path = tmp / "corpus.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def smoke_config(out: Path, recipe: Path, **changes: Any) -> TrainConfig:
    options: dict[str, Any] = dict(
        shape=SMOKE_SHAPE,
        corpus_recipe=recipe,
        device="cpu",
        steps=3,
        batch_rows=2,
        seq_len=32,
        warmup_steps=1,
        heldout_rows=2,
        calibration_rows=2,
        log_every=1,
    )
    return TrainConfig(out=out, **{**options, **changes})


@dataclass(frozen=True)
class BenchRun:
    """A finished CPU run of scripts/bench_fidelity.py: its command, environment, results file and work directory
    (which keeps every row's artifact as artifact-RECIPE)."""

    argv: list[str]
    env: dict[str, str]
    results: Path
    work: Path


def run_bench(proxy: Path, tmp: Path, recipes: Sequence[str] = SMOKE_ROWS, *options: str) -> BenchRun:
    """scripts/bench_fidelity.py over `recipes` on the CPU (exllamav3 layout, a few calibration and held-out rows,
    two worker processes), artifacts kept; `options` added to its command."""
    results, work = tmp / "fidelity.json", tmp / "work"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_fidelity.py"), "--proxy", str(proxy), "--device", "cpu"]
    argv += ["--layout", "exllamav3", "--rows", "4", "--tokens", "32", "--batch-rows", "2", "--heldout-rows", "2"]
    argv += [
        "--heldout-tokens",
        "32",
        "--work",
        str(work),
        "--results",
        str(results),
        "--recipes",
        ",".join(recipes),
        *options,
    ]
    argv += ["--mtp-prompts", "2", "--mtp-new-tokens", "5", "--keep-artifacts"]
    argv += ["--estimate-experts", "1"]  # layer-cost-estimated's K1-K4 encodes: one expert per layer, not 8
    argv += ["--retained-cost-bits", ",".join(map(str, SMOKE_COST_BITS))]  # 3 fewer encodes of each retained linear
    argv += ["--jobs", "2"]  # two worker processes: rows finish out of order, the file keeps the canonical one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return BenchRun(argv, env, results, work)
