"""Tiny artifacts of both layouts, written once per session, for the round-trip and tamper tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from checkpoint_artifacts import build

from glmquant.checkpoint.artifact_writer import ArtifactResult
from glmquant.checkpoint.layouts import ArtifactPlan


@pytest.fixture(scope="session")
def tr3_artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ArtifactPlan, ArtifactResult]:
    return build(tiny_source, tmp_path_factory.mktemp("tr3") / "artifact", "tr3")


@pytest.fixture(scope="session")
def exl3_artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[ArtifactPlan, ArtifactResult]:
    return build(tiny_source, tmp_path_factory.mktemp("exllamav3") / "artifact", "exllamav3", shard_bytes=1 << 20)


@pytest.fixture
def tr3_copy(tr3_artifact: tuple[ArtifactPlan, ArtifactResult], tmp_path: Path) -> Path:
    """A private copy of the tr3 artifact that a test may tamper with."""
    return Path(shutil.copytree(tr3_artifact[1].directory, tmp_path / "artifact"))
