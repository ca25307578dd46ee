"""Launch shapes of the few-row cores on the speed tier's retained linears: time one EXL3 linear (rotations + core +
output) per config at 1, 2 and 4 rows, for the shapes GLM-5.3-Flash's retained linears have (lm_head among them, the
speed tier's K5 head), and report GB/s of trellis read. At K4 every row count up to 4 takes the GEMV core at
`one_row_gemv(4)`'s steps, in jobs of at most two rows (the H200 sweep at 2 rows, ef53d2a: those steps at 2 warps
were 3.8 % faster than at the default 4, which stays, since a verify's rows then equal one-row products bit for bit);
at K3 and K5 up all three take the small-job core (`exl3_gemv_kbit`), whose `ONE_ROW_KBIT` and `SMALL_JOB_KBIT` this
picked before K4 moved to the GEMV core (docs/kernels.md; the report's "defaults" are those two, and each row count's
`is_default` row is `linear_config`'s).

Each measurement replays a CUDA graph of `--copies` linears of one shape, each its own weights (more bytes than the
L2 holds, as in a decode step), and takes the median of `--reps` replays. Configs whose accumulators would pass
128 fp32 registers per thread are skipped; K splits are chosen as `linear_config` chooses them. Each candidate is
timed on every shape before the next one starts, so `--max-seconds` cuts whole candidates, which `best` can rank.

    python scripts/bench_exl3_linear.py --out bench/results/exl3_linear_sweep_h200.json [--bits 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_moe_decode import Clock, capture, replays

from glmquant.fixtures.random_artifact import random_exl3
from glmquant.runtime.kernels import exl3_gemm
from glmquant.runtime.kernels.exl3_gemm import exl3_linear, linear_config
from glmquant.runtime.kernels.exl3_gemv import GEMV_BITS
from glmquant.runtime.kernels.exl3_gemv_kbit import ONE_ROW_KBIT, SMALL_JOB_KBIT, TWO_ROW_KBIT
from glmquant.runtime.kernels.exl3_jobs import GemmConfig, WeightStack

# (name, in_features, out_features) of GLM-5.3-Flash's retained linears (tests/data/glm-5.3-flash/config.json)
SHAPES = (
    ("kda_in_proj", 4096, 24896),  # q, k, v (3 x 64 heads x 128), f_a, g_a (128 each), beta (64)
    ("kda_o_proj", 8192, 4096),
    ("shared_gate_up", 4096, 4096),
    ("shared_down", 2048, 4096),
    ("lm_head", 4096, 154880),
)
CANDIDATES = tuple(
    GemmConfig(ti=ti, tj=tj, num_warps=w) for ti in (1, 2, 4, 8) for tj in (1, 2, 4) for w in (1, 2, 4, 8)
)  # split_tiles set per shape by `linear_config`
MAX_ACCUMULATORS = 128  # fp32 registers per thread for the rows' accumulators


def accumulators(cfg: GemmConfig, rows: int) -> int:
    """fp32 accumulator registers per thread: a [ti, tj] block of 16 x 16 tiles per row, over the warps' lanes."""
    return cfg.ti * cfg.tj * 256 * rows // (32 * cfg.num_warps)


def fits(cfg: GemmConfig, stack: WeightStack, rows: int) -> bool:
    _, _, kt, nt, _ = stack.trellis.shape
    return kt % cfg.ti == 0 and nt % cfg.tj == 0 and accumulators(cfg, rows) <= MAX_ACCUMULATORS


def linears(x: torch.Tensor, stacks: list[WeightStack], cfg: GemmConfig) -> torch.Tensor:
    """The linears one after another, as a decode step runs them; the last one's output is the graph's."""
    return [exl3_linear(x, stack, cfg) for stack in stacks][-1]


def timed_us(fn: Any, reps: int) -> float:
    """Median µs of a CUDA graph replay of `fn` (bench_moe_decode's timer)."""
    clock = Clock(torch.device("cuda"))
    step = capture(clock, fn)
    return statistics.median(clock.repeat(replays(clock, step.graph), reps))


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda")
    shapes = [shape for shape in SHAPES if shape[0] in args.shapes]
    stacks = {
        name: [WeightStack.single(random_exl3(inf, outf, gen, args.bits), device) for _ in range(args.copies)]
        for name, inf, outf in shapes
    }
    nbytes = {name: sum(s.trellis.numel() * s.trellis.element_size() for s in group) for name, group in stacks.items()}
    deadline = time.monotonic() + args.max_seconds  # each config compiles first: a cap keeps a call's results
    out = []
    for rows in args.rows:
        xs = {inf: torch.randn(rows, inf, generator=gen).to(device, torch.bfloat16) for _, inf, _ in shapes}
        picked = [c for c in CANDIDATES if c.num_warps in args.warps and c.ti in args.ti and c.tj in args.tj]
        for cand in (None, *picked):  # None: each shape's default
            if time.monotonic() > deadline:
                break
            for name, inf, outf in shapes:
                first = stacks[name][0]
                default = linear_config(rows, first)
                if cand is not None and not fits(cand, first, rows):
                    continue
                cfg = default if cand is None else linear_config(rows, first, base=cand)  # K splits as the default's
                try:
                    us = timed_us(partial(linears, xs[inf], stacks[name], cfg), args.reps)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is recorded, not fatal
                    out.append({"shape": name, "rows": rows, "config": asdict(cfg), "error": repr(exc)[:500]})
                    continue
                row = {
                    "shape": name,
                    "in_features": inf,
                    "out_features": outf,
                    "rows": rows,
                    "config": asdict(cfg),
                    "is_default": cand is None,
                    "us_per_linear": round(us / args.copies, 2),
                    "trellis_gb_s": round(nbytes[name] / (us * 1e-6) / 1e9, 1),
                }
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row count, the candidate with the least time summed over every shape, against the default's, and each
    shape's own fastest."""
    summary: dict[str, Any] = {}
    for n in sorted({r["rows"] for r in rows}):
        at = [r for r in rows if r["rows"] == n and "us_per_linear" in r]
        shapes = {r["shape"] for r in at}
        totals: dict[str, float] = {}
        covered: dict[str, set[str]] = {}
        for r in at:
            if r["is_default"]:
                continue
            key = json.dumps({k: r["config"][k] for k in ("ti", "tj", "num_warps")})
            totals[key] = totals.get(key, 0.0) + r["us_per_linear"]
            covered.setdefault(key, set()).add(r["shape"])
        default = sum(r["us_per_linear"] for r in at if r["is_default"])
        top = min(((k, v) for k, v in totals.items() if covered[k] == shapes), key=lambda kv: kv[1], default=None)
        per_shape = {}
        for shape in sorted(shapes):
            mine = [r for r in at if r["shape"] == shape]
            fastest = min(mine, key=lambda r: r["us_per_linear"])
            base = next(r["us_per_linear"] for r in mine if r["is_default"])
            per_shape[shape] = {
                "best": {k: fastest["config"][k] for k in ("ti", "tj", "num_warps")},
                "speedup": round(base / fastest["us_per_linear"], 3),
                "trellis_gb_s": fastest["trellis_gb_s"],
            }
        summary[f"rows_{n}"] = {
            "default_us": round(default, 2),
            "best": json.loads(top[0]) if top else None,
            "best_us": round(top[1], 2) if top else None,
            "speedup": round(default / top[1], 3) if top else None,
            "per_shape": per_shape,
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--copies", type=int, default=8, help="linears of one shape per graph, each its own weights")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4])
    ap.add_argument("--shapes", type=lambda v: v.split(","), default=[name for name, _, _ in SHAPES])
    ap.add_argument("--warps", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--ti", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--tj", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4])
    ap.add_argument("--max-seconds", type=float, default=1e9, help="measure no new config after this long")
    ap.add_argument(
        "--planes",
        action="store_true",
        help="one- and two-row jobs multiply fp16 hi/lo planes in fp32 (the small-job core before its fp16x2 "
        "products), for comparison; K other than the GEMV core's",
    )
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_exl3_linear.py times CUDA kernels: no CUDA GPU here")
    if args.planes:
        if args.bits in GEMV_BITS:
            raise SystemExit(f"--planes: K{args.bits} one- and two-row jobs take the GEMV core, which has no planes")
        exl3_gemm.takes_fp16_pairs = lambda max_rows: False  # exl3_linear's activation format: planes at any rows
    import triton

    rows = sweep(args)
    report = {
        "command": "python scripts/bench_exl3_linear.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "bits": args.bits,
        "activations": "fp16 hi/lo planes" if args.planes else "fp16 pairs up to two rows",
        "defaults": {
            "one_row": asdict(ONE_ROW_KBIT),
            "two_rows": asdict(TWO_ROW_KBIT),
            "small_jobs": asdict(SMALL_JOB_KBIT),
        },
        "summary": best(rows),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
