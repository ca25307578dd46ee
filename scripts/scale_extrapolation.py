"""From a scale rehearsal (bench_scale.py) to the full model: every figure with its formula and inputs.

docs/scale.md derives the formulas. Symbols: T tokens of calibration (rehearsal: the run's recipe; full: the
full recipe), n_k layers of kind k (attention + MLP, e.g. kda+moe), S bytes of one layer's hidden streams
(T x hc x H x 2), B the stream budget, E routed experts per MoE layer, H hidden, I expert intermediate, W bytes
of the decoder layers' weights. A layer's observation time is split (observe/run.py records the parts) into a
per-token forward (o_k, f_k), a per-layer weight load (λ s/byte x the layer's bytes: a fixed cost per layer, which a
short rehearsal must not divide by its few tokens) and stream chunk I/O (σ s/byte x the bytes moved, per token).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

GB = 1e9
TR3_SLICES_PER_EXPERT = 12  # gate, up, down x 4 rank slices


def figure(value: float, formula: str, **inputs: Any) -> dict[str, Any]:
    return {"value": round(value, 4), "formula": formula, "inputs": inputs}


def layer_kind(layer: dict[str, Any]) -> str:
    return f"{layer['attention']}+{layer['mlp']}"


def recipe_tokens(recipe, rows: int | None = None, tokens: int | None = None) -> int:
    from glmquant.calibration import load_recipe

    return sum(lane.rows * lane.tokens for lane in load_recipe(recipe).with_shape(rows, tokens).lanes)


PARTS = ("load", "read", "write", "checkpoint")
DISK_PARTS = ("read", "write")  # the stream parts of disk streams that touch the disk


def part(cost: dict[str, Any], stage: str, name: str, key: str = "parts_s") -> float:
    """Seconds (or bytes, key="parts_bytes") a pass spent on one of its parts (0 when not recorded)."""
    return cost.get(key, {}).get(f"{stage}.{name}", 0)


def compute_s(cost: dict[str, Any], stage: str) -> float:
    """A pass's forward-with-hooks time: its wall time less its weight loads and stream reads and writes."""
    return max(cost[f"{stage}_s"] - sum(part(cost, stage, name) for name in PARTS), 0.0)


def rates(layers: list[dict[str, Any]], tokens: int, plain: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per layer kind, the warm (fastest layer of the kind) forward seconds per calibration token, weight loads and
    stream reads and writes excluded: o of the observing pass (hooks on), f of a plain forward (the advancing pass
    per chunk it computed; a kind whose chunks all fitted gets the resume stage's rate from `plain`, else o, an upper
    bound)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        cost = layer["cost"]
        observe = compute_s(cost, "observe") / tokens
        computed = cost["recomputed_chunks"] / max(cost["chunks"], 1)
        forward = compute_s(cost, "advance") / (tokens * computed) if computed else None
        kind = out.setdefault(layer_kind(layer), {"observe": observe, "forward": forward, "observed": observe > 0})
        kind["observe"] = min(kind["observe"], observe)
        if forward is not None:
            kind["forward"] = forward if kind["forward"] is None else min(kind["forward"], forward)
    for name, kind in out.items():
        if kind["forward"] is None:
            kind["forward"] = plain.get(name, kind["observe"])
    return out


def plain_forward_rates(resume: dict[str, Any], tokens: int) -> dict[str, float]:
    """Per layer kind, the warm (fastest layer of the kind) seconds per calibration token of the resume stage's plain
    forward (a layer's advance less its weight load and stream parts)."""
    out: dict[str, float] = {}
    for layer in resume["layers"]:
        rate = compute_s(layer["cost"], "advance") / tokens
        out[layer_kind(layer)] = min(out.get(layer_kind(layer), rate), rate)
    return out


def load_rate(layers: list[dict[str, Any]]) -> float:
    """Warm seconds per byte of loading a layer's weights onto the device (the fastest layer)."""
    per_byte = [
        sum(part(layer["cost"], stage, "load") for stage in ("observe", "advance"))
        / sum(part(layer["cost"], stage, "load", "parts_bytes") for stage in ("observe", "advance"))
        for layer in layers
        if any(part(layer["cost"], stage, "load", "parts_bytes") for stage in ("observe", "advance"))
    ]
    return min(per_byte, default=0.0)


def stream_rate(layers: list[dict[str, Any]], names: tuple[str, ...]) -> float:
    """Seconds per byte of stream chunks moved between disk and the device (the parts `names`, all layers)."""
    moved = [(layer["cost"], stage, name) for layer in layers for stage in ("observe", "advance") for name in names]
    nbytes = sum(part(c, stage, name, "parts_bytes") for c, stage, name in moved)
    return sum(part(c, stage, name) for c, stage, name in moved) / nbytes if nbytes else 0.0


def checkpoint_rate(layers: list[dict[str, Any]]) -> float:
    """Seconds per byte the device streams' checkpoint writer takes (its own time, `checkpoint.write`, whether or not
    the run waited for it; a record from before the writer had a thread of its own has the run's wait only, which
    was the whole write)."""
    costs = [layer["cost"] for layer in layers]
    nbytes = sum(part(c, "checkpoint", "write", "parts_bytes") for c in costs)
    if nbytes:
        return sum(part(c, "checkpoint", "write") for c in costs) / nbytes
    return stream_rate(layers, ("checkpoint",))


def modelled_s(layer: dict[str, Any], per: dict[str, dict[str, Any]], tokens: int, lam: float) -> float:
    """What the warm rates give for one rehearsal layer, its stream I/O as measured (its measured time less this is
    first-call overhead: compiles, imports, a cold first weight load)."""
    cost, rate = layer["cost"], per[layer_kind(layer)]
    share = cost["recomputed_chunks"] / max(cost["chunks"], 1)
    stages = ("observe", "advance")
    loaded = sum(part(cost, stage, "load", "parts_bytes") for stage in stages)
    moved_s = sum(part(cost, stage, name) for stage in stages for name in PARTS[1:])
    return tokens * (rate["observe"] + share * rate["forward"]) + lam * loaded + moved_s


def layer_bytes(spec, layer: int) -> int:
    """Source bytes of one decoder layer's weights (what loading it reads)."""
    from glmquant.arch import table_for

    return sum(t.nbytes for t in table_for(spec).layer_tensors(spec, layer))


def extrapolate(args: argparse.Namespace, record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from glmquant.arch import load_model_spec
    from glmquant.checkpoint.layouts import plan_artifact
    from glmquant.encode.config import EncodeConfig

    build, verify, runtime = (record["stages"][s] for s in ("build", "verify", "runtime"))
    layers = build["observation"]["layers"]
    full = load_model_spec(args.full_config)
    t_run = recipe_tokens(args.recipe, args.rows, args.tokens)
    t_full = recipe_tokens(args.full_recipe)
    hc = int(full.text.get("hc_mult", 1))
    s_full = t_full * hc * full.hidden_size * 2
    budget = args.full_stream_budget_gb * GB
    every = getattr(args, "device_streams_every", None)  # None: disk streams
    device_streams = every is not None
    r_full = 0.0 if device_streams else min(max((2 * s_full - budget) / s_full, 0.0), 1.0)
    kinds = Counter(
        f"{a}+{'moe' if m == 'sparse' else 'dense'}" for a, m in zip(full.attention_types, full.mlp_layer_types)
    )
    resume = record["stages"].get("resume")  # a device-stream rehearsal's timed recompute
    plain = plain_forward_rates(resume, t_run) if resume is not None else {}
    per = rates(layers, t_run, plain)
    missing = sorted(set(kinds) - set(per))
    if missing:
        raise SystemExit(f"the rehearsal has no layer of kind(s) {missing}: use more --layers")
    lam = load_rate(layers)
    sigma = checkpoint_rate(layers) if device_streams else stream_rate(layers, DISK_PARTS)
    measured = sum(layer["cost"]["observe_s"] + layer["cost"]["advance_s"] for layer in layers)
    first_calls = max(measured - sum(modelled_s(layer, per, t_run, lam) for layer in layers), 0.0)
    compute_full = sum(
        n * t_full * (per[k]["observe"] + r_full * per[k]["forward"] if per[k]["observed"] else per[k]["forward"])
        for k, n in kinds.items()
    )
    weights_full = sum(layer_bytes(full, i) for i in range(full.num_hidden_layers))

    encoded = build["encode_layers"]
    s_per_tensor = min(layer["seconds"] / layer["tensors"] for layer in encoded)  # warm: the fastest layer
    encode_first = max(
        sum(layer["seconds"] for layer in encoded) - s_per_tensor * sum(x["tensors"] for x in encoded), 0
    )
    batch_experts = min(args.encode_experts, EncodeConfig.experts_per_unit)
    encode_layer_s = full.n_routed_experts * TR3_SLICES_PER_EXPERT * s_per_tensor
    tensors_full = len(full.moe_layers) * full.n_routed_experts * TR3_SLICES_PER_EXPERT
    artifact_full = sum(f.size for f in plan_artifact(full, "tr3").files)
    finish_full = build["finish"]["seconds"] * artifact_full / build["artifact_bytes"]
    encode_s = tensors_full * s_per_tensor + finish_full + encode_first

    # device streams: only the checkpoints touch the disk (the streams entering every `every`-th layer), each written
    # while the build encodes the MoE layer before it, so only what the encode does not cover is waited for
    checkpoints = [i for i in range(1, full.num_hidden_layers) if every and i % every == 0]
    after_moe = [i for i in checkpoints if i - 1 in full.moe_layers]
    passes = sum(n * (2.0 + r_full if per[k]["observed"] else 2.0) for k, n in kinds.items())
    moved_full = (len(checkpoints) if device_streams else passes) * s_full
    if device_streams:
        waited_s = (len(checkpoints) - len(after_moe)) * sigma * s_full
        waited_s += len(after_moe) * max(sigma * s_full - encode_layer_s, 0.0)
    else:
        waited_s = sigma * moved_full
    observe_s = compute_full + lam * weights_full + waited_s + first_calls
    # a disk with room for one checkpoint but not for the overlap (2S free beside the older one) writes only the
    # first, after a layer's results (waited whole), and skips the rest; with room for none, nothing is waited for
    one_checkpoint_s = observe_s - waited_s + (sigma * s_full if checkpoints else 0.0)
    # a killed run recomputes the streams entering its next layer from its newest checkpoint or the embeddings: from
    # the embeddings through every layer, a fresh process's first calls included; the resume stage measured that
    # recompute on the rehearsal (its plain forward rates and its own first calls), older records did not
    if resume is not None:
        modelled_resume = sum(  # warm: a cold first load counts among the first calls
            t_run * plain[layer_kind(layer)]
            + lam * part(layer["cost"], "advance", "load", "parts_bytes")
            + sum(part(layer["cost"], "advance", name) for name in ("read", "write"))
            for layer in resume["layers"]
        )
        resume_first_calls = max(resume["recompute_s"] - resume["embed_s"] - modelled_resume, 0.0)
        resume_fixed = resume_first_calls + resume["open_s"] + resume["embed_s"] * t_full / t_run
    else:
        resume_first_calls, resume_fixed = first_calls, first_calls
    resume_at_most_s = t_full * sum(n * per[k]["forward"] for k, n in kinds.items()) + lam * weights_full + resume_fixed

    e_run = max(1, args.experts or full.n_routed_experts)
    h, i = full.hidden_size, full.moe_intermediate_size
    per_expert_gpu = 3 * h * i * 2 + (h * h + i * i) * 4  # BF16 weights + natural Hessian sums (F32)
    peak_gpu_run = max(
        [build["observation"]["peak_device_bytes"] or 0]
        + [encoded_layer["peak_gpu_bytes"] or 0 for encoded_layer in encoded]
    )
    s_run = t_run * hc * full.hidden_size * 2
    held = s_full - s_run if device_streams else 0  # device streams: one layer's streams on the GPU
    peak_gpu_full = peak_gpu_run + max(full.n_routed_experts - e_run, 0) * per_expert_gpu + held
    disk_streams = min(2 * s_full, max(budget, s_full))  # the stream files
    # device streams: the older checkpoint and the one written beside the encode
    streams_peak = (2 * s_full if every else 0) if device_streams else disk_streams
    small_files = t_full * 4 + len(full.moe_layers) * full.n_routed_experts * 11 * 8
    disk = streams_peak + small_files
    disk_one_checkpoint = s_full + small_files
    rss = max(record["stages"][s]["peak_host_rss_bytes"] for s in ("build", "verify", "runtime"))
    verify_s = verify["wall_s"] * artifact_full / max(verify["bytes_read"], 1)

    extrapolation = {
        "tokens": figure(
            t_full, "Σ_lanes rows × tokens of the full recipe", recipe=str(args.full_recipe), rehearsal_tokens=t_run
        ),
        "stream_bytes_per_layer_gb": figure(s_full / GB, "S = T × hc × H × 2 B", T=t_full, hc=hc, H=full.hidden_size),
        "recompute_fraction": figure(
            r_full,
            "r = 0: device streams, each output chunk replaces its input"
            if device_streams
            else "r = clamp((2S − B) / S, 0, 1): output chunks past the budget",
            S_gb=s_full / GB,
            B_gb=budget / GB,
        ),
        "observe_s": figure(
            observe_s,
            "Σ_k n_k × T × (o_k + r × f_k) over observed kinds, n_k × T × f_k over the others (forward with hooks, "
            "per token) + λ × W (weight loads, once per layer: the observing pass keeps the layer for the recompute) "
            + (
                "+ Σ_checkpoints max(σ × S − e, 0) (device streams: the streams entering every `every`-th layer "
                "written to disk at the writer's measured rate σ while the build encodes the layer before, e = E × 12 "
                "× s_tensor after a MoE layer, 0 after a dense one: only the rest is waited for; needs 2S free "
                "beside the older checkpoint, else only the first is written, waited whole: "
                "`observe_one_checkpoint_s`) "
                if device_streams
                else "+ σ × (Σ_observed n_k × (2 + r) + Σ_other n_k × 2) × S (stream chunks read and written) "
            )
            + "+ first-call overhead (kernel compiles, imports: measured rehearsal time less what these rates give it)",
            streams="device" if device_streams else "disk",
            n_k=dict(kinds),
            rates_us_per_token={k: {"o": v["observe"] * 1e6, "f": v["forward"] * 1e6} for k, v in per.items()},
            compute_s=round(compute_full, 1),
            load_s_per_gb=round(lam * GB, 4),
            W_gb=round(weights_full / GB, 3),
            load_s=round(lam * weights_full, 1),
            stream_s_per_gb=round(sigma * GB, 4),
            streams_moved_gb=round(moved_full / GB, 1),
            stream_io_s=round(sigma * moved_full, 1),
            stream_io_waited_s=round(waited_s, 1),
            checkpoints=len(checkpoints) if device_streams else None,
            checkpoints_after_moe=len(after_moe) if device_streams else None,
            encode_layer_s=round(encode_layer_s, 1) if device_streams else None,
            first_calls_s=round(first_calls, 3),
            rehearsal_tokens=t_run,
        ),
        "encode_s": figure(
            encode_s,
            "n_moe × E × 12 rank slices × s_tensor (warm: the fastest encoded layer, batches of B experts) + finish "
            "× artifact / rehearsal artifact + first-layer overhead (compiles); an upper bound when B < 32, the "
            "batch the full encode uses",
            n_moe=len(full.moe_layers),
            E=full.n_routed_experts,
            s_tensor=s_per_tensor,
            B=batch_experts,
            first_layer_extra_s=round(encode_first, 3),
            finish_s=build["finish"]["seconds"],
            artifact_full_gb=artifact_full / GB,
            artifact_rehearsal_gb=build["artifact_bytes"] / GB,
        ),
        "verify_s": figure(verify_s, "verify wall × artifact_full / bytes verified", verify_s=verify["wall_s"]),
        "observation_disk_gb": figure(
            disk / GB,
            (
                "2S (the older checkpoint beside the one written during the encode; the run takes that path only "
                "with 2S free beside the older one, 3S in all; 0 without checkpoints)"
                if device_streams
                else "min(2S, max(B, S))"
            )
            + " streams + T × 4 B token rows + n_moe × E × 88 B statistics; no Hessians (fused build)",
            streams_gb=streams_peak / GB,
            rehearsal_peak_gb=build["observation_disk_peak_bytes"] / GB,
        ),
        **(
            {
                "observe_one_checkpoint_s": figure(
                    one_checkpoint_s,
                    "observe_s on a disk with S free but not 2S beside a checkpoint: the first due checkpoint written "
                    "after its layer's results and waited whole (σ × S), every later one skipped (a killed run "
                    "recomputes its streams from the first); less σ × S with less than S free (no checkpoint)",
                    sigma_s_per_gb=round(sigma * GB, 4),
                ),
                "observation_disk_one_checkpoint_gb": figure(
                    disk_one_checkpoint / GB, "S (one checkpoint) + T × 4 B + n_moe × E × 88 B"
                ),
                "resume_recompute_at_most_s": figure(
                    resume_at_most_s,
                    "Σ_k n_k × T × f_k + λ × W + fixed: a killed run's streams recomputed from the embeddings "
                    "through every layer; with the rehearsal's resume stage, f_k its plain forward and fixed its "
                    "model open + first calls + embeddings × T / T_run, else f_k the observing pass's rate and "
                    "fixed the observation's first calls (an upper bound); from a checkpoint: its read, σ × S, then "
                    "the layers since",
                    measured="resume stage" if resume is not None else None,
                    rates_us_per_token={k: v["forward"] * 1e6 for k, v in per.items()},
                    first_calls_s=round(resume_first_calls, 3),
                    fixed_s=round(resume_fixed, 3),
                    rehearsal_recompute_s=resume["recompute_s"] if resume is not None else None,
                ),
            }
            if device_streams and checkpoints
            else {}
        ),
        "two_step_hessians_gb": figure(
            len(full.moe_layers) * full.n_routed_experts * (h * h + i * i) * 4 / GB,
            "observe then encode instead: n_moe × E × (H² + I²) × 4 B of natural Hessians",
            H=h,
            I=i,
        ),
        "peak_gpu_gb": figure(
            peak_gpu_full / GB,
            "rehearsal peak + (E_full − E_run) × (3·H·I·2 + (H² + I²)·4) B"
            + (" + S_full − S_run (the streams held on the device)" if device_streams else "")
            + ": one layer at a time, so depth adds nothing",
            rehearsal_gb=peak_gpu_run / GB,
            streams_held_extra_gb=held / GB,
            E_run=e_run,
        ),
        "peak_host_rss_gb": figure(
            rss / GB,
            "max over build, verify, runtime of the rehearsal: one layer or one tensor at a time, independent of depth",
            stages=["build", "verify", "runtime"],
        ),
        "runtime_decode_s_per_token": figure(
            runtime["decode_s_per_token"],
            "measured on the rehearsal artifact (not extrapolated)",
            backend=runtime["backend"],
        ),
    }
    full_model = {
        "observe_h": round(observe_s / 3600, 3),
        "encode_h": round(encode_s / 3600, 3),
        "peak_host_rss_gb": round(rss / GB, 2),
        "peak_gpu_gb": round(peak_gpu_full / GB, 2),
        "observation_disk_gb": round(disk / GB, 2),
        **(
            {
                "one_checkpoint": {
                    "observe_h": round(one_checkpoint_s / 3600, 3),
                    "observation_disk_gb": round(disk_one_checkpoint / GB, 2),
                },
                "resume_recompute_at_most_h": round(resume_at_most_s / 3600, 3),
            }
            if device_streams and checkpoints
            else {}
        ),
        "observe_parts_h": {
            "forward": round(compute_full / 3600, 3),
            "weight_loads": round(lam * weights_full / 3600, 3),
            "stream_io": round(waited_s / 3600, 3),
            "first_calls": round(first_calls / 3600, 3),
        },
        "formulas": {k: v["formula"] for k, v in extrapolation.items()},
    }
    return extrapolation, full_model
