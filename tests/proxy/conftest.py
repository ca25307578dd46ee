"""One smoke-size trained proxy for the proxy and fidelity-benchmark tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from proxy_helpers import small_corpus_recipe, smoke_config

from glmquant.proxy.train import train_proxy


@pytest.fixture(scope="session")
def corpus_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_corpus_recipe(tmp_path_factory.mktemp("corpus-recipe"))


@pytest.fixture(scope="session")
def smoke_proxy(corpus_recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT of `train_proxy` at smoke size (OUT/model is the checkpoint, OUT/proxy.json the record)."""
    out = tmp_path_factory.mktemp("proxy")
    train_proxy(smoke_config(out, corpus_recipe), log=lambda _line: None)
    return out
