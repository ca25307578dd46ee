"""Wall time of `encode --tune-scales` at GLM-5.3-Flash's real width, on one work unit (issue 17's open cost).

Tuning fits the stored scales of a unit's routed experts (`glmquant.encode.scale_tuning`); its cost depends on the
shapes and the number of sampled tokens routed to the unit, not on the codes' values. So this builds one unit of
real-shape experts (GLM-5.3-Flash's config, tests/data: hidden 4096, intermediate 2048, plain layout: gate, up, down
per expert) with random K2 codes and random BF16 weights, a sample of `--tuning-tokens` tokens routed top-k over the
layer's experts (the unit's share
taken with `RoutedSample.routed_to`, as encode does), and times `tune_unit_scales` for `--steps` steps. The layer and
model figures are projections (formula in the JSON): units per layer x the unit's time, x the MoE layers. Writes
bench/results/tuning_<gpu>.json.

    python scripts/bench_tuning.py --device cuda            # ~1 minute on an H200
    python scripts/bench_tuning.py --device cpu --experts-per-unit 2 --tuning-tokens 512 --steps 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from bench_common import ROOT, provenance

from glmquant.arch import ModelSpec, load_model_spec
from glmquant.arch.table import PROJECTIONS
from glmquant.encode.config import EncodeConfig
from glmquant.encode.scale_tuning import ExpertPart, UnitTuning, tune_unit_scales
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--experts-per-unit", type=int, default=EncodeConfig.experts_per_unit, help="encode's default work unit"
    )
    ap.add_argument("--tuning-tokens", type=int, default=8192, help="observe --tuning-tokens (the recipe's value)")
    ap.add_argument("--steps", type=int, default=100, help="encode --tune-scales (the recipe's value)")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results file (default bench/results/tuning_<gpu>.json)")
    ap.add_argument("--commit", default=None, help="commit of the code run (default: git HEAD here)")
    args = ap.parse_args()
    device = torch.device(args.device)
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
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
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
    out = args.out or ROOT / "bench" / "results" / f"tuning_{gpu.split()[-1].lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
