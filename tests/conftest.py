"""Fixtures shared by the whole suite: the tiny source checkpoint and the optional ../shared material."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.fixtures import build_tiny_checkpoint

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny GLM-5.3-Flash-architecture BF16 checkpoint (built once per test session)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-source"))


@pytest.fixture(scope="session")
def reference_config() -> Path:
    """The real GLM-5.3-Flash config of the reference artifact (in ../shared, absent from user clones)."""
    path = SHARED / "reference" / "glm-5.3-flash" / "config.json"
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is only beside the project's own checkouts)")
    return path
