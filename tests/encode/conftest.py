"""The small source and its observations (with and without dense Hessians), built once for all encode tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from encode_fixtures import SMALL

from glmquant.fixtures import build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe


@pytest.fixture(scope="session")
def small_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("enc-src"), SMALL)


@pytest.fixture(scope="session")
def small_observations(small_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("enc-obs")
    observe(ObserveConfig(source=small_source, out=out, rows=4, tokens=64))
    return out


@pytest.fixture(scope="session")
def dense_observations(small_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Observations with the dense Hessians of the retained linears and lm_head (`--dense-hessians`)."""
    out = tmp_path_factory.mktemp("enc-obs-dense")
    observe(ObserveConfig(source=small_source, out=out, rows=4, tokens=64, dense_hessians=True))
    return out
