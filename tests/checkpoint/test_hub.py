"""Hugging Face Hub in and out, offline: plan/observe/encode resolve a repo id through a Hugging Face cache that
each test fills itself (HF_HUB_OFFLINE=1, so nothing leaves the machine), and `upload` publishes only a
verified artifact, through a recording stand-in for HfApi, with the model card as the Hub's README.md."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard
from huggingface_hub.utils import filter_repo_objects
from typer.testing import CliRunner

from glmquant.checkpoint.artifact_writer import ArtifactResult
from glmquant.checkpoint.hub import CHECKPOINT_FILES, CONFIG_FILES, resolve_source
from glmquant.checkpoint.manifest import provenance_fields
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.cli import app
from glmquant.cli import encode as encode_cli
from glmquant.cli import observe as observe_cli
from glmquant.encode.provenance import build_provenance, observed_calibration

REPO = "glmquant/tiny-source"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, with offline mode on (what HF_HUB_CACHE and HF_HUB_OFFLINE=1 set)."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def fill_cache(
    cache: Path, source: Path, names: list[str], refs: tuple[str, ...] = ("main",), commit: str = COMMIT
) -> Path:
    """Lay `names` of `source` into the cache as huggingface_hub does: content-addressed blobs, a snapshot
    directory of relative symlinks named by the commit, and refs naming the commit."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name in names:
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_each_verb_downloads_only_the_files_it_reads():
    """The patterns, applied by huggingface_hub's own filter to a Hub repo's listing."""
    listing = [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
        "LICENSE",
        "figures/bench.png",
        "original/consolidated.00.pth",
        ".gitattributes",
    ]
    assert list(filter_repo_objects(listing, allow_patterns=list(CONFIG_FILES))) == [
        "config.json",
        "model.safetensors.index.json",
    ]
    assert sorted(filter_repo_objects(listing, allow_patterns=list(CHECKPOINT_FILES))) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_plan_from_a_repo_id_reads_only_config_and_index(hub_cache, tiny_source):
    """Only config.json and the index are cached (no weights): plan works offline and predicts exactly what it
    predicts from the directory with its index."""
    fill_cache(hub_cache, tiny_source, ["config.json", "model.safetensors.index.json"])
    from_hub = CliRunner().invoke(app, ["plan", REPO, "--json"])
    local = CliRunner().invoke(
        app, ["plan", str(tiny_source), "--source-index", str(tiny_source / "model.safetensors.index.json"), "--json"]
    )
    assert from_hub.exit_code == 0, from_hub.output
    assert json.loads(from_hub.output) == json.loads(local.output)


def test_encode_from_a_repo_id_records_the_resolved_commit(hub_cache, tiny_source, monkeypatch, tmp_path):
    names = sorted(p.name for p in tiny_source.iterdir() if p.is_file())
    snapshot = fill_cache(hub_cache, tiny_source, names, refs=("v1.0",))
    seen = []
    monkeypatch.setattr(encode_cli, "encode_artifact", _recorder(seen))
    CliRunner().invoke(app, ["encode", REPO, "--revision", "v1.0", "--uncalibrated", "--out", str(tmp_path / "art")])
    (cfg,) = seen
    assert (cfg.source, cfg.source_repo, cfg.source_revision) == (snapshot, REPO, COMMIT)
    source = SourceCheckpoint.open(cfg.source)
    fields = provenance_fields(build_provenance(cfg, source, None, observed_calibration(cfg)))["source"]
    assert (fields["repo_id"], fields["revision"]) == (REPO, COMMIT)


def test_observe_from_a_repo_id_reads_the_cached_snapshot(hub_cache, tiny_source, monkeypatch, tmp_path):
    snapshot = fill_cache(hub_cache, tiny_source, sorted(p.name for p in tiny_source.iterdir() if p.is_file()))
    seen = []
    monkeypatch.setattr(observe_cli, "run_observe", _recorder(seen))
    result = CliRunner().invoke(app, ["observe", REPO, "--out", str(tmp_path / "obs")])
    assert seen[0].source == snapshot, result.output
    assert f"source {REPO} at commit {COMMIT}" in result.output


class Recorded(Exception):
    """Ends a verb once its config was recorded (the stage itself has its own tests)."""


def _recorder(seen: list) -> Callable[..., None]:
    def record(config: object, *args: object, **kwargs: object) -> None:
        seen.append(config)
        raise Recorded

    return record


def test_offline_without_the_files_is_one_clear_error(hub_cache, tiny_source, tmp_path):
    result = CliRunner().invoke(app, ["observe", "glmquant/not-cached", "--out", str(tmp_path / "obs")])
    assert result.exit_code == 2 and "not (completely) in the Hugging Face cache" in result.output
    assert "HF_HUB_OFFLINE=1" in result.output
    fill_cache(hub_cache, tiny_source, ["config.json", "model.safetensors.index.json"])  # a plan-only download
    result = CliRunner().invoke(app, ["encode", REPO, "--uncalibrated", "--out", str(tmp_path / "art")])
    assert result.exit_code == 2 and "snapshot lacks model" in result.output
    assert "download it once online" in result.output
    assert not (tmp_path / "art").exists()


def test_revision_and_local_paths(hub_cache, tiny_source):
    fill_cache(hub_cache, tiny_source, ["config.json"], refs=("main",))
    fill_cache(hub_cache, tiny_source, ["config.json"], refs=("v2",), commit="f" * 40)
    assert resolve_source(REPO, files=["config.json"]).revision == COMMIT
    assert resolve_source(REPO, "v2", files=["config.json"]).revision == "f" * 40
    assert resolve_source(tiny_source).repo_id is None
    with pytest.raises(Exception, match="names a Hub revision, but"):
        resolve_source(tiny_source, "v2")
    with pytest.raises(Exception, match="not a Hub repo id"):
        resolve_source("no/such/dir")


class RecordingApi:
    """Stands in for huggingface_hub.HfApi at the network edge: records what would be sent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def create_repo(self, repo_id: str, **kwargs: object) -> None:
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def create_commit(self, repo_id: str, operations: list, **kwargs: object) -> object:
        self.calls.append(("create_commit", {"repo_id": repo_id, "operations": operations, **kwargs}))
        return type("Commit", (), {"commit_url": f"https://hub.invalid/{repo_id}/commit/1"})()


def test_upload_publishes_a_verified_artifact_with_the_card_as_readme(tr3_artifact, tmp_path, monkeypatch):
    art = Path(shutil.copytree(tr3_artifact[1].directory, tmp_path / "art"))
    (art / "README.md").write_text("---\nlicense: mit\nlanguage: [en, zh]\n---\n# GLM\n")  # the source's card
    api = RecordingApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    result = CliRunner().invoke(app, ["upload", str(art), "--repo-id", "me/tiny-exl3", "--private"])
    assert result.exit_code == 0, result.output
    assert api.calls[0] == ("create_repo", {"repo_id": "me/tiny-exl3", "private": True, "exist_ok": True})
    operations = {op.path_in_repo: op for op in api.calls[1][1]["operations"]}
    on_disk = {p.relative_to(art).as_posix() for p in art.rglob("*") if p.is_file()}
    assert set(operations) == on_disk  # every file once; README.md is the Hub card, not the source's
    card = ModelCard(operations["README.md"].path_or_fileobj.decode())
    manifest_sha = hashlib.sha256((art / "EXL3_MANIFEST.json").read_bytes()).hexdigest()
    source_repo = json.loads((art / "EXL3_MANIFEST.json").read_text())["source"]["repo_id"]
    assert card.data.base_model == source_repo and card.data.license == "mit" and card.data.language == ["en", "zh"]
    assert card.data.base_model_relation == "quantized" and "exl3" in card.data.tags
    assert card.data.quantization == {
        "method": "exl3",
        "bits": 2,
        "codebook": "mcg",
        "layout": "tr3",
        "manifest_sha256": manifest_sha,
    }
    assert f"glmquant verify-manifest . --expect-sha256 {manifest_sha}" in card.text


def test_upload_refuses_an_artifact_that_does_not_verify(
    tr3_artifact: tuple[object, ArtifactResult], tmp_path, monkeypatch
):
    art = Path(shutil.copytree(tr3_artifact[1].directory, tmp_path / "art"))
    shard = next(art.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    api = RecordingApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    result = CliRunner().invoke(app, ["upload", str(art), "--repo-id", "me/tiny-exl3"])
    assert result.exit_code == 1 and "does not verify, nothing was uploaded" in result.output
    assert api.calls == []
