"""Encode throughput at real GLM-5.3-Flash expert shapes, projected to a whole layer and all 42 MoE layers.

A synthetic MoE layer: E experts with gate/up (4096 -> 2048) and down (2048 -> 4096) BF16-like weights,
Hessians from random correlated activations (natural: each expert its own tokens; all: one shared gate/up
Hessian). Encodes `--experts` of them (the projection assumes the other experts cost the same), tr3 rank
slices or whole projections, and writes JSON to --out (default bench/results/).

    python scripts/bench_encode.py --device cuda --experts 4 --mode natural --layout tr3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from glmquant.exl3 import Codebook, encode_linears

HIDDEN, INTER, EXPERTS_PER_LAYER, MOE_LAYERS = 4096, 2048, 288, 42
REFERENCE_S = {"tr3": {"gate_up": 0.88, "down": 0.24}, "exllamav3": {"gate_up": 0.85, "down": 0.60}}


def hessian(n_in: int, tokens: int, gen: torch.Generator, device: str) -> torch.Tensor:
    mix = torch.randn(n_in, n_in // 8, generator=gen).to(device) / (n_in // 8) ** 0.5
    x = torch.randn(tokens, n_in // 8, generator=gen).to(device) @ mix.T + 0.1 * torch.randn(tokens, n_in, generator=gen).to(device)
    return (x.T @ x) / tokens


def expert_items(layout: str, mode: str, shared: torch.Tensor | None, gen: torch.Generator, device: str):
    gate = torch.randn(INTER, HIDDEN, generator=gen).to(device) * 0.02
    up = torch.randn(INTER, HIDDEN, generator=gen).to(device) * 0.02
    down = torch.randn(HIDDEN, INTER, generator=gen).to(device) * 0.02
    h_in = shared if mode == "all" else hessian(HIDDEN, 512, gen, device)
    h_down = hessian(INTER, 512, gen, device)
    if layout == "exllamav3":
        return [("gate_up", gate, h_in), ("gate_up", up, h_in), ("down", down, h_down)]
    w = INTER // 4
    items = [("gate_up", m[r * w:(r + 1) * w], h_in) for m in (gate, up) for r in range(4)]
    items += [("down", down[:, r * w:(r + 1) * w], h_down[r * w:(r + 1) * w, r * w:(r + 1) * w]) for r in range(4)]
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--mode", choices=["natural", "all"], default="natural")
    ap.add_argument("--layout", choices=["tr3", "exllamav3"], default="tr3")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    shared = hessian(HIDDEN, 2048, gen, args.device) if args.mode == "all" else None
    items = [it for _ in range(args.experts) for it in expert_items(args.layout, args.mode, shared, gen, args.device)]
    kinds = [k for k, _, _ in items]
    encode_linears([(items[0][1], items[0][2])], 2, Codebook.MCG, 0, device=args.device)  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = encode_linears([(w, h) for _, w, h in items], 2, Codebook.MCG, 0, device=args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    per_expert = seconds / args.experts
    layer_s = per_expert * EXPERTS_PER_LAYER
    ref = REFERENCE_S[args.layout]
    ref_expert = sum(ref["gate_up"] if k == "gate_up" else ref["down"] for k in kinds) / args.experts
    record = {
        "bench": "encode", "layout": args.layout, "hessians": args.mode, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "experts_timed": args.experts, "tensors_timed": len(items),
        "seconds": round(seconds, 3), "seconds_per_tensor": round(seconds / len(items), 4),
        "mean_proxy_error": sum(r.proxy_error for r in results) / len(results),
        "projected_layer_s": round(layer_s, 1), "projected_42_layers_h": round(layer_s * MOE_LAYERS / 3600, 2),
        "exllamav3_reference_42_layers_h": round(ref_expert * EXPERTS_PER_LAYER * MOE_LAYERS / 3600, 2),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"encode_{args.layout}_{args.mode}_{args.device.split(':')[0]}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
