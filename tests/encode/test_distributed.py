"""A torchrun job of two gloo processes writes the same bytes as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from encode_fixtures import QUIET, digests

from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.distributed import Ranks


def test_units_are_dealt_round_robin() -> None:
    units = list(range(10))
    shares = [Ranks(rank, 3).mine(units) for rank in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert Ranks(1, 2, local_rank=1).device("cuda") == "cuda:1" and Ranks().device("cuda") == "cuda"


@pytest.mark.slow
def test_two_processes_write_the_same_artifact_as_one(
    small_source: Path, small_observations: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    one = tmp_path / "one"
    encode_artifact(
        EncodeConfig(source=small_source, out=one, observations=small_observations, experts_per_unit=1), QUIET
    )
    two = tmp_path / "two"
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1767225600", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "glmquant",
            "encode",
            str(small_source),
            "--out",
            str(two),
            "--observations",
            str(small_observations),
            "--experts-per-unit",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert digests(two) == digests(one)
    assert not list((two.parent / "two.work" / "units").glob("*.safetensors"))  # unit files cleaned up
