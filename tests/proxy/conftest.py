"""Smoke-size trained proxies for the proxy, fidelity-benchmark and winning-recipe tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from proxy_helpers import SMOKE_SHAPE, BenchRun, run_bench, small_corpus_recipe, smoke_config

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


@pytest.fixture(scope="session")
def small_proxy(corpus_recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller trained proxy for the tests that encode it for real: three layers, two MoE layers (KDA, then MLA/DSA:
    the fewest that tiers by depth split at the seed's bytes) of 4 experts 128 wide (in the smoke's exllamav3 layout
    each projection one 128 x 128 EXL3 block), a 128-wide dense MLP and a vocabulary of 384 (lm_head three blocks;
    448 took four): the speed tier's K4 linears and K5 head in as few blocks as the architecture allows."""
    out = tmp_path_factory.mktemp("small-proxy")
    shape = replace(
        SMOKE_SHAPE,
        num_hidden_layers=3,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        intermediate_size=128,
        vocab_size=384,
    )
    train_proxy(smoke_config(out, corpus_recipe, shape=shape), log=lambda _line: None)
    return out


@pytest.fixture(scope="session")
def bench_run(small_proxy: Path, tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    """scripts/bench_fidelity.py's CPU run on the small proxy, its row artifacts kept."""
    return run_bench(small_proxy, tmp_path_factory.mktemp("bench-fidelity"))
