"""Calibration recipes: YAML files naming text sources and the lanes of token rows built from them.

Schema (calibration/README.md has the long form):

    name: str                      seed: int (default 0)
    sources:                       # name -> one source
      <name>: {kind: text|jsonl|parquet|hf|random, ...kind options...}
    lanes:                         # each lane: rows x tokens packed from a weighted mixture of sources
      - {name: str, rows: int, tokens: int, use: [hessians, reap], mix: [{source: <name>, weight: float}]}

Every problem is reported as `<file>: <key path>: <what is wrong>`. Relative paths resolve against the
recipe's own directory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from glmquant.errors import UsageError

SOURCE_KINDS = ("text", "jsonl", "parquet", "hf", "random")
USES = ("hessians", "reap")
_REQUIRED = object()


@dataclass(frozen=True)
class SourceSpec:
    name: str
    kind: str
    path: str | None = None  # text/jsonl/parquet file, absolute once resolved
    dataset: str | None = None  # hf: dataset name (or a builder such as "json" with data_files)
    subset: str | None = None  # hf: configuration name
    split: str = "train"
    data_files: tuple[str, ...] = ()
    field: str = "text"  # jsonl/parquet/hf: the column holding the text, the messages, or the prompt
    format: str = "text"  # "text", or "chat": rendered with the model's chat template
    response_field: str | None = None  # chat: `field` is the user prompt, this the assistant answer
    separator: str = "\n\n"  # text files: what separates documents ("" = the whole file is one)
    shuffle_buffer: int = 10_000  # hf streaming shuffle buffer


@dataclass(frozen=True)
class MixEntry:
    source: str
    weight: float


@dataclass(frozen=True)
class Lane:
    name: str
    rows: int
    tokens: int
    use: tuple[str, ...]
    mix: tuple[MixEntry, ...]


@dataclass(frozen=True)
class Recipe:
    name: str
    path: str
    seed: int
    sources: Mapping[str, SourceSpec]
    lanes: tuple[Lane, ...]

    def with_shape(self, rows: int | None = None, tokens: int | None = None) -> Recipe:
        """The recipe with every lane's rows and/or tokens per row overridden (CLI --rows / --tokens)."""
        for flag, value in (("--rows", rows), ("--tokens", tokens)):
            if value is not None and value < 1:
                raise UsageError(f"{flag} must be a positive integer, got {value}")
        lanes = tuple(replace(lane, rows=rows or lane.rows, tokens=tokens or lane.tokens) for lane in self.lanes)
        return replace(self, lanes=lanes)

    def describe(self) -> dict[str, Any]:
        """A JSON-able form (recorded in token_rows.json and hashed)."""
        out = asdict(self)
        out["sources"] = {k: asdict(v) for k, v in sorted(self.sources.items())}
        return out

    def sha256(self, data_hashes: Mapping[str, str]) -> str:
        """Hash of the resolved recipe plus the content of its local data files (not of its location)."""
        body = self.describe()
        body.pop("path")
        for src in body["sources"].values():
            src["path"] = data_hashes.get(src["name"]) if src["path"] else None
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Fields:
    """Typed access to one mapping of a YAML file, with errors naming the file and the key path."""

    def __init__(self, file: Path, where: str, data: object) -> None:
        if not isinstance(data, dict):
            raise UsageError(f"{file}: {where or 'top level'}: expected a mapping, got {type(data).__name__}")
        self.file, self.where, self.data = file, where, data
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        self.used.add(name)
        if name not in self.data or self.data[name] is None:
            if default is _REQUIRED:
                raise UsageError(f"{self.file}: {self.key(name)}: required key is missing")
            return default
        value = self.data[name]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise UsageError(f"{self.file}: {self.key(name)}: expected {expected}, got {value!r}")
        return value

    def positive(self, name: str, default: Any = _REQUIRED) -> int:
        value = self.get(name, int, default)
        if value < 1:
            raise UsageError(f"{self.file}: {self.key(name)}: must be a positive integer, got {value}")
        return value

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        value = self.get(name, str, default)
        if value not in options:
            raise UsageError(f"{self.file}: {self.key(name)}: must be one of {', '.join(options)}; got {value!r}")
        return value

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise UsageError(f"{self.file}: {self.key(extra[0])}: unknown key")


def read_yaml(file: Path) -> object:
    """A recipe file's parsed YAML; unreadable or invalid files are a UsageError naming the file."""
    try:
        return yaml.safe_load(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"{file}: cannot read recipe ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{file}: not valid YAML ({exc})") from None


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe file."""
    file = Path(path)
    top = Fields(file, "", read_yaml(file))
    name, seed = top.get("name", str), top.get("seed", int, 0)
    sources_raw = Fields(file, "sources", top.get("sources", dict))
    sources = {key: _source(file, key, sources_raw.get(key, dict)) for key in sources_raw.data}
    lanes_raw = top.get("lanes", list)
    if not lanes_raw:
        raise UsageError(f"{file}: lanes: at least one lane is needed")
    lanes = tuple(_lane(file, f"lanes[{i}]", item, sources) for i, item in enumerate(lanes_raw))
    if len({lane.name for lane in lanes}) != len(lanes):
        raise UsageError(f"{file}: lanes: lane names must be unique")
    top.done()
    return Recipe(name, str(file.resolve()), seed, sources, lanes)


def _source(file: Path, name: str, data: object) -> SourceSpec:
    f = Fields(file, f"sources.{name}", data)
    kind = f.choice("kind", SOURCE_KINDS, "text")
    path = f.get("path", str, None)
    if kind in ("text", "jsonl", "parquet"):
        if path is None:
            raise UsageError(f"{file}: {f.key('path')}: required for kind {kind}")
        path = str((file.parent / path).resolve())
    dataset = f.get("dataset", str, None)
    if kind == "hf" and dataset is None:
        raise UsageError(f"{file}: {f.key('dataset')}: required for kind hf")
    spec = SourceSpec(
        name,
        kind,
        path,
        dataset,
        f.get("subset", str, None),
        f.get("split", str, "train"),
        tuple(f.get("data_files", list, [])),
        f.get("field", str, "text"),
        f.choice("format", ("text", "chat"), "text"),
        f.get("response_field", str, None),
        f.get("separator", str, "\n\n"),
        f.positive("shuffle_buffer", 10_000),
    )
    if spec.response_field and spec.format != "chat":
        raise UsageError(f"{file}: {f.key('response_field')}: only meaningful with format: chat")
    f.done()
    return spec


def _lane(file: Path, where: str, data: object, sources: Mapping[str, SourceSpec]) -> Lane:
    f = Fields(file, where, data)
    use = tuple(f.get("use", list, list(USES)))
    if not use or set(use) - set(USES):
        raise UsageError(f"{file}: {f.key('use')}: must list some of {', '.join(USES)}; got {list(use)}")
    mix = []
    for i, item in enumerate(f.get("mix", list)):
        m = Fields(file, f"{f.key('mix')}[{i}]", item)
        source, weight = m.get("source", str), float(m.get("weight", (int, float), 1))
        if source not in sources:
            raise UsageError(f"{file}: {m.key('source')}: no source named {source!r} under sources")
        if weight <= 0:
            raise UsageError(f"{file}: {m.key('weight')}: must be positive, got {weight}")
        m.done()
        mix.append(MixEntry(source, weight))
    if not mix:
        raise UsageError(f"{file}: {f.key('mix')}: a lane needs at least one source")
    lane = Lane(f.get("name", str), f.positive("rows"), f.positive("tokens"), use, tuple(mix))
    f.done()
    return lane
