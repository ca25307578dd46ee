"""Benchmark the CPU EXL3 encoder: Viterbi tiles/s (native kernel) at each K and seconds per encoded tensor.

Writes bench/results/exl3_cpu.json. Run from the repo root: python scripts/bench_exl3_cpu.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout, no install

from bench_common import encodes_computed, git_commit

from glmquant.exl3 import Codebook, encode_linear
from glmquant.exl3.backends import select_backend
from glmquant.exl3.codebooks import codebook_values
from glmquant.exl3.native import load_kernel


def cpu_field(name: str) -> str:
    """One field of /proc/cpuinfo's first CPU ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def simd() -> dict:
    """What the native kernel was built for: its lanes per vector (16 AVX-512, 8 AVX2, 4 otherwise)."""
    flags = set(cpu_field("flags").split())
    kernel = load_kernel()
    return {
        "avx512f": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "kernel_lanes": int(kernel.exl3_viterbi_lanes()) if kernel is not None else None,
    }


def tiles_per_second(backend: str, bits: int, codebook: Codebook, count: int, repeats: int) -> dict:
    """Best and median rate over `repeats` runs: other jobs on a shared 2-core machine only ever slow it down."""
    search = select_backend("cpu", backend)
    x = torch.randn(count, 256, generator=torch.Generator().manual_seed(0)) * 1.2
    search(x[:16], bits, codebook)  # build/load the kernel and warm the buffers
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        states = search(x, bits, codebook)
        rates.append(count / (time.perf_counter() - start))
    mse = (codebook_values(codebook).float()[states.long()] - x).square().mean().item() / 1.44
    return {
        "tiles": count,
        "threads": torch.get_num_threads(),
        "tiles_per_s": round(max(rates), 1),
        "tiles_per_s_median": round(statistics.median(rates), 1),
        "mse_rel_n0_1.2": round(mse, 5),
    }


def encode_seconds(in_f: int, out_f: int, bits: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * in_f, in_f, generator=g)
    h = x.T @ x / x.shape[0]
    w = torch.randn(out_f, in_f, generator=g) * 0.02
    start = time.perf_counter()
    result = encode_linear(w, h, bits, Codebook.MCG)
    return {
        "in_features": in_f,
        "out_features": out_f,
        "bits": bits,
        "seconds": round(time.perf_counter() - start, 2),
        "proxy_error": round(result.proxy_error, 6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", type=int, default=512, help="tiles per Viterbi measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per configuration (best is reported)")
    parser.add_argument(
        "--bits", default="1,2,3,4,5,6", help="K of the Viterbi measurements (experts take K1-K4, retained K2-K6)"
    )
    parser.add_argument("--encode", default="2048x512", help="IN x OUT of the end-to-end encode timing ('' to skip)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/exl3_cpu.json"))
    args = parser.parse_args()
    encodes_computed()

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu": cpu_field("model name") or platform.processor(),
        "simd": simd(),
        "commit": git_commit(),
        "loadavg_before": [round(v, 2) for v in os.getloadavg()],
        "viterbi": {},
    }
    for bits in (int(b) for b in args.bits.split(",")):
        key = f"K{bits}_mcg"
        report["viterbi"][key] = tiles_per_second("native", bits, Codebook.MCG, args.tiles, args.repeats)
        print(key, report["viterbi"][key], flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    report["viterbi"]["K2_mcg_1thread"] = tiles_per_second("native", 2, Codebook.MCG, args.tiles // 2, args.repeats)
    torch.set_num_threads(threads)
    print("K2_mcg_1thread", report["viterbi"]["K2_mcg_1thread"], flush=True)
    report["tiles_per_s_K2_mcg"] = report["viterbi"].get("K2_mcg", {}).get("tiles_per_s")
    if args.encode:
        in_f, out_f = (int(v) for v in args.encode.lower().split("x"))
        report["encode_linear_K2_mcg"] = encode_seconds(in_f, out_f, 2)
        print("encode_linear", report["encode_linear_K2_mcg"], flush=True)
    report["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
