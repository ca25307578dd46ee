"""A torchrun job of two gloo processes writes the same bytes as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from encode_fixtures import EPOCH, digests

from glmquant.encode.distributed import Ranks


def test_units_are_dealt_round_robin() -> None:
    units = list(range(10))
    shares = [Ranks(rank, 3).mine(units) for rank in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert Ranks(1, 2, local_rank=1).device("cuda") == "cuda:1" and Ranks().device("cuda") == "cuda"


@pytest.mark.fresh_encodes
@pytest.mark.slow
@pytest.mark.xdist_group("small-artifact")  # pytest-xdist: on the worker that encodes `small_artifact`
def test_two_processes_write_the_same_artifact_as_one(
    small_source: Path, small_observations: Path, small_artifact: Path, tmp_path: Path
) -> None:
    """Each rank encodes its units of one expert (--experts-per-unit 1: two ranks get work in every layer); the
    result is byte for byte the one-process artifact (`small_artifact`, encoded with the default experts per unit
    at the same SOURCE_DATE_EPOCH), so neither the ranks nor the units' size change a byte."""
    two = tmp_path / "two"
    env = {**os.environ, "SOURCE_DATE_EPOCH": EPOCH, "OMP_NUM_THREADS": "1"}
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
    assert digests(two) == digests(small_artifact)
    assert not list((two.parent / "two.work" / "units").glob("*.safetensors"))  # unit files cleaned up
