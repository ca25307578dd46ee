"""Fixtures shared by the whole suite: the tiny source checkpoint and the reference artifact's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.fixtures import build_tiny_checkpoint

@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny GLM-5.3-Flash-architecture BF16 checkpoint (built once per test session)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-source"))


DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def reference_config() -> Path:
    """The exact config of the reference GLM-5.3-Flash artifact (copied from ../shared/reference/glm-5.3-flash)."""
    return DATA / "glm-5.3-flash" / "config.json"
