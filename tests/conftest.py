"""Fixtures shared by the whole suite: the tiny source checkpoint and the reference artifact's config.

Without CUDA the Triton kernels run under Triton's CPU interpreter. The choice is fixed when a kernel module is
first imported, and several test folders import them (kernels, runtime, encode), so it is made here, before any.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers) each worker gets its share of the cores, unless OMP_NUM_THREADS says
# otherwise: torch's intra-op threads (and the native Viterbi's, as many) would spin-wait against the other worker's.
# Set in the environment too, for the processes a test starts (the scripts' end-to-end runs, `glmquant serve`).
if "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.writer import Provided
from glmquant.environment import ENCODE_MEMO
from glmquant.fixtures import build_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def encode_memo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's encode memo ($GLMQUANT_ENCODE_MEMO, unless already set): many tests encode the same tiny linears
    with the same Hessians, and the encodes, most of the suite's time, are computed once per run and read back
    after. One directory for both pytest-xdist workers and the processes the tests start; tests of reproducibility
    (`fresh_encodes`) and the codec's own (tests/exl3) compute every encode."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base  # the run's directory, above each worker's
    os.environ.setdefault(ENCODE_MEMO, str(shared / "encode-memo"))
    return Path(os.environ[ENCODE_MEMO])


@pytest.fixture(autouse=True)
def _fresh_encodes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked `fresh_encodes` encodes without the memo (its fixtures, built before, may have read from it)."""
    if request.node.get_closest_marker("fresh_encodes") is not None:
        monkeypatch.delenv(ENCODE_MEMO, raising=False)


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny GLM-5.3-Flash-architecture BF16 checkpoint (built once per test session)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-source"))


DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def reference_config() -> Path:
    """The exact config of the reference GLM-5.3-Flash artifact (copied from ../shared/reference/glm-5.3-flash)."""
    return DATA / "glm-5.3-flash" / "config.json"


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """`full_disk(pattern)`: from now on, writing tensor bytes into a file whose name matches the regex fails with
    ENOSPC, as a full disk does; `full_disk("")` with an empty pattern frees the space again."""
    import glmquant.checkpoint.writer as writer

    original = writer._write_tensor

    def fill(pattern: str) -> None:
        def write(
            f: BinaryIO, spec: TensorSpec, data: Provided, path: str | Path
        ) -> None:  # the writer's own signature
            if pattern and re.search(pattern, Path(path).name):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            original(f, spec, data, path)

        monkeypatch.setattr(writer, "_write_tensor", write)

    return fill
