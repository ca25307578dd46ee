"""Peak memory of `observe` does not grow with the number of layers: it holds one layer at a time.

Builds tiny GLM-5.3-Flash-architecture checkpoints that differ only in depth (default 4 and 16 decoder
layers, experts big enough that weights dominate), observes each in a fresh process and records the
child's peak RSS next to the model size and the largest decoder layer's size. If observation loaded
the model, peak RSS would grow by about one layer per layer added; streamed, it stays flat.

    python scripts/bench_observe_memory.py --layers 4 16 --out bench/results/observe_memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys
from pathlib import Path
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessians import HessianMode
from glmquant.observe.run import observe
s = observe(ObserveConfig(Path(sys.argv[1]), Path(sys.argv[2]), rows=int(sys.argv[3]), tokens=int(sys.argv[4]),
                          hessians=HessianMode(sys.argv[5]), batch_rows=int(sys.argv[6])))
print(json.dumps({"peak_rss_bytes": s.peak_rss_bytes, "elapsed_s": s.elapsed_s}))
"""


def layer_bytes(source: Path) -> dict[int, int]:
    """Bytes of every decoder layer's tensors (MTP layer excluded), from the shard headers."""
    from glmquant.arch import load_model_spec, table_for
    from glmquant.checkpoint.reader import SourceCheckpoint

    spec = load_model_spec(source)
    table = table_for(spec)
    with SourceCheckpoint.open(source) as ckpt:
        return {
            i: sum(ckpt.spec(t.name).nbytes for t in table.layer_tensors(spec, i))
            for i in range(spec.num_hidden_layers)
        }


def measure(layers: int, args: argparse.Namespace, work: Path) -> dict:
    from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint

    config = TinyModelConfig(
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        n_routed_experts=args.experts,
        moe_intermediate_size=args.moe_intermediate,
        shard_bytes=64 << 20,
    )
    source = build_tiny_checkpoint(work / f"src-{layers}", config)
    started = time.monotonic()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(source),
            str(work / f"obs-{layers}"),
            str(args.rows),
            str(args.tokens),
            args.hessians,
            str(args.batch_rows),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(child.stdout.strip().splitlines()[-1])
    sizes = layer_bytes(source)
    model = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    return {
        "layers": layers,
        "model_bytes": model,
        "largest_layer_bytes": max(sizes.values()),
        "peak_rss_bytes": result["peak_rss_bytes"],
        "observe_s": result["elapsed_s"],
        "wall_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-rows", type=int, default=4)
    ap.add_argument("--hessians", default="natural")
    ap.add_argument("--out", type=Path, default=Path("bench/results/observe_memory.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(n, args, Path(tmp)) for n in args.layers]
    first, last = runs[0], runs[-1]
    growth = last["peak_rss_bytes"] - first["peak_rss_bytes"]
    model_growth = last["model_bytes"] - first["model_bytes"]
    report = {
        "what": "peak RSS of `glmquant observe` in a fresh process vs model depth (same layer sizes)",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
        "peak_rss_growth_bytes": growth,
        "model_growth_bytes": model_growth,
        "peak_rss_growth_in_layers": round(growth / last["largest_layer_bytes"], 2),
        "model_growth_in_layers": round(model_growth / last["largest_layer_bytes"], 2),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
