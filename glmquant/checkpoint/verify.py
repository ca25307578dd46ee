"""Verify an artifact against its EXL3_MANIFEST.json, in a fixed order of checks.

1 the manifest's own SHA-256 against the pinned value, 2 the manifest's internal consistency (schema, totals,
paths that stay inside the artifact), 3 every listed file present with its recorded size, 4 every file's
full SHA-256 (skipped with `fast`), 5 no file the manifest cannot vouch for (unlisted weight files and
temporary files fail; other unlisted files fail with `strict`, else are reported), then the structural checks on
the headers and config (`verify_structure`). Every check runs and reports; none stops the others, except that
files outside the artifact directory are never opened. A manifest that cannot be read is a failed verification.
`docs/manifest.md` says what each check proves.
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
from glmquant.checkpoint.writer import is_temp_file
from glmquant.errors import GlmquantError, UsageError

# Files an artifact may hold that no manifest lists: a Hub repository's own files, and serve-check's reports
# (written into the artifact after the build). Reported, never a failure.
EXPECTED_UNLISTED = {
    ".gitattributes": "Hub repository attributes",
    "README.md": "Hub repository card",
    "serve-check.json": "serve-check report",
    "serve-check.md": "serve-check report",
}
HUB_CACHE = ".cache/huggingface/"  # what `hf download --local-dir` leaves

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class UnreadableManifest(GlmquantError):
    """A manifest file that is missing, unreadable, not JSON or not an object: the artifact fails (exit 1)."""


def load_manifest(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The manifest's bytes and parsed object; raises UnreadableManifest naming the file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UnreadableManifest(f"{path}: cannot read manifest ({exc.strerror or exc})") from None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnreadableManifest(f"{path}: manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise UnreadableManifest(f"{path}: manifest is not a JSON object")
    return raw, manifest


def _unreadable(target: Path, exc: UnreadableManifest) -> VerifyReport:
    """The report of an artifact whose manifest cannot be read: one failed check, nothing else to check."""
    try:
        sha = sha256_bytes(target.read_bytes()) if target.is_file() else ""
    except OSError:
        sha = ""
    return VerifyReport(str(target), sha, (CheckResult("manifest readable", False, str(exc)),))


def _check_pin(expect: str | None) -> None:
    if expect is not None and not _HEX64.match(expect):
        raise UsageError(f"--expect-sha256 must be 64 hex digits, got {expect!r}")


def _hash_check(raw: bytes, expect: str | None) -> tuple[str, CheckResult]:
    sha = sha256_bytes(raw)
    if expect is None:
        return sha, CheckResult("manifest sha256", True, f"{sha} (not pinned: no expected hash given)")
    if sha != expect.lower():
        return sha, CheckResult("manifest sha256", False, f"manifest hashes to {sha}, expected {expect.lower()}")
    return sha, CheckResult("manifest sha256", True, f"{sha} matches the pinned value")


def verify_manifest_only(manifest_path: str | Path, expect_sha256: str | None = None) -> VerifyReport:
    """The manifest's own hash and internal consistency, without looking at any other file."""
    path = Path(manifest_path)
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    _check_pin(expect_sha256)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        raw, manifest = load_manifest(path)
    except UnreadableManifest as exc:
        return _unreadable(path, exc)
    sha, first = _hash_check(raw, expect_sha256)
    schema = check("manifest consistency", manifest_problems(manifest), "schema, totals and paths consistent")
    return VerifyReport(str(path), sha, (first, schema))


def verify_artifact(
    artifact_dir: str | Path,
    expect_sha256: str | None = None,
    fast: bool = False,
    show_progress: bool = True,
    workers: int = 4,
    strict: bool = False,
) -> VerifyReport:
    """Every check, in order; `fast` reads headers only (no full-file hashes); `strict` fails on any file the
    manifest does not vouch for (beyond a Hub repository's own files)."""
    root = Path(artifact_dir)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        raise UsageError(f"{root}: no such artifact directory")
    _check_pin(expect_sha256)
    try:
        raw, manifest = load_manifest(root / MANIFEST_NAME)
    except UnreadableManifest as exc:
        return _unreadable(root / MANIFEST_NAME, exc)
    sha, first = _hash_check(raw, expect_sha256)
    state = ArtifactState(root, manifest)
    checks = [first, check("manifest consistency", manifest_problems(manifest), "schema, totals and paths consistent")]
    _select_entries(state)
    checks.append(check("files present", _presence_problems(state), f"{len(state.present)} files with recorded sizes"))
    checks.append(_sha_check(state, fast, show_progress, workers))
    checks.append(_unlisted_check(state, strict))
    state.read_headers()
    checks += structure_checks(state)
    return VerifyReport(str(root), sha, tuple(checks))


def _select_entries(state: ArtifactState) -> None:
    """Entries well-formed enough to look at, and lexically safe (unsafe ones already failed consistency)."""

    def usable(entries: object) -> list[Mapping[str, Any]]:
        return (
            [
                e
                for e in entries
                if isinstance(e, dict) and safe_relative(e.get("path")) and isinstance(e.get("bytes"), int)
            ]
            if isinstance(entries, list)
            else []
        )

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
    problems = [
        f"{e['path']}: sha256 {digests[p]} differs from the manifest's {e.get('sha256')} (modified)"
        for e, p in zip(entries, paths, strict=True)
        if digests[p] != e.get("sha256")
    ]
    return check("file sha256", problems, f"{len(entries)} files hashed, all match")


@contextmanager
def _byte_progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich bar over bytes hashed (on stderr, so --json output stays clean); yields a thread-safe advance."""
    columns = (TextColumn("hashing"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not enabled) as bar:
        task = bar.add_task("hashing", total=total)
        yield lambda n: bar.advance(task, n)


def _unlisted_check(state: ArtifactState, strict: bool) -> CheckResult:
    """Every file under the artifact that the manifest does not list: weight and temporary files fail, a Hub
    repository's own files are noted, anything else fails with `strict` and is a warning without."""
    listed = {PurePosixPath(e["path"]) for e in state.weight_entries + state.metadata_entries}
    listed.add(PurePosixPath(MANIFEST_NAME))
    every = (p.relative_to(state.root).as_posix() for p in state.root.rglob("*") if p.is_file() or p.is_symlink())
    found = sorted(name for name in every if PurePosixPath(name) not in listed)
    failures, unvouched, expected = [], [], []
    for name in found:
        base = PurePosixPath(name).name
        if base.endswith(WEIGHT_SUFFIXES):
            failures.append(f"{name}: weight file not listed in the manifest")
        elif is_temp_file(base):
            failures.append(
                f"{name}: temporary file of an interrupted write (rerun the job that wrote it, or delete it)"
            )
        elif name in EXPECTED_UNLISTED:
            expected.append(f"{name} ({EXPECTED_UNLISTED[name]})")
        elif name.startswith(HUB_CACHE):
            continue
        else:
            unvouched.append(name)
    if unvouched and strict:
        failures.append(f"not covered by the manifest (--strict): {', '.join(unvouched)}")
    if failures:
        return check("unlisted files", failures, "")
    notes = [f"not covered by the manifest: {', '.join(unvouched)}"] if unvouched else []
    notes += [f"expected outside it: {', '.join(expected)}"] if expected else []
    return CheckResult("unlisted files", True, "; ".join(notes) or "every file is listed", warning=bool(unvouched))
