"""What a well-formed EXL3_MANIFEST.json (schema 2) must satisfy on its own, without opening other files:
field types, per-kind file extras, sorted unique paths inside the artifact, totals equal to their parts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from glmquant.checkpoint.layouts import LAYOUTS
from glmquant.checkpoint.manifest import SCHEMA_VERSION, STRUCTURAL_PASS

_NUMBER = (int, float)
_TOP: dict[str, type | tuple[type, ...]] = {
    "schema_version": int, "state": str, "structurally_verified_at": str, "files": list, "metadata_files": list,
    "indexed_tensor_count": int, "physical_tensor_bytes": int, "retained_tensor_count": int,
    "retained_tensor_bytes": int, "retained_manifest_sha256": str, "target_bpw": _NUMBER,
    "effective_routed_tier_bpw": _NUMBER, "layout": dict, "geometry": dict, "source": dict, "calibration": dict,
    "method": dict, "runtime": dict,
}
_ENTRY = {"path": str, "kind": str, "bytes": int, "sha256": str, "tensor_count": int, "tensor_bytes": int}
_KIND_EXTRAS = {
    "expert": ("layer", "gpu", "logical_expert_count", "shadow_expert_count", "tier"),
    "retained": ("source_shard",),
    "model": ("exl3_linear_count", "logical_expert_count", "retained_tensor_count", "retained_tensor_bytes"),
}
_LAYOUT_KINDS = {"tr3": {"expert", "retained"}, "exllamav3": {"model"}}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def safe_relative(path: object) -> bool:
    """A manifest path that, read lexically, stays inside the artifact directory."""
    if not isinstance(path, str) or not path or "\\" in path:
        return False
    p = PurePosixPath(path)
    return not p.is_absolute() and ".." not in p.parts


def retained_share(entry: Mapping[str, Any]) -> tuple[int, int]:
    """(tensor count, bytes) of an entry's retained (non-EXL3) tensors."""
    if entry.get("kind") == "retained":
        return entry.get("tensor_count", 0), entry.get("tensor_bytes", 0)
    if entry.get("kind") == "model":
        return entry.get("retained_tensor_count", 0), entry.get("retained_tensor_bytes", 0)
    return 0, 0


def manifest_problems(m: Mapping[str, Any]) -> list[str]:
    problems = [f"field {k!r} missing or not {_type_name(t)}" for k, t in _TOP.items() if not _is(m.get(k), t)]
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
        problems += _entry_problems(e, _ENTRY, _LAYOUT_KINDS[layout["type"]])
    for e in m["metadata_files"]:
        problems += _entry_problems(e, {"path": str, "bytes": int, "sha256": str}, None)
    if problems:
        return problems
    return _order_problems(files, m["metadata_files"]) + _total_problems(m, files)


def _entry_problems(e: object, fields: Mapping[str, type], kinds: set[str] | None) -> list[str]:
    if not isinstance(e, dict):
        return [f"entry {e!r} is not an object"]
    name = e.get("path", "?")
    out = [f"{name}: field {k!r} missing or not {_type_name(t)}" for k, t in fields.items() if not _is(e.get(k), t)]
    if not safe_relative(e.get("path")):
        out.append(f"path {e.get('path')!r} escapes the artifact directory (absolute, '..' or empty)")
    if isinstance(e.get("sha256"), str) and not _HEX64.match(e["sha256"]):
        out.append(f"{name}: sha256 {e['sha256']!r} is not 64 lowercase hex digits")
    if kinds is not None and e.get("kind") is not None:
        if e["kind"] not in kinds:
            out.append(f"{name}: kind {e['kind']!r} does not belong to this layout (expected {sorted(kinds)})")
        else:
            out += [f"{name}: {e['kind']} entry lacks {k!r}" for k in _KIND_EXTRAS[e["kind"]] if k not in e]
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
    out = []
    totals = {
        "physical_tensor_bytes": sum(e["bytes"] for e in files),
        "indexed_tensor_count": sum(e["tensor_count"] for e in files),
        "retained_tensor_count": sum(retained_share(e)[0] for e in files),
        "retained_tensor_bytes": sum(retained_share(e)[1] for e in files),
    }
    for key, value in totals.items():
        if m[key] != value:
            out.append(f"{key} is {m[key]:,} but the file entries add up to {value:,}")
    layout = m["layout"]
    experts = sum(e.get("logical_expert_count", 0) for e in files)
    expected = layout.get("experts_per_layer", 0) * len(layout.get("quantized_layers", []))
    if experts != expected:
        out.append(f"file entries hold {experts} logical experts, layout implies {expected}")
    return out


def _is(value: object, t: type | tuple[type, ...]) -> bool:
    return isinstance(value, t) and not isinstance(value, bool)


def _type_name(t: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(t, tuple) else f"a {t.__name__}"
