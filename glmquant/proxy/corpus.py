"""The trained proxy's corpus: text that Debian and PyPI packages install, gathered by a recipe
(`calibration/proxy-corpus.yaml`) into train / calibration / heldout splits.

Each source globs files under its roots (`stdlib`, `purelib`, absolute paths, or paths relative to the recipe's own
directory, such as catalogs shipped beside it) and turns them into documents by kind: `text` (the file),
`docstrings` (module, class and function docstrings, parsed with `ast`), `pydoc_topics` (the Python reference's
topics in `pydoc_data/topics.py`) or `gettext` (the translated strings of a compiled `.mo` catalog, its language
read from `.../<lang>/LC_MESSAGES/`). Documents longer than `doc_bytes` are cut at line ends. A source keeps its
documents in the order of a hash of (seed, source, path relative to its root, part; a root named as the recipe
writes it) up to its share of `max_bytes`, and the same hash puts each in a split, so the corpus depends only on the
files' contents and relative paths, wherever a recipe-relative root is; exact duplicates are dropped. Held-out text
is never calibration or training text.

The installed files differ between set-ups (site-packages follow the resolved versions), so `build_corpus` also
writes `corpus.lock.json`: every kept document's source, path and SHA-256. Built again with that lock, the corpus
keeps exactly those documents, or names the ones this machine lacks or holds changed.
"""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import json
import struct
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from glmquant.calibration.recipe import Fields, read_yaml
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.errors import UsageError

DEFAULT_CORPUS_RECIPE = Path(__file__).resolve().parents[2] / "calibration" / "proxy-corpus.yaml"
KINDS = ("text", "docstrings", "pydoc_topics", "gettext")
SPLITS = ("train", "calibration", "heldout")
NAMED_ROOTS = ("stdlib", "purelib", "platlib")
FROM_PATH = "from_path"
LOCK_NAME = "corpus.lock.json"


@dataclass(frozen=True)
class CorpusSource:
    name: str
    kind: str
    lang: str  # a language tag, or "from_path" (gettext catalogs)
    roots: tuple[str, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    share: float  # fraction of the recipe's max_bytes


@dataclass(frozen=True)
class CorpusRecipe:
    name: str
    path: str
    seed: int
    max_bytes: int
    doc_bytes: int
    max_file_bytes: int
    calibration: float  # fraction of documents in the calibration split
    heldout: float
    sources: tuple[CorpusSource, ...]

    def scaled(self, max_bytes: int) -> CorpusRecipe:
        """The recipe with another corpus size (the smoke run's is small)."""
        if max_bytes < 1:
            raise UsageError(f"--corpus-bytes must be positive, got {max_bytes}")
        return replace(self, max_bytes=max_bytes)

    def sha256(self) -> str:
        body = asdict(self)
        body.pop("path")
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def load_corpus_recipe(path: str | Path = DEFAULT_CORPUS_RECIPE) -> CorpusRecipe:
    file = Path(path)
    top = Fields(file, "", read_yaml(file))
    splits = Fields(file, "splits", top.get("splits", dict))
    calibration, heldout = (float(splits.get(s, (int, float))) for s in ("calibration", "heldout"))
    splits.done()
    if not all(0 < f < 0.5 for f in (calibration, heldout)):
        raise UsageError(f"{file}: splits: calibration and heldout must each be a fraction in (0, 0.5)")
    sources = tuple(_source(file, f"sources[{i}]", item) for i, item in enumerate(top.get("sources", list)))
    if not sources or len({s.name for s in sources}) != len(sources):
        raise UsageError(f"{file}: sources: at least one, with unique names")
    recipe = CorpusRecipe(
        top.get("name", str),
        str(file.resolve()),
        top.get("seed", int, 0),
        top.positive("max_bytes"),
        top.positive("doc_bytes"),
        top.positive("max_file_bytes"),
        calibration,
        heldout,
        sources,
    )
    top.done()
    return recipe


def _source(file: Path, where: str, data: object) -> CorpusSource:
    f = Fields(file, where, data)

    def strings(key: str, default: list[str] | None = None) -> tuple[str, ...]:
        return tuple(str(x) for x in f.get(key, list, default))

    source = CorpusSource(
        f.get("name", str),
        f.choice("kind", KINDS, "text"),
        f.get("lang", str),
        strings("roots"),
        strings("include"),
        strings("exclude", []),
        float(f.get("share", (int, float))),
    )
    if not 0 < source.share <= 1:
        raise UsageError(f"{file}: {f.key('share')}: must be a fraction in (0, 1], got {source.share}")
    if source.lang == FROM_PATH and source.kind != "gettext":
        raise UsageError(f"{file}: {f.key('lang')}: from_path applies to gettext catalogs only")
    f.done()
    return source


@dataclass(frozen=True)
class Document:
    source: str
    lang: str
    path: str  # "<root>:<path relative to the root>#<part>"
    text: str

    def sha256(self) -> str:
        """The text's digest: what the lock records and what drops exact duplicates."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def resolve_root(root: str, recipe_dir: Path) -> Path:
    """A named root of the running Python (`stdlib`, `purelib`, `platlib`), an absolute path, or a path relative to
    the recipe's directory."""
    return Path(sysconfig.get_paths()[root]) if root in NAMED_ROOTS else recipe_dir / root


def source_files(source: CorpusSource, max_file_bytes: int, recipe_dir: Path) -> Iterator[tuple[str, Path]]:
    """(root label : relative path, file) of every file the source matches, sorted, each once."""
    seen: set[Path] = set()
    for root in source.roots:
        base = resolve_root(root, recipe_dir)
        if not base.is_dir():
            continue
        found = {p for pattern in source.include for p in base.glob(pattern)}
        for path in sorted(found):
            rel = path.relative_to(base)
            if (
                any(fnmatch.fnmatch(rel.as_posix(), x) for x in source.exclude)  # `*` also crosses "/"
                or not path.is_file()
                or path.stat().st_size > max_file_bytes
            ):
                continue
            real = path.resolve()
            if real not in seen:
                seen.add(real)
                yield f"{root}:{rel.as_posix()}", path


def file_texts(source: CorpusSource, path: Path) -> list[tuple[str, str]]:
    """(language, text) pieces of one file by the source's kind; [] for files that cannot be read as such."""
    try:
        if source.kind == "gettext":
            lang = _catalog_language(path) if source.lang == FROM_PATH else source.lang
            return [(lang, "\n".join(_mo_messages(path.read_bytes())))] if lang else []
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError, struct.error):
        return []
    if source.kind == "text":
        return [(source.lang, text)]
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    if source.kind == "docstrings":
        docs = [
            ast.get_docstring(node)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        return [(source.lang, "\n\n".join(d for d in docs if d and len(d) > 40))]
    return [(source.lang, topic) for topic in _pydoc_topics(tree)]


def _catalog_language(path: Path) -> str | None:
    parts = path.parts
    return parts[-3] if len(parts) >= 3 and parts[-2] == "LC_MESSAGES" else None


def _mo_messages(data: bytes) -> list[str]:
    """The translated strings of a GNU .mo catalog (plural forms included; the header entry skipped)."""
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        raise ValueError("not a .mo catalog")
    count, _, translations = struct.unpack(f"{order}III", data[8:20])
    out = []
    for i in range(count):
        length, offset = struct.unpack(f"{order}II", data[translations + 8 * i : translations + 8 * i + 8])
        for text in data[offset : offset + length].decode("utf-8").split("\x00"):
            if text.strip() and not text.startswith("Project-Id-Version"):
                out.append(text.strip())
    return out


def _pydoc_topics(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [topics[k] for k in sorted(topics)]
    return []


def cut(text: str, size: int) -> list[str]:
    """`text` in parts of about `size` characters, cut at line ends."""
    parts, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            parts.append("".join(current))
            current, length = [], 0
    if current:
        parts.append("".join(current))
    return [p for p in (p.strip() for p in parts) if p]


def _rank(seed: int, *labels: str) -> int:
    digest = hashlib.sha256("\x1f".join([str(seed), *labels]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def split_of(recipe: CorpusRecipe, doc: Document) -> str:
    """A document's split, from a hash of its identity (independent of which other documents exist)."""
    u = _rank(recipe.seed, "split", doc.source, doc.path) / 2**64
    return "heldout" if u < recipe.heldout else "calibration" if u < recipe.heldout + recipe.calibration else "train"


@dataclass(frozen=True)
class CorpusLock:
    """The documents an earlier build kept, by source: (path, SHA-256 of the text) in the order it kept them."""

    path: Path
    recipe_sha256: str
    documents: dict[str, list[tuple[str, str]]]


def read_corpus_lock(path: Path, recipe: CorpusRecipe) -> CorpusLock:
    """A `corpus.lock.json`, refused (naming the file) when unreadable or made for another recipe or size."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        lock = CorpusLock(
            path,
            str(data["recipe_sha256"]),
            {str(name): [(str(p), str(h)) for p, h in docs] for name, docs in data["documents"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path}: not a corpus lock ({type(exc).__name__}: {exc})") from exc
    if lock.recipe_sha256 != recipe.sha256():
        raise UsageError(
            f"{path}: locks the corpus of recipe {lock.recipe_sha256[:12]}, not this run's {recipe.sha256()[:12]} "
            f"({recipe.path} at {recipe.max_bytes} bytes): another recipe file or --corpus-bytes"
        )
    if set(lock.documents) != {s.name for s in recipe.sources}:
        raise UsageError(f"{path}: its sources {sorted(lock.documents)} are not the recipe's")
    return lock


def _locked(lock: CorpusLock, source: CorpusSource, candidates: list[tuple[int, Document]]) -> list[Document]:
    """The documents `lock` names for `source`, in its order; refused, naming them, where any is missing or differs."""
    by_path = {doc.path: doc for _, doc in candidates}
    kept, missing, changed = [], [], []
    for path, digest in lock.documents[source.name]:
        doc = by_path.get(path)
        if doc is None:
            missing.append(path)
        elif doc.sha256() != digest:
            changed.append(path)
        else:
            kept.append(doc)
    if missing or changed:
        named = "; ".join(
            f"{len(paths)} {what}: {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}"
            for what, paths in (("not found", missing), ("with other text", changed))
            if paths
        )
        raise UsageError(
            f"{lock.path}: source {source.name!r}: of {len(lock.documents[source.name])} locked documents, {named} "
            "(this machine's files differ from the set-up that made the lock: another version installed?)"
        )
    return kept


def _within(candidates: list[tuple[int, Document]], budget: int) -> list[Document]:
    """The ranked documents that fit the byte budget, in rank order (one that does not fit is skipped)."""
    kept, used = [], 0
    for _, doc in candidates:
        size = len(doc.text.encode())
        if used + size <= budget:
            kept.append(doc)
            used += size
    return kept


def source_documents(
    recipe: CorpusRecipe, source: CorpusSource, lock: CorpusLock | None = None
) -> tuple[list[Document], dict[str, Any]]:
    """The documents a source contributes (ranked by hash, up to its byte share; or exactly those `lock` names) and a
    summary of what it found."""
    candidates: list[tuple[int, Document]] = []
    files = 0
    recipe_dir = Path(recipe.path).parent
    for label, path in source_files(source, recipe.max_file_bytes, recipe_dir):
        files += 1
        for piece, (lang, text) in enumerate(file_texts(source, path)):
            for part, chunk in enumerate(cut(text, recipe.doc_bytes)):
                doc = Document(source.name, lang, f"{label}#{piece}.{part}", chunk)
                candidates.append((_rank(recipe.seed, "keep", source.name, doc.path), doc))
    candidates.sort(key=lambda c: c[0])
    budget = int(recipe.max_bytes * source.share)
    kept = _locked(lock, source, candidates) if lock is not None else _within(candidates, budget)
    used = sum(len(doc.text.encode()) for doc in kept)
    summary = {
        "files": files,
        "documents_found": len(candidates),
        "documents": len(kept),
        "bytes": used,
        "budget_bytes": budget,
        "roots": {r: str(resolve_root(r, recipe_dir)) for r in source.roots},
    }
    return kept, summary


def build_corpus(recipe: CorpusRecipe, out_dir: Path, lock: CorpusLock | None = None) -> dict[str, Any]:
    """Write `train.jsonl`, `calibration.jsonl`, `heldout.jsonl` ({text, source, lang, path} per line),
    `corpus.json` (what every source found and kept, bytes per split and language, each split's SHA-256) and
    `corpus.lock.json` (the kept documents); with `lock`, keep exactly the documents it names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    by_split: dict[str, list[Document]] = {s: [] for s in SPLITS}
    sources = {}
    locked: dict[str, list[tuple[str, str]]] = {}
    for source in recipe.sources:
        docs, sources[source.name] = source_documents(recipe, source, lock)
        locked[source.name] = []
        for doc in docs:
            digest = doc.sha256()
            locked[source.name].append((doc.path, digest))
            if digest not in seen:
                seen.add(digest)
                by_split[split_of(recipe, doc)].append(doc)
    splits = {}
    for split, docs in by_split.items():
        path = out_dir / f"{split}.jsonl"
        body = "".join(json.dumps(asdict(d), ensure_ascii=False) + "\n" for d in docs).encode()
        path.write_bytes(body)
        langs: dict[str, int] = {}
        for d in docs:
            langs[d.lang] = langs.get(d.lang, 0) + len(d.text.encode())
        splits[split] = {
            "documents": len(docs),
            "bytes": sum(langs.values()),
            "sha256": hashlib.sha256(body).hexdigest(),
            "bytes_by_lang": dict(sorted(langs.items(), key=lambda kv: -kv[1])),
        }
    summary = {
        "recipe": recipe.path,
        "recipe_sha256": recipe.sha256(),
        "max_bytes": recipe.max_bytes,
        "sources": sources,
        "splits": splits,
        "languages": sorted({d.lang for docs in by_split.values() for d in docs}),
        "locked_by": None if lock is None else str(lock.path),
    }
    atomic_write_text(out_dir / LOCK_NAME, _lock_text(recipe.sha256(), locked))
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def _lock_text(recipe_sha256: str, documents: dict[str, list[tuple[str, str]]]) -> str:
    """The lock as JSON with one document per line (readable diffs between two set-ups' locks)."""
    sources = ",\n".join(
        f"{json.dumps(name)}: [\n" + ",\n".join(f"  {json.dumps(list(d), ensure_ascii=False)}" for d in docs) + "\n]"
        for name, docs in documents.items()
    )
    return f'{{"recipe_sha256": {json.dumps(recipe_sha256)},\n"documents": {{\n{sources}\n}}}}\n'


def read_split(out_dir: Path, split: str) -> list[str]:
    """The texts of one split written by `build_corpus`."""
    lines = (out_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line]


def split_recipe(out_dir: Path, split: str, rows: int, tokens: int, recipe_dir: Path | None = None) -> Path:
    """A calibration recipe (calibration/README.md) of one lane packed from a split; written next to it (the corpus
    moves with it), or into `recipe_dir`, naming the split by its absolute path."""
    path = (recipe_dir or out_dir) / f"{split}.yaml"
    data = f"{split}.jsonl" if recipe_dir is None else str((out_dir / f"{split}.jsonl").resolve())
    recipe = {
        "name": f"proxy-{split}",
        "seed": 0,
        "sources": {split: {"kind": "jsonl", "path": data}},
        "lanes": [
            {
                "name": split,
                "rows": rows,
                "tokens": tokens,
                "use": ["hessians", "reap"],
                "mix": [{"source": split, "weight": 1}],
            }
        ],
    }
    atomic_write_text(path, json.dumps(recipe, indent=2) + "\n")
    return path
