"""The proxy trains at smoke size on the CPU, from a fixed seed to the same weights, and is a source checkpoint
the pipeline reads; the record holds held-out perplexity and the routing check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from proxy_helpers import smoke_config
from safetensors import safe_open

from glmquant.arch import load_model_spec
from glmquant.proxy.train import TrainConfig, train_proxy


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has keys() but no __iter__
    return out


@pytest.mark.slow
def test_record_and_checkpoint(smoke_proxy: Path) -> None:
    record = json.loads((smoke_proxy / "proxy.json").read_text())
    assert record["steps_done"] == 3 and not record["stopped_early"] and record["heldout_ppl"] > 1
    assert len(record["loss_curve"]) == 3 and record["routing"]["layers"].keys() == {"1", "2", "3"}
    assert {"load_imbalance", "experts_without_tokens", "reap_cv"} <= set(record["routing"]["layers"]["1"])
    spec = load_model_spec(smoke_proxy / "model" / "config.json")
    assert spec.n_routed_experts == 32 and spec.num_experts_per_tok == 8 and spec.moe_layers == [1, 2, 3]
    assert spec.attention_types[3] != spec.attention_types[0] and spec.mtp_layers
    bias = _weights(smoke_proxy / "model")["model.language_model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # trained by the load balancer, not made up


@pytest.mark.slow
def test_same_seed_same_weights(corpus_recipe: Path, smoke_proxy: Path, tmp_path: Path) -> None:
    train_proxy(smoke_config(tmp_path, corpus_recipe), log=lambda _line: None)
    ours, theirs = _weights(smoke_proxy / "model"), _weights(tmp_path / "model")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_learning_rate_schedule() -> None:
    cfg = TrainConfig(out=Path("x"), device="cpu", steps=100, warmup_steps=10, lr=1.0, min_lr_fraction=0.1)
    assert cfg.lr_at(0) == 0.1 and cfg.lr_at(9) == 1.0 and abs(cfg.lr_at(99) - 0.1) < 1e-3


@pytest.mark.slow
def test_bfloat16_fallback_trains(corpus_recipe: Path, tmp_path: Path) -> None:
    record = train_proxy(smoke_config(tmp_path, corpus_recipe, steps=1, dtype="bfloat16"), log=lambda _line: None)
    assert record["train_config"]["dtype"] == "bfloat16" and record["heldout_ppl"] > 1
