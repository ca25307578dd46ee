"""`glmquant upload ARTIFACT --repo-id ID`: verify an artifact, then publish it to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.checkpoint.hub import publish_artifact
from glmquant.cli.common import guarded, out


def register(app: typer.Typer) -> None:
    app.command("upload")(upload)


@guarded
def upload(
    artifact: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="artifact directory")],
    repo_id: Annotated[str, typer.Option(help="Hub repo to publish to (owner/name; created when missing)")],
    private: Annotated[bool, typer.Option(help="create the repo private")] = False,
    revision: Annotated[str | None, typer.Option(help="branch to commit to (default main)")] = None,
) -> None:
    """Verify every file against the manifest, then upload the artifact in one commit with its model card
    as README.md (Hub metadata: base model, license, tags, quantization). Token: HF_TOKEN or `hf auth login`."""
    url = publish_artifact(artifact, repo_id, private=private, revision=revision)
    out.print(f"[bold green]published[/] {artifact} to {repo_id}: {url}")
