"""The verifier's vocabulary: one check's result, the ordered report, and the state the checks share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmquant.checkpoint.safetensors_format import ParsedHeader, parse_header
from glmquant.errors import GlmquantError

MAX_SHOWN = 5


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    skipped: bool = False
    warning: bool = False  # passed, with something a person should look at (e.g. files the manifest does not cover)


@dataclass(frozen=True)
class VerifyReport:
    target: str
    manifest_sha256: str
    checks: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def failure_summary(self) -> str:
        return "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "manifest_sha256": self.manifest_sha256,
            "ok": self.ok,
            "checks": [
                {"name": c.name, "ok": c.ok, "skipped": c.skipped, "warning": c.warning, "detail": c.detail}
                for c in self.checks
            ],
        }


def check(name: str, problems: Sequence[str], ok_detail: str) -> CheckResult:
    """A passed check, or a failed one showing the first few problems."""
    if not problems:
        return CheckResult(name, True, ok_detail)
    shown = "; ".join(problems[:MAX_SHOWN])
    more = f" (+{len(problems) - MAX_SHOWN} more)" if len(problems) > MAX_SHOWN else ""
    return CheckResult(name, False, shown + more)


@dataclass
class ArtifactState:
    """What the checks share: the manifest, the entries safe to open, and the headers read so far."""

    root: Path
    manifest: Mapping[str, Any]
    weight_entries: list[Mapping[str, Any]] = field(default_factory=list)
    metadata_entries: list[Mapping[str, Any]] = field(default_factory=list)
    present: set[str] = field(default_factory=set)
    headers: dict[str, ParsedHeader] = field(default_factory=dict)
    header_errors: list[str] = field(default_factory=list)

    def read_headers(self) -> None:
        for entry in self.weight_entries:
            if entry["path"] in self.present:
                try:
                    self.headers[entry["path"]] = parse_header(self.root / entry["path"])
                except GlmquantError as exc:
                    self.header_errors.append(str(exc))
