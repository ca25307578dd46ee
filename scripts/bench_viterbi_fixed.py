"""The fixed-point CUDA Viterbi search's quality (K <= 2) against the exact search, on the CPU.

The kernel's arithmetic is modelled step for step in torch (tests/exl3/cuda_viterbi_reference.py; the kernel equals
that model bit for bit on an H200, tests/exl3/test_viterbi_cuda.py), so its quality can be measured without a GPU:
mean squared error of the model's states against the exact two-pass search's (glmquant.exl3.viterbi), on Gaussian
tiles at several scales and on heavy-tailed (Student-t, 5 degrees of freedom) tiles. Writes
bench/results/viterbi_fixed_quality_cpu.json.

    python scripts/bench_viterbi_fixed.py              # ~5 minutes on two cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_common import ROOT, provenance

from glmquant.exl3.codebooks import codebook_values
from glmquant.exl3.viterbi import viterbi_torch

sys.path.insert(0, str(ROOT / "tests" / "exl3"))
from cuda_viterbi_reference import viterbi_cuda_reference

CASES = [(2, "0.6"), (2, "1.0"), (2, "1.25"), (2, "1.6"), (2, "2.0"), (2, "3.0"), (2, "t5"), (1, "0.7"), (1, "1.25")]
CASES += [(1, "2.0"), (1, "t5")]


def targets(dist: str, tiles: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tiles, 256, generator=gen)
    if dist == "t5":
        chi2 = torch.randn(tiles, 256, 5, generator=gen).square().sum(-1)
        return x * (chi2 / 5).rsqrt()
    return x * float(dist)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/viterbi_fixed_quality_cpu.json")
    args = ap.parse_args()
    lut = codebook_values("mcg")
    rows = []
    for bits, dist in CASES:
        x = targets(dist, args.tiles, seed=17)
        t0 = time.perf_counter()
        exact = viterbi_torch(x, lut, bits)
        fixed = viterbi_cuda_reference(x, lut, bits)
        mse_exact = (lut.float()[exact.long()] - x).square().mean().item()
        mse_fixed = (lut.float()[fixed.long()] - x).square().mean().item()
        row = {
            "bits": bits,
            "targets": "student-t 5" if dist == "t5" else f"gaussian std {dist}",
            "tiles": args.tiles,
            "mse_exact": mse_exact,
            "mse_fixed_point": mse_fixed,
            "ratio": round(mse_fixed / mse_exact, 5),
            "same_states": round((exact == fixed).float().mean().item(), 4),
        }
        rows.append(row)
        print(f"{row['targets']:>20} K{bits}: ratio {row['ratio']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    record = {
        "bench": "viterbi_fixed_quality",
        "what": "MSE of the CUDA fixed-point search's arithmetic (torch model, bit-exact to the kernel) over the exact "
        "two-pass search's, MCG codebook, same tiles",
        **provenance("cpu"),
        "rows": rows,
        "worst_ratio": max(r["ratio"] for r in rows),
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"worst_ratio": record["worst_ratio"]}))


if __name__ == "__main__":
    main()
