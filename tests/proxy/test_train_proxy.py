"""The proxy trains at smoke size on the CPU, from a fixed seed to the same weights, and is a source checkpoint
the pipeline reads; the record holds held-out perplexity, the routing check and the MTP layer's held-out figures;
the trained MTP layer loads in the runtime and drafts for speculative decoding."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from proxy_helpers import ROOT, smoke_config
from safetensors import safe_open

from glmquant.arch import load_model_spec, table_for
from glmquant.errors import UsageError
from glmquant.fixtures.random_artifact import build_artifact
from glmquant.fixtures.tiny import TinyModelConfig
from glmquant.proxy.train import STATE_NAME, StopRequests, TrainConfig, build_mtp, load_train_state, train_proxy


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open has keys() but no __iter__
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("smoke-proxy")  # pytest-xdist: on the worker that trains `smoke_proxy`, once
def test_record_and_checkpoint(smoke_proxy: Path) -> None:
    record = json.loads((smoke_proxy / "proxy.json").read_text())
    assert record["steps_done"] == 3 and record["resumed_at"] == [] and record["heldout_ppl"] > 1
    assert not (smoke_proxy / "train_state.pt").exists()  # removed once the record is written
    assert len(record["loss_curve"]) == 3 and record["routing"]["layers"].keys() == {"1", "2", "3"}
    assert {"load_imbalance", "experts_without_tokens", "reap_cv"} <= set(record["routing"]["layers"]["1"])
    spec = load_model_spec(smoke_proxy / "model" / "config.json")
    assert spec.n_routed_experts == 32 and spec.num_experts_per_tok == 8 and spec.moe_layers == [1, 2, 3]
    assert spec.attention_types[3] != spec.attention_types[0] and spec.mtp_layers
    bias = _weights(smoke_proxy / "model")["model.language_model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # trained by the load balancer, not made up
    assert record["mtp_trained"] and record["train_config"]["mtp_loss_weight"] == 0.3
    mtp = record["mtp"]
    assert mtp["heldout_positions"] == 2 * (32 - 2)  # heldout_rows x (seq_len - 2)
    for key in ("heldout_top1", "heldout_greedy_agreement", "heldout_main_top1_next"):
        assert 0 <= mtp[key] <= 1
    assert math.isfinite(mtp["heldout_ppl"]) and mtp["heldout_ppl"] > 1
    losses = [entry["mtp_loss"] for entry in record["loss_curve"]]
    # three smoke steps on different random batches cannot show learning (a fresh clone measured 6.109 -> 6.135);
    # that the MTP layer trains is checked by its weights moving (test_mtp_layer_is_trained_and_drafts_in_the_runtime)
    assert len(losses) == 3 and all(math.isfinite(x) and x > 0 for x in losses)


@pytest.mark.slow
@pytest.mark.xdist_group("smoke-proxy")  # pytest-xdist: on the worker that trains `smoke_proxy`, once
def test_mtp_layer_is_trained_and_drafts_in_the_runtime(smoke_proxy: Path, tmp_path: Path) -> None:
    """The checkpoint's MTP layer (release names, shapes, dtypes) moved from its initial weights, fills the
    runtime's MTP layer from an artifact, and speculative greedy decoding with it equals plain greedy."""
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration

    from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.mtp_decoder import MtpDecoder
    from glmquant.runtime.options import RuntimeOptions
    from glmquant.runtime.speculative import SpeculativeConfig

    model_dir = smoke_proxy / "model"
    record = json.loads((smoke_proxy / "proxy.json").read_text())
    spec = load_model_spec(model_dir / "config.json")
    prefix = table_for(spec).layer_prefix(spec.mtp_layers[0])
    saved = {k: v for k, v in _weights(model_dir).items() if k.startswith(prefix)}
    # the initial MTP layer, as train_proxy built it: the same seed, model construction and build_mtp
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(record["seed"])
    hf_config = TinyModelConfig(**record["shape"]).hf_config(tokenizer)
    hf_config.text_config._experts_implementation = record["train_config"]["experts_implementation"]
    initial = build_mtp(Glm5NextForConditionalGeneration(hf_config)).state_dict()

    def at_init(name: str) -> torch.Tensor:
        return initial[name[len(prefix) :]].to(saved[name].dtype)

    wk = f"{prefix}self_attn.indexer.wk.weight"  # the indexer gets no gradient: still its initial value
    assert torch.equal(saved[wk], at_init(wk))
    for name in (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "self_attn.o_proj.weight",
        "mlp.shared_experts.down_proj.weight",
        "shared_head.norm.weight",
    ):
        assert not torch.equal(saved[prefix + name], at_init(prefix + name)), name
    experts = initial["mlp.experts.down_proj"].to(torch.bfloat16)
    n = spec.n_routed_experts
    moved = [not torch.equal(saved[f"{prefix}mlp.experts.{e}.down_proj.weight"], experts[e]) for e in range(n)]
    assert sum(moved) >= 3 * n // 4  # routed experts that got tokens moved

    artifact = build_artifact(model_dir, tmp_path / "tr3", "tr3")  # plans the checkpoint: names, shapes, dtypes
    options = RuntimeOptions(dtype="float32", speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    loaded = load_model(artifact, options)
    assert loaded.mtp is not None
    assert torch.equal(loaded.mtp.eh_proj.weight, saved[f"{prefix}eh_proj.weight"].float())
    prompt = PromptInputs(tokenizer("def load(path):\n    with open(path) as f:", return_tensors="pt")["input_ids"])
    params = SamplingParams(max_tokens=12)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids)))

    plain = generate(loaded.model, prompt, params, decode)
    spec_run = generate(MtpDecoder(loaded.model, loaded.mtp, 2), prompt, params, decode)
    assert spec_run.token_ids == plain.token_ids and spec_run.speculative is not None
    assert spec_run.speculative.drafted == 2 * spec_run.speculative.steps


def test_mtp_loss_weight_is_checked() -> None:
    assert TrainConfig(out=Path("x"), device="cpu", mtp_loss_weight=0).mtp_loss_weight == 0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--mtp-loss-weight"):
            TrainConfig(out=Path("x"), device="cpu", mtp_loss_weight=bad)


@pytest.mark.slow
def test_paused_training_resumes_to_the_uninterrupted_weights(
    corpus_recipe: Path, smoke_proxy: Path, tmp_path: Path
) -> None:
    """Two pauses (--max-minutes) and a resume give the bytes of the uninterrupted run from the same seed;
    a paused run writes no model, and resuming with settings that change the weights is refused."""
    quiet = {"log": lambda _line: None}
    for steps_done in (1, 2):
        paused = train_proxy(smoke_config(tmp_path, corpus_recipe, max_minutes=1e-9), **quiet)
        assert paused == {"paused": True, "steps_done": steps_done, "state": str(tmp_path / STATE_NAME)}
        assert not (tmp_path / "proxy.json").exists() and not list((tmp_path / "model").glob("*.safetensors"))
    with pytest.raises(UsageError, match=r"train_state\.pt was saved with other settings \(lr\)"):
        train_proxy(smoke_config(tmp_path, corpus_recipe, lr=1e-3), **quiet)
    record = train_proxy(smoke_config(tmp_path, corpus_recipe), **quiet)
    assert record["resumed_at"] == [1, 2] and record["steps_done"] == 3
    assert [e["step"] for e in record["loss_curve"]] == [0, 1, 2]
    ours, theirs = _weights(smoke_proxy / "model"), _weights(tmp_path / "model")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not (tmp_path / STATE_NAME).exists()


def test_unreadable_training_state_is_refused_by_name(tmp_path: Path) -> None:
    state = tmp_path / STATE_NAME
    state.write_bytes(b"not a torch file")
    with pytest.raises(UsageError, match=r"train_state\.pt: cannot read the saved training state .*delete it"):
        load_train_state(state, TrainConfig(out=tmp_path, device="cpu"))


def test_sigterm_asks_the_loop_to_pause_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopRequests() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"  # the process lives on; the loop pauses at the end of its step
    assert signal.getsignal(signal.SIGTERM) is before


def test_learning_rate_schedule() -> None:
    cfg = TrainConfig(out=Path("x"), device="cpu", steps=100, warmup_steps=10, lr=1.0, min_lr_fraction=0.1)
    assert cfg.lr_at(0) == 0.1 and cfg.lr_at(9) == 1.0 and abs(cfg.lr_at(99) - 0.1) < 1e-3


@pytest.mark.slow
def test_bfloat16_fallback_trains(corpus_recipe: Path, tmp_path: Path) -> None:
    record = train_proxy(smoke_config(tmp_path, corpus_recipe, steps=1, dtype="bfloat16"), log=lambda _line: None)
    assert record["train_config"]["dtype"] == "bfloat16" and record["heldout_ppl"] > 1


@pytest.mark.slow
def test_script_layers_option_deepens_the_shape(corpus_recipe: Path, tmp_path: Path) -> None:
    """scripts/train_proxy.py --layers N: the smoke shape with N decoder layers (its dense first layer, the rest
    MoE), as the depth sweep's deeper CPU proxy is trained; too few layers for one MoE layer is refused."""
    script = [sys.executable, str(ROOT / "scripts" / "train_proxy.py"), "--smoke", "--device", "cpu"]
    small = ["--steps", "1", "--batch-rows", "1", "--seq-len", "16", "--heldout-rows", "1", "--calibration-rows", "1"]
    small += ["--corpus-recipe", str(corpus_recipe)]
    refused = subprocess.run([*script, "--layers", "1", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert refused.returncode == 2 and "--layers must exceed the shape's 1 dense layer(s), got 1" in refused.stderr
    run = subprocess.run([*script, "--layers", "5", "--out", str(tmp_path), *small], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    text = json.loads((tmp_path / "model" / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 5 and text["mlp_layer_types"] == ["dense"] + ["sparse"] * 4
    assert json.loads((tmp_path / "proxy.json").read_text())["shape"]["num_hidden_layers"] == 5
    # --corpus-lock: the run's own lock is taken, and refused for a corpus of another size, before any training
    lock = tmp_path / "corpus" / "corpus.lock.json"
    again = [*script, "--out", str(tmp_path / "again"), *small, "--corpus-lock", str(lock)]
    run = subprocess.run(again, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "again" / "proxy.json").read_text())
    assert record["corpus"]["locked_by"] == str(lock)
    assert record["corpus"]["splits"] == json.loads((tmp_path / "proxy.json").read_text())["corpus"]["splits"]
    other = [*small, "--corpus-lock", str(lock), "--corpus-bytes", "100000"]
    refused = subprocess.run([*script, "--out", str(tmp_path / "other"), *other], capture_output=True, text=True)
    assert refused.returncode == 2 and "corpus.lock.json: locks the corpus of recipe" in refused.stderr
    assert not (tmp_path / "other" / "model").exists()
