"""`glmquant verify-manifest ARTIFACT`: check an artifact against its EXL3_MANIFEST.json.

Exit 0 when every check holds, 1 when the artifact fails (a missing or broken manifest included), 2 for usage
errors (bad options, a path that does not exist).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from glmquant.checkpoint.verify import VerifyReport, verify_artifact, verify_manifest_only
from glmquant.cli.common import JsonFlag, guarded, out, print_json


def register(app: typer.Typer) -> None:
    app.command("verify-manifest")(verify_manifest)


@guarded
def verify_manifest(
    artifact: Annotated[Path, typer.Argument(help="artifact directory (or its EXL3_MANIFEST.json)")],
    expect_sha256: Annotated[str | None, typer.Option(help="pinned SHA-256 of EXL3_MANIFEST.json")] = None,
    fast: Annotated[bool, typer.Option(help="read headers only; skip full-file SHA-256")] = False,
    manifest_only: Annotated[bool, typer.Option(help="check only the manifest's own hash and consistency")] = False,
    strict: Annotated[
        bool,
        typer.Option(
            help="fail on any file the manifest does not cover (a Hub repo's .gitattributes and README.md excepted)"
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Verify hashes, sizes, index closure, EXL3 tensors, config and totals of a built artifact."""
    if manifest_only:
        report = verify_manifest_only(artifact, expect_sha256)
    else:
        report = verify_artifact(artifact, expect_sha256, fast=fast, show_progress=not as_json, strict=strict)
    if as_json:
        print_json(report.to_json())
    else:
        _render(report, expect_sha256)
    raise typer.Exit(0 if report.ok else 1)


def _render(report: VerifyReport, pinned: str | None) -> None:
    table = Table(title=f"verify-manifest {report.target}")
    table.add_column("#", justify="right")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for i, c in enumerate(report.checks, 1):
        result = (
            "[yellow]SKIP"
            if c.skipped
            else "[yellow]WARN"
            if c.warning
            else "[green]PASS"
            if c.ok
            else "[bold red]FAIL"
        )
        table.add_row(str(i), c.name, result, c.detail)
    out.print(table)
    failed = report.failed
    if failed:
        out.print(f"[bold red]FAIL[/]  {len(failed)} of {len(report.checks)} checks failed: {', '.join(failed)}")
    else:
        out.print(f"[bold green]PASS[/]  all {len(report.checks)} checks passed")
    if report.manifest_sha256:
        pin = (
            "not pinned"
            if pinned is None
            else "matches the pin"
            if report.manifest_sha256 == pinned.lower()
            else "does NOT match the pin"
        )
        out.print(f"manifest sha256 {report.manifest_sha256} ({pin})", highlight=False, soft_wrap=True)
