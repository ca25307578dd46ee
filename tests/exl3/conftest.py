"""Golden vectors produced by exllamav3 1.6.5 on an H200 (copied into tests/data so the suite runs anywhere), torch
on one thread for the step-by-step Viterbi references, and every encode computed (the codec's own tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glmquant.environment import ENCODE_MEMO

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(autouse=True)
def _codec_encodes_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No encode here is read back from the suite's encode memo (tests/conftest.py): these test the encoder."""
    monkeypatch.delenv(ENCODE_MEMO, raising=False)


@pytest.fixture(scope="session")
def golden() -> dict[str, torch.Tensor]:
    return load_file(DATA / "exl3_golden.safetensors")


@pytest.fixture(scope="session")
def golden_meta() -> dict:
    return json.loads((DATA / "exl3_golden.json").read_text())


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread during the test: the step-by-step Viterbi references run thousands of tiny ops,
    which more threads only slow with spin-waiting on a busy machine (the CUDA kernel's reference beside two busy
    processes, measured: 6.5 s on two threads, 2.7 s on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
