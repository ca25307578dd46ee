"""Train the fidelity proxy (glmquant/proxy/train.py): corpus from installed package text, its own tokenizer, a
small GLM-5.3-Flash-architecture model from a fixed seed, written as a BF16 source checkpoint with its checks.

    # H200 (fla-core/flash-linear-attention on the path for the KDA kernels; about 9 minutes with the MTP layer):
    python scripts/train_proxy.py --out /tmp/proxy --device cuda
    # CPU smoke (tests/proxy/test_train_proxy.py runs this):
    python scripts/train_proxy.py --out /tmp/proxy-smoke --device cpu --smoke

Writes OUT/proxy.json (held-out perplexity, routing check, loss curve) and OUT/model (the checkpoint that
scripts/bench_fidelity.py quantizes); the same command on the same machine gives the same model. Training pauses
at --max-minutes (wall time of the whole command), on Ctrl-C or SIGTERM, saving OUT/train_state.pt, and exits 3;
the same command then continues from there to the same weights.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, set before CUDA starts

from glmquant.errors import UsageError
from glmquant.proxy.train import PROXY_SHAPE, SMOKE_SHAPE, TrainConfig, train_proxy

PAUSED_EXIT = 3  # training paused (--max-minutes, Ctrl-C, SIGTERM): the same command continues it

SMOKE = dict(
    corpus_bytes=2_000_000,
    steps=6,
    batch_rows=2,
    seq_len=64,
    warmup_steps=2,
    heldout_rows=2,
    calibration_rows=2,
    log_every=2,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU smoke size: tiny model, corpus and run")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers instead of the shape's own (the same first dense layers, the rest MoE): a deeper CPU "
        "proxy for the depth sweep",
    )
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for name in (
        "seed",
        "device",
        "steps",
        "batch_rows",
        "seq_len",
        "lr",
        "warmup_steps",
        "corpus_bytes",
        "max_minutes",
        "checkpoint_every",
        "heldout_rows",
        "calibration_rows",
        "log_every",
        "experts_implementation",
        "dtype",
        "mtp_loss_weight",
    ):
        kind = type(defaults[name]) if defaults[name] is not None else float if name == "max_minutes" else int
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    ap.add_argument("--corpus-recipe", type=Path, default=None)
    ap.add_argument(
        "--corpus-lock",
        type=Path,
        default=None,
        help="an earlier run's corpus/corpus.lock.json: train on exactly its documents (refused, naming them, where "
        "this machine lacks any or holds other text)",
    )
    args = ap.parse_args()
    given = {k: v for k, v in vars(args).items() if v is not None and k in defaults and k != "out"}
    shape = SMOKE_SHAPE if args.smoke else PROXY_SHAPE
    if args.layers is not None:
        if args.layers <= shape.first_dense_layers:
            ap.error(f"--layers must exceed the shape's {shape.first_dense_layers} dense layer(s), got {args.layers}")
        shape = replace(shape, num_hidden_layers=args.layers)
    preset = {**SMOKE, "shape": shape} if args.smoke else {"shape": shape}
    try:
        record = train_proxy(TrainConfig(out=args.out, **{**preset, **given}))
    except UsageError as exc:  # a bad option or input file: its message, no traceback
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    if record.get("paused"):
        sys.exit(PAUSED_EXIT)


if __name__ == "__main__":
    main()
