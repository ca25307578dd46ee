"""How the speed tier's encode error falls with K, per role, on the small random model (CPU).

Issue 18's KL cost on the trained proxy falls only 1.1-1.6x per added bit of the retained linears
(docs/fidelity.md). This measures what the encoder itself achieves on the same roles: build the small random
model, observe it with dense Hessians, encode `--retained-bits K` for each K, and per role report the mean over its
linears of the Hessian-weighted relative error tr(E H Eᵀ) / tr(W H Wᵀ) (what LDLQ minimises; E = decoded - original;
the encoder's own `exl3.proxy_error`) and the plain relative MSE, with the factor per added bit. Writes
bench/results/retained_error_cpu.json.

    .venv/bin/python scripts/bench_retained_error.py            # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch
from bench_common import git_commit
from rich.console import Console

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.exl3 import decode_weight, proxy_error
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessian_reader import load_dense_hessian
from glmquant.observe.run import observe
from glmquant.runtime.artifact import open_artifact

ROOT = Path(__file__).resolve().parents[1]


def role_errors(artifact: Path, source: Path, observations: Path) -> dict[str, dict[str, float]]:
    """Per role: linears, mean Hessian-weighted relative error, mean relative MSE."""
    art = open_artifact(artifact)
    found: dict[str, list[tuple[float, float]]] = {}
    with SourceCheckpoint.open(source) as src:
        for linear in art.retained_linear_modules().values():
            w = src.read_tensor(linear.source)
            d = decode_weight(art.read_linear(linear, "cpu"), torch.float32)
            h = load_dense_hessian(observations, linear.layer, linear.source).sum
            found.setdefault(linear.role.value, []).append((proxy_error(w, d, h), proxy_error(w, d, None)))
    art.checkpoint.close()
    return {
        role: {
            "linears": len(v),
            "hessian_weighted_error": sum(x for x, _ in v) / len(v),
            "relative_mse": sum(y for _, y in v) / len(v),
        }
        for role, v in sorted(found.items())
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", default="4,5,6", help="retained K values")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "retained_error_cpu.json")
    args = ap.parse_args()
    bits = [int(k) for k in args.bits.split(",")]
    quiet = Console(quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = build_tiny_checkpoint(work / "source", TinyModelConfig(n_routed_experts=2, num_experts_per_tok=1))
        obs = work / "obs"
        observe(ObserveConfig(source=source, out=obs, rows=4, tokens=64, dense_hessians=True))
        by_k = {}
        for k in bits:
            out = work / f"k{k}"
            encode_artifact(EncodeConfig(source=source, out=out, observations=obs, retained_bits=k), quiet)
            by_k[k] = role_errors(out, source, obs)
            print(f"K{k}: " + ", ".join(f"{r} {v['hessian_weighted_error']:.2e}" for r, v in by_k[k].items()))
    factors = {
        f"K{a}->K{b}": {
            role: round(by_k[a][role]["hessian_weighted_error"] / by_k[b][role]["hessian_weighted_error"], 3)
            for role in by_k[a]
        }
        for a, b in zip(bits, bits[1:])
    }
    report = {
        "what": "EXL3 retained-linear encode error per role and K on the small random model (observe rows 4 x "
        "tokens 64, dense Hessians; encode --retained-bits K, MCG): tr(E H E^T)/tr(W H W^T) and |E|^2/|W|^2",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "device": "cpu",
        "by_bits": {f"K{k}": v for k, v in by_k.items()},
        "hessian_weighted_error_factor_per_bit": factors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(factors, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
