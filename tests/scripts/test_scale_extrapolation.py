"""The scale extrapolation keeps a layer's fixed costs (its weight load) apart from its per-token costs: a
rehearsal with twice the tokens and the same rates projects the same full-model time."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("scale_extrapolation", ROOT / "scripts" / "scale_extrapolation.py")
assert _spec is not None and _spec.loader is not None
scale_extrapolation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale_extrapolation)  # beside bench_scale.py, not a package
extrapolate = scale_extrapolation.extrapolate

GB = 1e9
LOAD_S_PER_GB = 0.4  # weight loads
STREAM_S_PER_GB = 0.5  # stream chunks moved
RATES = {"kda+dense": (2e-6, 2e-6), "mla+moe": (9e-6, 5e-6), "kda+moe": (8e-6, 4e-6)}  # (observe, forward) s/token
KINDS = [("kda", "dense"), ("kda", "dense"), ("kda", "dense"), ("mla", "moe"), ("kda", "moe")]


def _args(rows: int) -> argparse.Namespace:
    return argparse.Namespace(
        recipe=ROOT / "calibration" / "default.yaml",
        rows=rows,
        tokens=2048,
        full_config=ROOT / "tests" / "data" / "glm-5.3-flash" / "config.json",
        full_recipe=ROOT / "calibration" / "glm-5.3-flash.yaml",
        full_stream_budget_gb=90.0,
        experts=144,
        encode_experts=32,
    )


def _layer(i: int, tokens: int, compile_s: float) -> dict[str, Any]:
    attention, mlp = KINDS[i]
    chunks = tokens // (4 * 2048)
    observed = mlp == "moe"
    recomputed = chunks // 2 if observed else chunks
    weights = int((7.3 if observed else 0.4) * GB)
    stream = tokens * 4 * 4096 * 2
    o, f = RATES[f"{attention}+{mlp}"]
    load = LOAD_S_PER_GB * weights / GB
    parts_s, parts_bytes = {}, {}
    observe_s = advance_s = 0.0
    if observed:
        io = stream + stream * (chunks - recomputed) / chunks
        parts_s = {"observe.load": load, "observe.read": STREAM_S_PER_GB * stream / GB}
        parts_s["observe.write"] = STREAM_S_PER_GB * (io - stream) / GB
        parts_bytes = {"observe.load": weights, "observe.read": stream, "observe.write": int(io - stream)}
        observe_s = tokens * o + load + STREAM_S_PER_GB * io / GB + compile_s
    moved = 2 * stream * recomputed / chunks
    parts_s.update(
        {"advance.read": STREAM_S_PER_GB * moved / 2 / GB, "advance.write": STREAM_S_PER_GB * moved / 2 / GB}
    )
    parts_bytes.update({"advance.read": int(moved / 2), "advance.write": int(moved / 2)})
    if not observed:
        parts_s["advance.load"], parts_bytes["advance.load"] = load, weights
        advance_s = load + compile_s
    advance_s += tokens * f * recomputed / chunks + STREAM_S_PER_GB * moved / GB
    cost = {
        "observe_s": observe_s,
        "advance_s": advance_s,
        "recomputed_chunks": recomputed,
        "chunks": chunks,
        "peak_device_bytes": 20 * GB,
        "load_bytes": weights,
        "parts_s": parts_s,
        "parts_bytes": parts_bytes,
    }
    return {"layer": i, "attention": attention, "mlp": mlp, "cost": cost}


def _record(tokens: int) -> dict[str, Any]:
    layers = [_layer(i, tokens, 30.0 if i == 0 else 0.0) for i in range(len(KINDS))]
    encoded = [{"layer": 3, "tensors": 384, "seconds": 60.0}, {"layer": 4, "tensors": 384, "seconds": 38.4}]
    for layer in encoded:
        layer["peak_gpu_bytes"] = 30 * GB
    build = {
        "observation": {"layers": layers, "peak_device_bytes": 30 * GB},
        "encode_layers": encoded,
        "finish": {"seconds": 20.0},
        "artifact_bytes": 8 * GB,
        "observation_disk_peak_bytes": GB,
        "peak_host_rss_bytes": 3 * GB,
    }
    other = {"peak_host_rss_bytes": GB}
    return {
        "stages": {
            "build": build,
            "verify": {**other, "wall_s": 5.0, "bytes_read": 8 * GB},
            "runtime": {**other, "decode_s_per_token": 0.05, "backend": "triton"},
        }
    }


def _with_checkpoints(record: dict[str, Any], waited_s: float, writer_s: float | None = None) -> dict[str, Any]:
    """`record` with a 1 GB device-stream checkpoint in every layer: the run's wait for it and, when given, the
    writer's own time."""
    for layer in record["stages"]["build"]["observation"]["layers"]:
        cost = layer["cost"]
        cost["parts_s"]["advance.checkpoint"], cost["parts_bytes"]["advance.checkpoint"] = waited_s, int(GB)
        cost["advance_s"] += waited_s
        if writer_s is not None:
            cost["parts_s"]["checkpoint.write"], cost["parts_bytes"]["checkpoint.write"] = writer_s, int(GB)
    return record


@pytest.mark.slow
def test_fixed_costs_do_not_scale_with_the_rehearsal_tokens() -> None:
    short, short_full = extrapolate(_args(8), _record(8 * 2048))
    long, long_full = extrapolate(_args(16), _record(16 * 2048))
    assert short["observe_s"]["value"] == pytest.approx(long["observe_s"]["value"], rel=1e-3)
    inputs = long["observe_s"]["inputs"]
    assert inputs["load_s_per_gb"] == pytest.approx(LOAD_S_PER_GB, rel=1e-3)
    assert inputs["stream_s_per_gb"] == pytest.approx(STREAM_S_PER_GB, rel=1e-3)
    assert inputs["first_calls_s"] == pytest.approx(30.0, abs=0.01)
    assert inputs["rates_us_per_token"]["kda+moe"] == pytest.approx({"o": 8.0, "f": 4.0}, rel=1e-3)
    # a weight load is paid once per layer, whatever the token count: λ × W with W the 45 layers' weights
    assert inputs["load_s"] == pytest.approx(LOAD_S_PER_GB * inputs["W_gb"], rel=1e-3)
    parts = long_full["observe_parts_h"]
    assert sum(parts.values()) == pytest.approx(long_full["observe_h"], abs=0.005)
    assert {"observe_h", "encode_h", "peak_host_rss_gb", "peak_gpu_gb", "observation_disk_gb"} <= set(long_full)
    # encode: the warm layer's seconds per tensor (0.1 s), the first layer's extra counted once
    encode = long["encode_s"]["inputs"]
    assert encode["s_tensor"] == pytest.approx(0.1) and encode["first_layer_extra_s"] == pytest.approx(21.6)
    assert short_full["encode_h"] == long_full["encode_h"]


@pytest.mark.slow
def test_device_streams_project_their_checkpoints_not_a_disk_round_trip_per_layer() -> None:
    args = _args(16)
    args.device_streams_every = 8
    record = _with_checkpoints(_record(16 * 2048), waited_s=0.5)  # recorded before the writer had its own thread
    extrapolation, full = extrapolate(args, record)
    inputs = extrapolation["observe_s"]["inputs"]
    s_full = extrapolation["stream_bytes_per_layer_gb"]["value"]
    assert extrapolation["recompute_fraction"]["value"] == 0 and inputs["streams"] == "device"
    assert inputs["stream_s_per_gb"] == pytest.approx(0.5)
    assert inputs["streams_moved_gb"] == pytest.approx(5 * s_full, abs=0.1)  # layers 8, 16, 24, 32, 40
    # the older checkpoint beside the one written during the encode; a disk without that room: the first one only
    assert full["observation_disk_gb"] == pytest.approx(2 * s_full, abs=0.02)
    assert full["one_checkpoint"]["observation_disk_gb"] == pytest.approx(s_full, abs=0.02)
    assert extrapolation["peak_gpu_gb"]["inputs"]["streams_held_extra_gb"] == pytest.approx(
        s_full - 16 * 2048 * 4 * 4096 * 2 / GB, abs=0.01
    )


@pytest.mark.slow
def test_checkpoints_written_during_the_encode_cost_only_what_it_does_not_cover() -> None:
    """The writer's own rate σ (`checkpoint.write`) prices each checkpoint; one after a MoE layer is written while
    the build encodes that layer (288 experts x 12 slices x 0.1 s here), so none of it is waited for, and one after
    a dense layer (layers 1, 2 and 3 follow the dense layers 0-2) is waited for whole."""
    args = _args(16)
    args.device_streams_every = 1
    record = _with_checkpoints(_record(16 * 2048), waited_s=0.1, writer_s=2.0)
    extrapolation, full = extrapolate(args, record)
    inputs = extrapolation["observe_s"]["inputs"]
    s_full = extrapolation["stream_bytes_per_layer_gb"]["value"]
    assert inputs["stream_s_per_gb"] == pytest.approx(2.0)  # the writer's, not the run's 0.1 s wait
    assert inputs["checkpoints"] == 44 and inputs["checkpoints_after_moe"] == 41
    assert inputs["encode_layer_s"] == pytest.approx(288 * 12 * 0.1)  # 345.6 s > σ × S = 114.9 s: covered
    assert inputs["stream_io_s"] == pytest.approx(44 * 2.0 * s_full, rel=1e-3)  # what the writer does
    assert inputs["stream_io_waited_s"] == pytest.approx(3 * 2.0 * s_full, rel=1e-3)  # what the run waits for
    assert full["observe_parts_h"]["stream_io"] == pytest.approx(3 * 2.0 * s_full / 3600, abs=1e-3)
    # without room for two checkpoints only the first is written, waited whole: one where three were waited for
    one = extrapolation["observe_one_checkpoint_s"]["value"]
    assert extrapolation["observe_s"]["value"] - one == pytest.approx(2 * 2.0 * s_full, rel=1e-3)
    assert full["one_checkpoint"]["observe_h"] == pytest.approx(one / 3600, abs=1e-3)
    # a killed run recomputes at most every layer's plain forward (rates f, no hooks), loads every layer and pays a
    # fresh process's first calls
    tokens = extrapolation["tokens"]["value"]
    forward_s = sum(n * tokens * inputs["rates_us_per_token"][k]["f"] / 1e6 for k, n in inputs["n_k"].items())
    want = forward_s + inputs["load_s"] + inputs["first_calls_s"]
    assert full["resume_recompute_at_most_h"] == pytest.approx(want / 3600, abs=1e-3)
    assert full["resume_recompute_at_most_h"] < full["observe_parts_h"]["forward"]  # the hooks' share saved


@pytest.mark.slow
def test_a_timed_resume_prices_the_recompute_with_its_plain_forward_and_its_own_first_calls() -> None:
    """A rehearsal's resume stage (each layer's plain forward from the embeddings, in a fresh process) replaces the
    observing pass's rates in the recompute: f_k its warm per-token rate, and its first calls what its time holds
    beyond the warm rates (here a cold first load of 12 s) instead of the observation's."""
    args = _args(16)
    args.device_streams_every = 8
    tokens = 16 * 2048
    record = _with_checkpoints(_record(tokens), waited_s=0.1, writer_s=2.0)
    for layer in record["stages"]["build"]["observation"]["layers"]:
        if layer["mlp"] == "moe":  # device streams: the observing pass writes every output, none is recomputed
            layer["cost"]["recomputed_chunks"] = 0
    resume_layers: list[dict[str, Any]] = []
    for i, (attention, mlp) in enumerate(KINDS):
        weights = int((7.3 if mlp == "moe" else 0.4) * GB)
        load = LOAD_S_PER_GB * weights / GB + (12.0 if i == 0 else 0.0)
        forward = tokens * RATES[f"{attention}+{mlp}"][1] / 2  # half the forward rate of RATES
        cost = {
            "observe_s": 0.0,
            "advance_s": load + forward,
            "recomputed_chunks": 4,
            "chunks": 4,
            "parts_s": {"advance.load": load, "advance.read": 0.0, "advance.write": 0.0},
            "parts_bytes": {"advance.load": weights, "advance.read": 1, "advance.write": 1},
        }
        resume_layers.append({"layer": i, "attention": attention, "mlp": mlp, "cost": cost})
    embed_s = 0.5
    recompute_s = embed_s + sum(layer["cost"]["advance_s"] for layer in resume_layers)
    resume = {"open_s": 3.0, "recompute_s": recompute_s, "embed_s": embed_s, "layers": resume_layers}
    record["stages"]["resume"] = resume
    extrapolation, full = extrapolate(args, record)
    figure = extrapolation["resume_recompute_at_most_s"]
    inputs = figure["inputs"]
    assert inputs["measured"] == "resume stage" and inputs["first_calls_s"] == pytest.approx(12.0, abs=0.01)
    assert inputs["rates_us_per_token"]["kda+moe"] == pytest.approx(2.0)  # the resume's, not the observing pass's 8
    assert inputs["rates_us_per_token"]["kda+dense"] == pytest.approx(2.0)  # the build's own plain forward
    t_full = extrapolation["tokens"]["value"]
    n_k = extrapolation["observe_s"]["inputs"]["n_k"]
    forward_s = sum(n * t_full * inputs["rates_us_per_token"][k] / 1e6 for k, n in n_k.items())
    fixed = 12.0 + 3.0 + embed_s * t_full / tokens
    assert inputs["fixed_s"] == pytest.approx(fixed, abs=0.01)
    want = forward_s + extrapolation["observe_s"]["inputs"]["load_s"] + fixed
    assert figure["value"] == pytest.approx(want, abs=0.1)  # load_s is rounded to 0.1 s in the inputs
    assert full["resume_recompute_at_most_h"] == pytest.approx(want / 3600, abs=1e-3)
    # the observation's own projection does not move: device streams recompute nothing while observing
    without = dict(record, stages={k: v for k, v in record["stages"].items() if k != "resume"})
    assert extrapolate(args, without)[0]["observe_s"]["value"] == extrapolation["observe_s"]["value"]
