"""The sources, their observations and the small tr3 artifact, built once for all encode tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from encode_fixtures import EPOCH, ONE_MOE, QUIET, SMALL, observed, tiny_source

from glmquant.encode import EncodeConfig, encode_artifact


@pytest.fixture(scope="session")
def small_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory, "enc-src", SMALL)


@pytest.fixture(scope="session")
def small_observations(small_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return observed(small_source, tmp_path_factory, "enc-obs")


@pytest.fixture(scope="session")
def small_artifact(small_source: Path, small_observations: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small source's tr3 K2 artifact, encoded in one process at SOURCE_DATE_EPOCH: the bytes that a resumed
    encode (test_encode_artifact.py) and a two-process one (test_distributed.py) must reproduce. Encoded once: it is
    the encode tests' slowest step on a CPU."""
    out = tmp_path_factory.mktemp("enc") / "artifact"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        encode_artifact(EncodeConfig(source=small_source, out=out, observations=small_observations), QUIET)
    return out


@pytest.fixture(scope="session")
def one_moe_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory, "one-moe-src", ONE_MOE)


@pytest.fixture(scope="session")
def one_moe_dense_observations(one_moe_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Observations with the dense Hessians of the retained linears and lm_head (`--dense-hessians`)."""
    return observed(one_moe_source, tmp_path_factory, "one-moe-obs-dense", dense_hessians=True)
