"""What each round of the post-LDLQ refit buys, on the CPU: the experts' tr3 rank slices of GLM-5.3-Flash's shape
with bench_encode.py's synthetic natural-routing Hessians, encoded K2 MCG; at each slice's refit, the refit's own
objective tr(E H E^T) / tr(W H W^T) after 0, 1, 2 and 3 rounds from the same LDLQ result (the encoder goes on with
its two). Writes bench/results/refit_rounds_cpu.json.

    python scripts/bench_refit_rounds.py            # one expert, 12 slices: ~5 minutes on two cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_common import ROOT, encodes_computed, provenance
from bench_encode import CONFIG, make_unit

import glmquant.exl3.encode as encoder
from glmquant.arch import load_model_spec
from glmquant.exl3.refit import refit_scales

ROUNDS = (0, 1, 2, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/refit_rounds_cpu.json")
    args = ap.parse_args()
    encodes_computed()
    slices: list[dict[int, float]] = []

    def measured(
        w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, rounds: int = 2
    ) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.trace(w.T @ h @ w)
        errors = {}
        for r in ROUNDS:
            su_r, sv_r = refit_scales(w, wq, h, su, sv, rounds=r)
            e = w - wq * (su_r / su)[:, None] * (sv_r / sv)[None, :]  # the refit's model of the rescaled weight
            errors[r] = (torch.trace(e.T @ h @ e) / base).item()
        slices.append(errors)
        return refit_scales(w, wq, h, su, sv, rounds)

    encoder.refit_scales = measured  # the encoder's refit, observed
    unit = make_unit(load_model_spec(CONFIG), "tr3", range(args.experts), "cpu")
    t0 = time.perf_counter()
    encoder.encode_linears(unit.items, 2, "mcg", 0, device="cpu")
    mean = {r: sum(s[r] for s in slices) / len(slices) for r in ROUNDS}
    record = {
        "bench": "refit_rounds",
        "what": "mean over rank slices of tr(E H E^T) / tr(W H W^T) after each number of refit rounds, same LDLQ "
        "result; tr3 slices of real-shape experts, bench_encode.py's synthetic natural Hessians, K2 MCG",
        **provenance("cpu"),
        "experts": args.experts,
        "slices": len(slices),
        "mean_error_by_rounds": mean,
        "gain_of_round": {r: round(1 - mean[r] / mean[r - 1], 6) for r in ROUNDS[1:]},
        "per_slice": slices,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("mean_error_by_rounds", "gain_of_round")}, indent=2))


if __name__ == "__main__":
    main()
