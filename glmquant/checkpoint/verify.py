"""Verify an artifact against its EXL3_MANIFEST.json, in a fixed order of checks.

1 the manifest's own SHA-256 against the pinned value, 2 the manifest's internal consistency (schema, totals,
paths that stay inside the artifact), 3 every listed file present with its recorded size, 4 every file's
full SHA-256 (skipped with `fast`), 5 no unlisted weight files, then the structural checks on the headers
and config (`verify_structure`). Every check runs and reports; none stops the others, except that files
outside the artifact directory are never opened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from glmquant.checkpoint.artifact_config import WEIGHT_SUFFIXES
from glmquant.checkpoint.hashing import sha256_bytes, sha256_files
from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.manifest_schema import manifest_problems, safe_relative
from glmquant.checkpoint.verify_report import ArtifactState, CheckResult, VerifyReport, check
from glmquant.checkpoint.verify_structure import structure_checks
from glmquant.errors import UsageError

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def load_manifest(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The manifest's bytes and parsed object; unreadable input is a usage error (exit 2)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read manifest ({exc.strerror or exc})") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise UsageError(f"{path}: manifest is not a JSON object")
    return raw, manifest


def _hash_check(raw: bytes, expect: str | None) -> tuple[str, CheckResult]:
    if expect is not None and not _HEX64.match(expect):
        raise UsageError(f"--expect-sha256 must be 64 hex digits, got {expect!r}")
    sha = sha256_bytes(raw)
    if expect is None:
        return sha, CheckResult("manifest sha256", True, f"{sha} (not pinned: no expected hash given)")
    if sha != expect.lower():
        return sha, CheckResult("manifest sha256", False, f"manifest hashes to {sha}, expected {expect.lower()}")
    return sha, CheckResult("manifest sha256", True, f"{sha} matches the pinned value")


def verify_manifest_only(manifest_path: str | Path, expect_sha256: str | None = None) -> VerifyReport:
    """The manifest's own hash and internal consistency, without looking at any other file."""
    path = Path(manifest_path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    raw, manifest = load_manifest(path)
    sha, first = _hash_check(raw, expect_sha256)
    schema = check("manifest consistency", manifest_problems(manifest), "schema, totals and paths consistent")
    return VerifyReport(str(path), sha, (first, schema))


def verify_artifact(
    artifact_dir: str | Path, expect_sha256: str | None = None, fast: bool = False,
    show_progress: bool = True, workers: int = 4,
) -> VerifyReport:
    """Every check, in order; `fast` reads headers only (no full-file hashes)."""
    root = Path(artifact_dir)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        raise UsageError(f"{root}: no such artifact directory")
    raw, manifest = load_manifest(root / MANIFEST_NAME)
    sha, first = _hash_check(raw, expect_sha256)
    state = ArtifactState(root, manifest)
    checks = [first, check("manifest consistency", manifest_problems(manifest), "schema, totals and paths consistent")]
    _select_entries(state)
    checks.append(check("files present", _presence_problems(state), f"{len(state.present)} files with recorded sizes"))
    checks.append(_sha_check(state, fast, show_progress, workers))
    checks.append(check("no unlisted weight files", _unlisted(state), "every weight file is listed"))
    state.read_headers()
    checks += structure_checks(state)
    return VerifyReport(str(root), sha, tuple(checks))


def _select_entries(state: ArtifactState) -> None:
    """Entries well-formed enough to look at, and lexically safe (unsafe ones already failed consistency)."""
    def usable(entries: object) -> list[Mapping[str, Any]]:
        return [e for e in entries if isinstance(e, dict) and safe_relative(e.get("path"))
                and isinstance(e.get("bytes"), int)] if isinstance(entries, list) else []

    state.weight_entries = usable(state.manifest.get("files"))
    state.metadata_entries = usable(state.manifest.get("metadata_files"))


def _presence_problems(state: ArtifactState) -> list[str]:
    problems = []
    root = state.root.resolve()
    for entry in state.weight_entries + state.metadata_entries:
        rel, path = entry["path"], state.root / entry["path"]
        if not path.resolve().is_relative_to(root):
            problems.append(f"{rel}: resolves outside the artifact directory (symlink); not opened")
            continue
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        state.present.add(rel)  # even with a wrong size: later checks read it and say what is wrong
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{rel}: {size} bytes, manifest records {entry['bytes']} (truncated or modified)")
    return problems


def _sha_check(state: ArtifactState, fast: bool, show_progress: bool, workers: int) -> CheckResult:
    if fast:
        return CheckResult("file sha256", True, "skipped (--fast: headers only)", skipped=True)
    entries = [e for e in state.weight_entries + state.metadata_entries if e["path"] in state.present]
    paths = [state.root / e["path"] for e in entries]
    with _byte_progress(sum(p.stat().st_size for p in paths), show_progress) as advance:
        digests = sha256_files(paths, workers, advance)
    problems = [f"{e['path']}: sha256 {digests[p]} differs from the manifest's {e.get('sha256')} (modified)"
                for e, p in zip(entries, paths, strict=True) if digests[p] != e.get("sha256")]
    return check("file sha256", problems, f"{len(entries)} files hashed, all match")


@contextmanager
def _byte_progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich bar over bytes hashed (on stderr, so --json output stays clean); yields a thread-safe advance."""
    columns = (TextColumn("hashing"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not enabled) as bar:
        task = bar.add_task("hashing", total=total)
        yield lambda n: bar.advance(task, n)


def _unlisted(state: ArtifactState) -> list[str]:
    listed = {PurePosixPath(e["path"]) for e in state.weight_entries}
    found = sorted(p.relative_to(state.root).as_posix() for p in state.root.rglob("*")
                   if p.name.endswith(WEIGHT_SUFFIXES) and (p.is_file() or p.is_symlink()))
    return [f"{name}: weight file not listed in the manifest" for name in found if PurePosixPath(name) not in listed]
