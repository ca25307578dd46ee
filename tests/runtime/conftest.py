"""Tiny artifacts of both layouts, their dequantized references and loaded runtimes, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmquant.fixtures.random_artifact import build_artifact, write_reference
from glmquant.runtime.loader import LoadedModel, load_model
from glmquant.runtime.options import RuntimeOptions


@pytest.fixture(scope="session")
def artifacts(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """layout -> artifact directory (tr3 and exllamav3), random valid EXL3 experts."""
    root = tmp_path_factory.mktemp("runtime-artifacts")
    return {layout: build_artifact(tiny_source, root / layout, layout) for layout in ("tr3", "exllamav3")}


@pytest.fixture(scope="session")
def references(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """layout -> the same weights as a source-named checkpoint with dequantized experts."""
    root = tmp_path_factory.mktemp("runtime-references")
    return {layout: write_reference(path, root / layout) for layout, path in artifacts.items()}


@pytest.fixture(scope="session")
def tr3_f32(artifacts: dict[str, Path]) -> LoadedModel:
    return load_model(artifacts["tr3"], RuntimeOptions(dtype="float32"))
