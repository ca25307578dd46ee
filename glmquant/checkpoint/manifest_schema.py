"""What a well-formed EXL3_MANIFEST.json (schema_version 2) must satisfy on its own, without opening other files:
field types, per-kind file fields, sorted unique paths inside the artifact, totals equal to their parts.

Required is what the published reference release's manifest carries; the fields glmquant adds (`metadata_files`,
`retained_tensor_count`, `geometry`, each entry's `kind` ...) are checked when present. `docs/manifest.md` lists
every field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from glmquant.checkpoint.layouts import LAYOUTS
from glmquant.checkpoint.manifest import SCHEMA_VERSION, STRUCTURAL_PASS

_NUMBER = (int, float)
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "state": str,
    "structurally_verified_at": str,
    "files": list,
    "indexed_tensor_count": int,
    "physical_tensor_bytes": int,
    "retained_tensor_bytes": int,
    "retained_manifest_sha256": str,
    "target_bpw": _NUMBER,
    "effective_routed_tier_bpw": _NUMBER,
    "layout": dict,
    "source": dict,
    "calibration": dict,
    "method": dict,
    "runtime": dict,
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {"metadata_files": list, "retained_tensor_count": int, "geometry": dict}
_ENTRY = {"path": str, "bytes": int, "sha256": str}
_KIND_FIELDS: dict[str, dict[str, type]] = {  # required per kind (the release's), then glmquant's own when present
    "expert": {"gpu": int, "logical_expert_count": int, "shadow_expert_count": int, "tier": str},
    "retained": {"tensor_count": int, "tensor_bytes": int},
    "model": {
        "tensor_count": int,
        "tensor_bytes": int,
        "exl3_linear_count": int,
        "logical_expert_count": int,
        "retained_tensor_count": int,
        "retained_tensor_bytes": int,
    },
}
_KIND_OPTIONAL: dict[str, type] = {
    "tensor_count": int,
    "tensor_bytes": int,
    "layer": int,
    "source_shard": str,
    # a glmquant retained file holding EXL3 retained linears or lm_head (`encode --retained-bits`, `--head-bits`)
    "exl3_linear_count": int,
    "retained_tensor_count": int,
    "retained_tensor_bytes": int,
}
_LAYOUT_KINDS = {"tr3": {"expert", "retained"}, "exllamav3": {"model"}}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def entry_kind(entry: Mapping[str, Any]) -> str:
    """A file entry's kind: glmquant writes it; the release's entries say it by their fields (experts have a tier)."""
    kind = entry.get("kind")
    if isinstance(kind, str):
        return kind
    return "expert" if "tier" in entry else "retained"


def safe_relative(path: object) -> bool:
    """A manifest path that, read lexically, stays inside the artifact directory."""
    if not isinstance(path, str) or not path or "\\" in path:
        return False
    p = PurePosixPath(path)
    return not p.is_absolute() and ".." not in p.parts


def retained_share(entry: Mapping[str, Any]) -> tuple[int, int]:
    """(tensor count, bytes) of an entry's retained (non-EXL3) tensors."""
    kind = entry_kind(entry)
    if kind == "retained":  # all of it, unless it says how much is EXL3 linears (`--retained-bits`, `--head-bits`)
        return (
            entry.get("retained_tensor_count", entry.get("tensor_count", 0)),
            entry.get("retained_tensor_bytes", entry.get("tensor_bytes", 0)),
        )
    if kind == "model":
        return entry.get("retained_tensor_count", 0), entry.get("retained_tensor_bytes", 0)
    return 0, 0


def manifest_problems(m: Mapping[str, Any]) -> list[str]:
    problems = [f"field {k!r} missing or not {_type_name(t)}" for k, t in _REQUIRED.items() if not _is(m.get(k), t)]
    problems += [f"field {k!r} is not {_type_name(t)}" for k, t in _OPTIONAL.items() if k in m and not _is(m[k], t)]
    if m.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema_version is {m.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    if m.get("state") != STRUCTURAL_PASS:
        problems.append(f"state is {m.get('state')!r}, expected {STRUCTURAL_PASS!r}")
    if problems:
        return problems
    layout = m["layout"]
    if layout.get("type") not in LAYOUTS:
        return [f"layout.type {layout.get('type')!r} is not one of {list(LAYOUTS)}"]
    files = [e for e in m["files"] if isinstance(e, dict)]
    problems += [f"files[{i}] is not an object" for i, e in enumerate(m["files"]) if not isinstance(e, dict)]
    for e in files:
        problems += _entry_problems(e, _LAYOUT_KINDS[layout["type"]])
    metadata = m.get("metadata_files", [])
    for e in metadata:
        problems += _entry_problems(e, None)
    if problems:
        return problems
    return _order_problems(files, metadata) + _total_problems(m, files)


def _entry_problems(e: object, kinds: set[str] | None) -> list[str]:
    """A file entry's fields; `kinds` None for a metadata file (path, bytes and sha256 only)."""
    if not isinstance(e, dict):
        return [f"entry {e!r} is not an object"]
    name = e.get("path", "?")
    out = [f"{name}: field {k!r} missing or not {_type_name(t)}" for k, t in _ENTRY.items() if not _is(e.get(k), t)]
    if not safe_relative(e.get("path")):
        out.append(f"path {e.get('path')!r} escapes the artifact directory (absolute, '..' or empty)")
    if isinstance(e.get("sha256"), str) and not _HEX64.match(e["sha256"]):
        out.append(f"{name}: sha256 {e['sha256']!r} is not 64 lowercase hex digits")
    if kinds is None:
        return out
    kind = entry_kind(e)
    if kind not in kinds:
        return out + [f"{name}: kind {kind!r} does not belong to this layout (expected {sorted(kinds)})"]
    out += [
        f"{name}: {kind} entry lacks {k!r} or it is not {_type_name(t)}"
        for k, t in _KIND_FIELDS[kind].items()
        if not _is(e.get(k), t)
    ]
    out += [
        f"{name}: {k!r} is not {_type_name(t)}"
        for k, t in _KIND_OPTIONAL.items()
        if k in e and k not in _KIND_FIELDS[kind] and not _is(e[k], t)
    ]
    return out


def _order_problems(files: list[dict[str, Any]], metadata: list[dict[str, Any]]) -> list[str]:
    out = []
    for label, entries in (("files", files), ("metadata_files", metadata)):
        paths = [e["path"] for e in entries]
        if paths != sorted(paths):
            out.append(f"{label} are not sorted by path")
    every = [e["path"] for e in files + metadata]
    dupes = sorted({p for p in every if every.count(p) > 1})
    return out + [f"path {p} is listed more than once" for p in dupes]


def _total_problems(m: Mapping[str, Any], files: list[dict[str, Any]]) -> list[str]:
    """Totals against the entries; a total whose parts some entries do not carry is left to the full check."""
    totals = {
        "physical_tensor_bytes": sum(e["bytes"] for e in files),
        "retained_tensor_bytes": sum(retained_share(e)[1] for e in files),
    }
    if all("tensor_count" in e for e in files):
        totals["indexed_tensor_count"] = sum(e["tensor_count"] for e in files)
    if "retained_tensor_count" in m:
        totals["retained_tensor_count"] = sum(retained_share(e)[0] for e in files)
    out = [
        f"{key} is {m[key]:,} but the file entries add up to {value:,}"
        for key, value in totals.items()
        if m[key] != value
    ]
    layout = m["layout"]
    if "experts_per_layer" in layout and "quantized_layers" in layout:
        experts = sum(e.get("logical_expert_count", 0) for e in files)
        expected = layout["experts_per_layer"] * len(layout["quantized_layers"])
        if experts != expected:
            out.append(f"file entries hold {experts} logical experts, layout implies {expected}")
    return out


def _is(value: object, t: type | tuple[type, ...]) -> bool:
    return isinstance(value, t) and not isinstance(value, bool)


def _type_name(t: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(t, tuple) else f"a {t.__name__}"
