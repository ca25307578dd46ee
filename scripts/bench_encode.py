"""Encode throughput: one whole real-shape GLM-5.3-Flash MoE layer through the production unit pipeline, and the
Viterbi kernels (ours and ExLlamaV3's) timed in the same run.

The layer: 288 experts with gate/up (4096 -> 2048) and down (2048 -> 4096) weights, Gaussian with heavy-tailed
outlier channels, and natural-routing Hessians with realistic spectra: H = D (A A^T / r + 0.05 I) D with a
rank-r random A and lognormal channel scales D with outlier channels. A reader thread generates unit i + 1 on the
GPU (standing in for the disk read, whose rate is measured separately) while unit i encodes; every unit is written
as a safetensors file (UnitStore) behind the next unit's encode (WriteBehind), as the encoder does. Wall time runs
from the first generated unit to the last written file. JSON goes to --out (default bench/results/).

    python scripts/bench_encode.py --layout tr3 --experts 288      # the layer, our kernel
    python scripts/bench_encode.py --layout tr3 --compare          # + both kernels side by side, search variants
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import encodes_computed, git_commit

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import expert_slices
from glmquant.encode.config import EncodeConfig
from glmquant.encode.layer import EncodedLayer, UnitInputs, encode_unit
from glmquant.encode.slices import slice_hessian, slice_weight
from glmquant.encode.units import UnitStore, WriteBehind
from glmquant.exl3 import Codebook
from glmquant.exl3.backends import ENV_VAR, exllamav3_available, select_backend
from glmquant.exl3.refit import REFIT_ROUNDS
from glmquant.exl3.scale_search import DEFAULT_SEARCH, EXLLAMAV3_SEARCH, ScaleSearch
from glmquant.exl3.timing import record_stages

CONFIG = Path(__file__).resolve().parents[1] / "tests/data/glm-5.3-flash/config.json"
MOE_LAYERS = 42
TARGET_LAYER_S = 171.0  # 42 layers in 2 h
REDUCED_SEARCHES = [ScaleSearch(band_width=1, coarse_stride=6, fine_stride=3)]


def channel_scales(n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    d = torch.exp(0.5 * torch.randn(n, generator=gen, device=device))
    outliers = torch.randperm(n, generator=gen, device=device)[: max(1, n // 256)]
    d[outliers] *= 8.0
    return d


def hessian(n: int, rank: int, gen: torch.Generator, device: str) -> torch.Tensor:
    a = torch.randn(n, rank, generator=gen, device=device)
    d = channel_scales(n, gen, device)
    h = a @ a.T / rank
    h.diagonal().add_(0.05)
    return h * d[:, None] * d[None, :]


def expert_weights(h: int, inter: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    out = {}
    for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
        w = torch.randn(shape, generator=gen, device=device) * 0.02
        w[:, channel_scales(shape[1], gen, device) > 6] *= 4.0  # a few heavy input columns
        out[proj] = w.bfloat16().float()
    return out


def make_unit(spec, layout: str, experts: range, device: str) -> UnitInputs:
    names: list[str] = []
    items: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    fallbacks: list[str | None] = []
    ranks = 4 if layout == "tr3" else None
    for e in experts:
        gen = torch.Generator(device=device).manual_seed(1000 + e)
        weights = expert_weights(spec.hidden_size, spec.moe_intermediate_size, gen, device)
        h_in = hessian(spec.hidden_size, 512, gen, device)
        h_down = hessian(spec.moe_intermediate_size, 256, gen, device)
        for s in expert_slices(spec, 3, e, e, ranks):
            names.append(f"model.layers.3.{s.key}")
            items.append(
                (slice_weight(weights[s.proj], s), slice_hessian(h_down if s.proj == "down_proj" else h_in, s))
            )
            fallbacks.append(None)
    return UnitInputs(names, items, fallbacks)


def tiles_of(unit: UnitInputs) -> int:
    return sum(-(-w.shape[0] // 128) * 128 * -(-w.shape[1] // 128) * 128 // 256 for w, _ in unit.items)


def encode_layer(
    spec,
    layout: str,
    experts: int,
    per_unit: int,
    device: str,
    store: UnitStore,
    search: ScaleSearch = DEFAULT_SEARCH,
    progress: Path | None = None,
    refit_rounds: int = REFIT_ROUNDS,
    stage_times: bool = True,
) -> tuple[float, list[float], int, dict[str, float]]:
    """Wall time, proxy errors, LDLQ tiles and seconds per encoder stage of `experts` experts in units of
    `per_unit`, reading ahead. Stage times synchronize the GPU at every stage boundary (per Viterbi call and per
    tensor's refit), which costs wall time; without them the wall time is the encoder's own."""
    starts = list(range(0, experts, per_unit))
    errors, tiles = [], 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    no_stages: dict[str, float] = {}
    timing: contextlib.AbstractContextManager[dict[str, float]] = (
        record_stages() if stage_times else contextlib.nullcontext(no_stages)
    )
    with ThreadPoolExecutor(max_workers=1) as reader, WriteBehind() as writer, timing as stages:
        pending = reader.submit(make_unit, spec, layout, range(min(per_unit, experts)), device)
        for i in range(len(starts)):
            unit = pending.result()
            if i + 1 < len(starts):
                nxt = starts[i + 1]
                pending = reader.submit(make_unit, spec, layout, range(nxt, min(nxt + per_unit, experts)), device)
            encoded: EncodedLayer = encode_unit(unit, 2, "mcg", 0, device, search, refit_rounds)
            writer.submit(functools.partial(store.write, 3, i, encoded, 0.0))
            errors += [r.proxy_error for r in encoded.reports]
            tiles += tiles_of(unit)
            elapsed = time.perf_counter() - t0
            print(f"  unit {i + 1}/{len(starts)}: {elapsed:.1f} s", flush=True)
            if progress is not None:  # what a killed run still leaves behind
                progress.write_text(
                    json.dumps(
                        {
                            "units_done": i + 1,
                            "units": len(starts),
                            "elapsed_s": elapsed,
                            "experts_done": min(starts[i] + per_unit, experts),
                            "stage_s": dict(stages),
                        }
                    )
                    + "\n"
                )
    torch.cuda.synchronize()
    return time.perf_counter() - t0, errors, tiles, dict(stages)


def kernel_rate(backend: str, bits: int, codebook: str, count: int) -> float:
    """Tiles per second of one backend on `count` Gaussian tiles (after a warm-up call)."""
    search = select_backend("cuda", backend)
    x = torch.randn(count, 256, generator=torch.Generator(device="cuda").manual_seed(bits), device="cuda") * 1.2
    search(x[:256], bits, Codebook(codebook))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    search(x, bits, Codebook(codebook))
    torch.cuda.synchronize()
    return count / (time.perf_counter() - t0)


def unit_chunks(errors: list[float], experts: int, per_unit: int) -> list[list[float]]:
    """The proxy errors split by unit (every expert gives the same number of tensors), to compare partial runs."""
    per_expert = len(errors) // experts
    return [errors[i : i + per_unit * per_expert] for i in range(0, len(errors), per_unit * per_expert)]


def disk_read_gbps(directory: Path, nbytes: int = 2 << 30) -> float:
    """Sequential read rate of a fresh file, cache dropped where the OS lets us."""
    path = directory / "read-probe.bin"
    with open(path, "wb") as f:
        chunk = os.urandom(64 << 20)
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        os.fsync(f.fileno())
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], capture_output=True)
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes / seconds / 1e9


def kernel_rates(backend: str, count: int) -> dict[str, int]:
    rates = {f"K{k}_mcg": kernel_rate(backend, k, "mcg", count if k > 1 else count // 4) for k in range(1, 9)}
    rates |= {f"K2_{cb}": kernel_rate(backend, 2, cb, count) for cb in ("3inst", "mul1")}
    return {k: round(v) for k, v in rates.items()}


def compare(spec, layout: str, experts: int) -> dict:
    """The same experts with each kernel and scale-search sampling: wall time and mean proxy error."""
    rows = {}
    variants = [("ours_exllamav3_search", "cuda", EXLLAMAV3_SEARCH)] + [
        (f"ours_search_band{v.band_width}_coarse{v.coarse_stride}_fine{v.fine_stride}", "cuda", v)
        for v in (DEFAULT_SEARCH, *REDUCED_SEARCHES)
    ]
    if exllamav3_available():
        variants.append(("exllamav3_kernel_exllamav3_search", "exllamav3", EXLLAMAV3_SEARCH))
    for name, backend, search in variants:
        os.environ[ENV_VAR] = backend
        try:
            with tempfile.TemporaryDirectory() as tmp:
                wall, errors, _, _ = encode_layer(spec, layout, experts, experts, "cuda", UnitStore(Path(tmp)), search)
        finally:
            del os.environ[ENV_VAR]
        rows[name] = {"experts": experts, "wall_s": round(wall, 2), "mean_proxy_error": sum(errors) / len(errors)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["tr3", "exllamav3"], default="tr3")
    ap.add_argument("--experts", type=int, default=288, help="experts of the layer to encode (288: the whole layer)")
    ap.add_argument("--experts-per-unit", type=int, default=EncodeConfig.experts_per_unit)
    ap.add_argument(
        "--compare-experts",
        type=int,
        default=4,
        help="--compare: experts encoded with each kernel and scale-search sampling",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="kernels side by side (ours and ExLlamaV3's, same process) and the compare encodes, added "
        "to the JSON the layer run wrote",
    )
    ap.add_argument("--kernel-tiles", type=int, default=65536)
    ap.add_argument("--refit-rounds", type=int, default=REFIT_ROUNDS, help="post-LDLQ refit rounds (ExLlamaV3: 2)")
    ap.add_argument(
        "--no-stage-times",
        action="store_true",
        help="wall time only: no GPU synchronization at stage boundaries (the encoder as it runs in production)",
    )
    for grid in ("coarse", "fine"):  # the scale search's sample per grid point (ScaleSearch)
        ap.add_argument(
            f"--{grid}-stride",
            type=int,
            default=getattr(DEFAULT_SEARCH, f"{grid}_stride"),
            help=f"scale search: a {grid} point quantizes every Nth band tile",
        )
        ap.add_argument(
            f"--{grid}-min-tiles",
            type=int,
            default=getattr(DEFAULT_SEARCH, f"{grid}_min_tiles"),
            help=f"scale search: the {grid} stride applies where it leaves this many tiles per point (0: always)",
        )
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--commit", default=None, help="commit of the code run (default: git HEAD here)")
    args = ap.parse_args()
    encodes_computed()
    commit = args.commit or git_commit()
    search = dataclasses.replace(
        DEFAULT_SEARCH,
        fine_stride=args.fine_stride,
        fine_min_tiles=args.fine_min_tiles,
        coarse_stride=args.coarse_stride,
        coarse_min_tiles=args.coarse_min_tiles,
    )
    spec = load_model_spec(CONFIG)
    path = args.out / f"encode_layer_{'plain' if args.layout == 'exllamav3' else args.layout}_h200.json"
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare:
        compared = json.loads(path.read_text()) if path.exists() else {}
        compared["our_kernel_tiles_per_s"] = kernel_rates("cuda", args.kernel_tiles)
        compared["our_tiles_per_s"] = compared["our_kernel_tiles_per_s"]["K2_mcg"]
        if exllamav3_available():
            compared["exllamav3_kernel_tiles_per_s"] = kernel_rates("exllamav3", args.kernel_tiles // 4)
            compared["exllamav3_tiles_per_s"] = compared["exllamav3_kernel_tiles_per_s"]["K2_mcg"]
            compared["speedup_vs_exllamav3_kernel"] = round(
                compared["our_tiles_per_s"] / compared["exllamav3_tiles_per_s"], 2
            )
        else:
            compared["exllamav3_tiles_per_s"] = None
            compared["exllamav3_note"] = "exllamav3 not importable in this run"
        compared["compare"] = compare(spec, args.layout, args.compare_experts)
        compared["compare_commit"] = commit
        path.write_text(json.dumps(compared, indent=2) + "\n")
        print(json.dumps(compared, indent=2))
        return
    record: dict = {
        "bench": "encode_layer",
        "layout": args.layout,
        "hessians": "natural",
        "bits": 2,
        "codebook": "mcg",
        "scale_search": dataclasses.asdict(search),
        "refit_rounds": args.refit_rounds,
        "stage_times": not args.no_stage_times,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python3", *sys.argv]),
        "experts_timed": args.experts,
        "experts_per_unit": args.experts_per_unit,
    }
    record["our_tiles_per_s"] = round(kernel_rate("cuda", 2, "mcg", args.kernel_tiles))
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        store = UnitStore(Path(tmp) / "units")
        wall, errors, tiles, stages = encode_layer(
            spec,
            args.layout,
            args.experts,
            args.experts_per_unit,
            "cuda",
            store,
            search,
            progress=path.with_suffix(".progress.json"),
            refit_rounds=args.refit_rounds,
            stage_times=not args.no_stage_times,
        )
        record["disk_read_gbps"] = round(disk_read_gbps(Path(tmp)), 2)
        layer_s = wall * 288 / args.experts
        record |= {
            "layer_wall_s": round(layer_s, 1),
            "measured_wall_s": round(wall, 1),
            "ldlq_tiles": tiles,
            "stage_s": {k: round(v, 1) for k, v in stages.items()},
            "mean_proxy_error": sum(errors) / len(errors),
            "unit_mean_proxy_errors": [
                sum(u) / len(u) for u in unit_chunks(errors, args.experts, args.experts_per_unit)
            ],
            "tensors": len(errors),
            "end_to_end_ldlq_tiles_per_s": round(tiles / wall),
            "projected_42_layers_h": round(layer_s * MOE_LAYERS / 3600, 2),
            "projection_formula": "layer_wall_s * 42 / 3600, layer_wall_s = measured_wall_s * 288 / experts_timed",
            "goal_layer_s": TARGET_LAYER_S,
            "unit_bytes_per_layer": sum(p.stat().st_size for p in store.directory.iterdir()) * 288 // args.experts,
        }
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
