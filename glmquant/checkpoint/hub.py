"""Hugging Face Hub in and out.

In: a source given as a Hub repo id (`zai-org/GLM-5.3-Flash`, optionally at a `revision`) is resolved through
huggingface_hub's cache: only the files a verb needs are downloaded (resumably, into HF_HUB_CACHE), offline
mode (HF_HUB_OFFLINE=1) uses the cache alone, and the commit it resolved to is returned for the provenance.

Out: an artifact is published only after it verifies against its manifest, in one commit, with the model
card as README.md under Hub metadata (base model, license, tags, quantization) so the Hub shows it as a
quantization of its source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.model_card import artifact_model_name, model_card_text
from glmquant.errors import GlmquantError, UsageError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CONFIG_FILES = ("config.json", "model.safetensors.index.json")  # what `plan` reads
# what observe and encode read: weights, index and configs, tokenizer and chat template (encode copies the
# small files into the artifact); never the source's README, images or other formats' weights
CHECKPOINT_FILES = ("*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt")
HUB_README = "README.md"


@dataclass(frozen=True)
class ResolvedSource:
    """Where a source lies on disk, and for a Hub source its repo id and the commit it resolved to."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None


def resolve_source(
    source: str | Path, revision: str | None = None, files: Sequence[str] = CHECKPOINT_FILES
) -> ResolvedSource:
    """A local path as it is, or a Hub repo id's `files` (glob patterns) through huggingface_hub's cache."""
    path = Path(source).expanduser()
    if path.exists():
        if revision is not None:
            raise UsageError(f"--revision {revision} names a Hub revision, but {source} is a local path")
        return ResolvedSource(path)
    repo_id = str(source)
    if not REPO_ID.match(repo_id):
        raise UsageError(f"{source}: no such file or directory, and not a Hub repo id (owner/name) either")
    folder = Path(_snapshot(repo_id, revision, files))
    _check_complete(folder, repo_id, files)
    return ResolvedSource(folder, repo_id, folder.name)  # cache snapshots are named by their commit


def _snapshot(repo_id: str, revision: str | None, files: Sequence[str]) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision or 'main'}"
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=list(files))
    except LocalEntryNotFoundError as exc:
        offline = "offline mode is on (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise UsageError(
            f"{where}: not (completely) in the Hugging Face cache {constants.HF_HUB_CACHE} and "
            f"{offline}; download it once online. ({str(exc).splitlines()[0]})"
        ) from None
    except RevisionNotFoundError:
        raise UsageError(f"{where}: the Hub has no revision {revision!r} in {repo_id}") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise UsageError(
            f"{where}: no such repo on the Hub, or it is private or gated and the token (HF_TOKEN or "
            "`hf auth login`) gives no access"
        ) from None
    except HfHubHTTPError as exc:
        raise GlmquantError(f"{where}: the Hub answered {exc}") from None


def _check_complete(folder: Path, repo_id: str, files: Sequence[str]) -> None:
    """A cache snapshot can hold fewer files than asked (an interrupted or narrower download, used offline):
    name what is missing instead of failing later on an unexplained path."""
    wanted = ["config.json"]
    index = folder / "model.safetensors.index.json"
    if "*.safetensors" in files and index.is_file():
        wanted += sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    missing = [name for name in wanted if not (folder / name).is_file()]
    if missing:
        raise UsageError(
            f"{repo_id}@{folder.name}: the Hugging Face cache snapshot lacks {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; download it once online (HF_HUB_OFFLINE unset)"
        )


def hub_card_text(manifest_sha256: str, manifest: Mapping[str, Any], source_card: Path | None = None) -> str:
    """The model card with the Hub's YAML metadata: base model (a quantization of the source), the source's
    license and pipeline tag when its own card (copied into the artifact as README.md) names them, tags."""
    from huggingface_hub import ModelCard, ModelCardData

    source = ModelCard.load(source_card).data if source_card is not None and source_card.is_file() else ModelCardData()
    layout = manifest["layout"]
    data = ModelCardData(
        base_model=manifest["source"]["repo_id"],
        base_model_relation="quantized",
        license=source.license,
        license_name=source.get("license_name"),
        license_link=source.get("license_link"),
        pipeline_tag=source.pipeline_tag or "text-generation",
        library_name="exllamav3",
        language=source.language,
        tags=["exl3", "glmquant", f"{layout['bits']}-bit", "quantized", "moe"],
        quantization={
            "method": "exl3",
            "bits": layout["bits"],
            "codebook": layout["codebook"],
            "layout": layout["type"],
            "manifest_sha256": manifest_sha256,
        },
        model_name=artifact_model_name(manifest),
    )
    pin = (
        f"\nStructural manifest SHA-256: `{manifest_sha256}` (a download is checked with "
        f"`glmquant verify-manifest . --expect-sha256 {manifest_sha256}`).\n"
    )
    return f"---\n{data.to_yaml()}\n---\n\n{model_card_text(manifest)}{pin}"


def publish_artifact(
    artifact_dir: str | Path, repo_id: str, api: Any = None, private: bool = False, revision: str | None = None
) -> str:
    """Verify the artifact, then upload every file of it in one commit with the Hub card as README.md; returns
    the commit's URL. `api` is a huggingface_hub HfApi (its default token and endpoint when None)."""
    from huggingface_hub import CommitOperationAdd, HfApi

    from glmquant.checkpoint.verify import load_manifest, verify_artifact

    root = Path(artifact_dir)
    if not REPO_ID.match(repo_id):
        raise UsageError(f"--repo-id {repo_id!r} is not a Hub repo id (owner/name)")
    report = verify_artifact(root, show_progress=True)
    if not report.ok:
        raise GlmquantError(f"{root} does not verify, nothing was uploaded: {report.failure_summary()}")
    _, manifest = load_manifest(root / MANIFEST_NAME)
    card = hub_card_text(report.manifest_sha256, manifest, root / HUB_README)
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    operations = [
        CommitOperationAdd(path_in_repo=p.relative_to(root).as_posix(), path_or_fileobj=str(p))
        for p in files
        if p.relative_to(root).as_posix() != HUB_README
    ]
    operations.append(CommitOperationAdd(path_in_repo=HUB_README, path_or_fileobj=card.encode()))
    api = api or HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.create_commit(
        repo_id,
        operations=operations,
        revision=revision,
        commit_message=f"{artifact_model_name(manifest)}: manifest {report.manifest_sha256}",
    )
    return str(commit.commit_url)
