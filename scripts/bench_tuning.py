"""Wall time of `encode --tune-scales` at GLM-5.3-Flash's real width, on one work unit (issue 17's open cost).

Tuning fits the stored scales of a unit's routed experts (`glmquant.encode.scale_tuning`); its cost depends on the
shapes and the number of sampled tokens routed to the unit, not on the codes' values. So this builds one unit of
real-shape experts (GLM-5.3-Flash's config, tests/data: hidden 4096, intermediate 2048, plain layout: gate, up, down
per expert) with random K2 codes and random BF16 weights, a sample of `--tuning-tokens` tokens routed top-k over the
layer's experts (the unit's share
taken with `RoutedSample.routed_to`, as encode does), and times `tune_unit_scales` for `--steps` steps. The layer and
model figures are projections (formula in the JSON): units per layer x the unit's time, x the MoE layers. Writes
bench/results/tuning_<gpu>.json.

With `--source MODEL --observations DIR` it tunes a real unit instead, to see how the tuning converges: the unit
`--unit` of MoE layer `--layer`, read and encoded as `glmquant encode` does (K from `--tiers`, or `--bits`), its
scales then tuned from the same encode once per `--learning-rates` value, every step's held-out error recorded
(`heldout_by_step`), with the step at which each run first comes within 5 % / 1 % of the largest gain of any run.

    python scripts/bench_tuning.py --device cuda            # ~1 minute on an H200
    python scripts/bench_tuning.py --device cpu --experts-per-unit 2 --tuning-tokens 512 --steps 2   # a smoke run
    python scripts/bench_tuning.py --device cpu --source PROXY/model --observations OBS --layer 1 \
        --tiers depth:K3=1,K2=rest,K1=1 --learning-rates 2e-3,5e-3,1e-2 --out tuning_convergence.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from bench_common import ROOT, provenance
from rich.console import Console

from glmquant.arch import ModelSpec, load_model_spec
from glmquant.arch.table import PROJECTIONS
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.config import EncodeConfig
from glmquant.encode.hessians import HessianSource
from glmquant.encode.layer import encode_unit, layer_units, read_unit
from glmquant.encode.provenance import observed_calibration
from glmquant.encode.run import EncodeJob
from glmquant.encode.scale_tuning import LEARNING_RATE, ExpertPart, UnitTuning, tune_unit_scales
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.tensor import EXL3Tensor
from glmquant.observe.tuning_sample import RoutedSample

CONFIG = ROOT / "tests/data/glm-5.3-flash/config.json"


def hf_shape(spec: ModelSpec, proj: str) -> tuple[int, int]:
    """A routed expert's projection as HF (out, in)."""
    hidden, inter = spec.hidden_size, spec.moe_intermediate_size
    return (hidden, inter) if proj == "down_proj" else (inter, hidden)


def random_part(spec: ModelSpec, proj: str, gen: torch.Generator, bits: int) -> ExpertPart:
    """A real-shape K-bit EXL3 tensor with random codes and scales that decode to weights of RMS ~0.02."""
    out_f, in_f = hf_shape(spec, proj)
    trellis = torch.randint(-(2**15), 2**15, (in_f // 16, out_f // 16, 16 * bits), generator=gen, dtype=torch.int32)
    suh = (0.02 * (1 + 0.1 * torch.rand(in_f, generator=gen))).half()
    svh = (1 + 0.1 * torch.rand(out_f, generator=gen)).half()
    return ExpertPart(proj, None, EXL3Tensor(trellis.to(torch.int16), suh, svh, Codebook.MCG, in_f, out_f))


def random_weights(spec: ModelSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {p: (0.02 * torch.randn(hf_shape(spec, p), generator=gen)).bfloat16() for p in PROJECTIONS}


def random_sample(spec: ModelSpec, tokens: int, gen: torch.Generator) -> RoutedSample:
    top_k = spec.num_experts_per_tok
    ids = torch.stack([torch.randperm(spec.n_routed_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    inputs = torch.randn(tokens, spec.hidden_size, generator=gen).bfloat16()
    return RoutedSample(inputs, ids, weights / weights.sum(1, keepdim=True))


def real_unit(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Tune one unit of a real encode once per learning rate, from the same codes: the convergence record."""
    with tempfile.TemporaryDirectory() as tmp, SourceCheckpoint.open(args.source) as source:
        cfg = EncodeConfig(
            source=args.source,
            out=Path(tmp) / "out",
            observations=args.observations,
            bits=args.bits,
            tiers=args.tiers,
            experts_per_unit=args.experts_per_unit,
            tune_scales=args.steps,
            device=args.device,
        )
        plan = EncodeJob(cfg, source, observed_calibration(cfg), Console(quiet=True)).plan
        unit = layer_units(plan, args.layer, args.experts_per_unit)[args.unit]
        hessians = HessianSource(args.observations, "natural").layer(args.layer)
        inputs = read_unit(plan, args.layer, unit, source, hessians, args.steps)
    assert inputs.tuning is not None and inputs.slices is not None
    start = time.perf_counter()
    encoded = encode_unit(replace(inputs, tuning=None), None, plan.codebook, cfg.seed, args.device)
    encode_s = time.perf_counter() - start
    experts: dict[int, list[ExpertPart]] = {}
    for name, s, (weight, _) in zip(inputs.names, inputs.slices, inputs.items):
        tensor = EXL3Tensor.from_tensors(encoded.tensors, name, weight.shape[1], weight.shape[0])
        experts.setdefault(s.source_expert, []).append(ExpertPart(s.proj, s.rank, tensor))
    runs = []
    for lr in args.learning_rates:
        start = time.perf_counter()
        outcome = tune_unit_scales(experts, replace(inputs.tuning, learning_rate=lr), device)
        runs.append(
            {
                "learning_rate": lr,
                "unit_s": round(time.perf_counter() - start, 2),
                "heldout_before": outcome.heldout_before,
                "heldout_after": outcome.heldout_after,
                "best_step": outcome.best_step,
                "heldout_by_step": outcome.heldout_by_step,
            }
        )
    before = runs[0]["heldout_before"]
    gain = before - min(r["heldout_after"] for r in runs)
    for r in runs:  # the first step within 5 % / 1 % of the best gain of any run (None: never)
        curve = r["heldout_by_step"]
        for share in (0.95, 0.99):
            reached = [i for i, e in enumerate(curve) if before - e >= share * gain]
            r[f"step_to_{round(share * 100)}pct"] = reached[0] if reached else None
    return {
        "mode": "real_unit",
        "source": str(args.source),
        "observations": str(args.observations),
        "layer": args.layer,
        "unit": args.unit,
        "bits": sorted(set(inputs.bits or [])),
        "experts": len(experts),
        "unit_tokens": int(inputs.tuning.sample.inputs.shape[0]),
        "unit_expert_token_pairs": int((inputs.tuning.sample.expert_ids >= 0).sum()),
        "steps": args.steps,
        "encode_s": round(encode_s, 2),
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--experts-per-unit", type=int, default=EncodeConfig.experts_per_unit, help="encode's default work unit"
    )
    ap.add_argument("--tuning-tokens", type=int, default=8192, help="observe --tuning-tokens (the recipe's value)")
    ap.add_argument("--steps", type=int, default=50, help="encode --tune-scales (the recipe's value)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results file (default bench/results/tuning_<gpu>.json)")
    ap.add_argument("--commit", default=None, help="commit of the code run (default: git HEAD here)")
    ap.add_argument("--source", type=Path, default=None, help="a real unit: the source checkpoint")
    ap.add_argument("--observations", type=Path, default=None, help="a real unit: observe's output (--tuning-tokens)")
    ap.add_argument("--layer", type=int, default=None, help="a real unit: its MoE layer")
    ap.add_argument("--unit", type=int, default=0, help="a real unit: its index in the layer")
    ap.add_argument("--tiers", default=None, help="a real unit: encode --tiers (else --bits)")
    ap.add_argument(
        "--learning-rates",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[LEARNING_RATE],
        help="a real unit: comma-separated Adam learning rates, one tuning each",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    if args.source is not None:
        if args.observations is None or args.layer is None:
            ap.error("--source needs --observations and --layer")
        record = {"bench": "tuning", **provenance(device.type), "gpu": gpu, **real_unit(args, device)}
        out = args.out or ROOT / "bench" / "results" / f"tuning_convergence_{gpu.split()[-1].lower()}.json"
        write(out, record | ({"commit": args.commit} if args.commit else {}))
        return
    spec = load_model_spec(CONFIG)
    gen = torch.Generator().manual_seed(0)
    unit = list(range(args.experts_per_unit))
    parts = {e: [random_part(spec, p, gen, args.bits) for p in PROJECTIONS] for e in unit}
    weights = {e: random_weights(spec, gen) for e in unit}
    sample = random_sample(spec, args.tuning_tokens, gen).routed_to(unit)
    pairs = int((sample.expert_ids >= 0).sum())
    tuning = UnitTuning(args.steps, spec.swiglu_limit, weights, sample)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outcome = tune_unit_scales(parts, tuning, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    unit_s = time.perf_counter() - start
    units_per_layer = spec.n_routed_experts / args.experts_per_unit  # a last, smaller unit costs its share
    moe_layers = len(spec.moe_layers)
    layer_s = unit_s * units_per_layer
    result = {
        "bench": "tuning",
        **provenance(device.type),
        "gpu": gpu,
        "shape": {
            "hidden": spec.hidden_size,
            "intermediate": spec.moe_intermediate_size,
            "experts": spec.n_routed_experts,
            "top_k": spec.num_experts_per_tok,
            "bits": args.bits,
        },
        "experts_per_unit": args.experts_per_unit,
        "tuning_tokens": args.tuning_tokens,
        "unit_tokens": int(sample.inputs.shape[0]),
        "unit_expert_token_pairs": pairs,
        "steps": args.steps,
        "unit_s": round(unit_s, 2),
        "heldout_before": outcome.heldout_before,
        "heldout_after": outcome.heldout_after,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "projected_layer_s": round(layer_s, 1),
        "projected_model_min": round(layer_s * moe_layers / 60, 1),
        "projection_formula": f"unit_s x {spec.n_routed_experts} / experts_per_unit per layer, "
        f"x {moe_layers} MoE layers",
    }
    if args.commit:
        result["commit"] = args.commit
    write(args.out or ROOT / "bench" / "results" / f"tuning_{gpu.split()[-1].lower()}.json", result)


def write(out: Path, record: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
