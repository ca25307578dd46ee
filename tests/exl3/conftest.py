"""Golden vectors produced by exllamav3 1.6.5 on an H200 (copied into tests/data so the suite runs anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture(scope="session")
def golden() -> dict[str, torch.Tensor]:
    return load_file(DATA / "exl3_golden.safetensors")


@pytest.fixture(scope="session")
def golden_meta() -> dict:
    return json.loads((DATA / "exl3_golden.json").read_text())
