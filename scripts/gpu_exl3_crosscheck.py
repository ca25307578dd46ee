"""Cross-check glmquant's EXL3 codec against exllamav3 1.6.5 on a CUDA GPU, and time it.

    python scripts/gpu_exl3_crosscheck.py --out DIR

Steps (each one's failure is recorded in the JSON, never fatal):
  env        versions, GPU, which backends are available
  tiles      the same random tiles through every Viterbi backend: identical paths, MSE, tiles/s
  golden     the 9 golden cases: decoder bit-exactness, our encoder with each backend (proxy error,
             trellis equality), exllamav3's own quantize_exl3, LinearEXL3 vs our decoded weight
  large      random 4096x2048 and 4096x512 (in x out) K2 MCG tensors: seconds per tensor and
             proxy error for each backend and for exllamav3's quantize_exl3, LinearEXL3 check;
             then 8 tensors of the 4096x512 shape through encode_linears (amortized seconds per tensor)
Writes DIR/exl3_gpu_crosscheck.json (full record) and DIR/exl3_gpu_summary.json (the timings).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a plain checkout, no install

from bench_common import encodes_computed

from glmquant.exl3 import (
    Codebook,
    EXL3Tensor,
    decode_inner,
    decode_weight,
    encode_linear,
    encode_linears,
)
from glmquant.exl3.backends import exllamav3_available, select_backend
from glmquant.exl3.codebooks import codebook_values
from glmquant.exl3.native import load_kernel

ROOT = Path(__file__).resolve().parents[1]

CASES = [f"{cb}.K{k}" for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)]
LARGE = [(4096, 2048), (4096, 512)]  # (in_features, out_features)
BATCH = 8  # experts encoded together (shared Hessian, as gate/up projections share the MoE input)
BATCH_MAX_OUT = 512  # batched timing only for the narrow shape (rank slices), which needs it most


class Recorder:
    """Collects results; `step` times a block and turns any exception into a recorded error."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict = {"steps": {}}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict]:
        entry: dict = {}
        self.data["steps"][name] = entry
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            yield entry
            entry["ok"] = True
        except Exception as err:  # noqa: BLE001 - recorded, so one broken step never hides the others
            entry["ok"] = False
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(f"    FAILED: {entry['error']}", flush=True)
        entry["wall_s"] = round(time.perf_counter() - start, 3)
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "exl3_gpu_crosscheck.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args, **kwargs):
    sync()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync()
    return result, time.perf_counter() - start


def env_info(entry: dict) -> None:
    entry["torch"] = torch.__version__
    entry["cuda_available"] = torch.cuda.is_available()
    entry["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    entry["cpu_count"] = os.cpu_count()
    entry["torch_threads"] = torch.get_num_threads()
    try:
        entry["exllamav3_version"] = importlib.metadata.version("exllamav3")
    except importlib.metadata.PackageNotFoundError:
        entry["exllamav3_version"] = None
    entry["exllamav3_available"] = exllamav3_available()
    entry["native_kernel"] = load_kernel() is not None


def backends_to_compare(skip_torch: bool) -> list[tuple[str, str]]:
    """(backend, device) pairs that can run here: exllamav3 and torch on CUDA, native on the CPU."""
    pairs = []
    if exllamav3_available():
        pairs.append(("exllamav3", "cuda"))
    if torch.cuda.is_available() and not skip_torch:
        pairs.append(("torch", "cuda"))
    if load_kernel() is not None:
        pairs.append(("native", "cpu"))
    return pairs


def tiles_step(rec: Recorder, count: int, skip_torch: bool) -> None:
    x = torch.randn(count, 256, generator=torch.Generator().manual_seed(0)) * 1.2
    for bits, cb in ((2, Codebook.MCG), (3, Codebook.MCG), (4, Codebook.MUL1), (2, Codebook.THREE_INST)):
        with rec.step(f"tiles.K{bits}.{cb.value}") as entry:
            lut = codebook_values(cb).float()
            states = {}
            for name, device in backends_to_compare(skip_torch):
                n = count if name != "torch" else min(count, 512)
                search = select_backend(device, name)
                search(x[:16].to(device), bits, cb)  # warm-up: kernel build, buffers
                s, seconds = timed(search, x[:n].to(device), bits, cb)
                states[name] = s = s.cpu()
                mse = (lut[s.long()] - x[:n]).square().mean().item() / 1.44
                entry[name] = {
                    "tiles": n,
                    "seconds": round(seconds, 3),
                    "tiles_per_s": round(n / seconds, 1),
                    "mse_rel": mse,
                }
            names = list(states)
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    n = min(states[a].shape[0], states[b].shape[0])
                    same = (states[a][:n] == states[b][:n]).all(dim=1)
                    entry[f"{a}_vs_{b}"] = {
                        "identical_tiles": same.float().mean().item(),
                        "identical_states": (states[a][:n] == states[b][:n]).float().mean().item(),
                    }


def linear_exl3_weight(t: EXL3Tensor) -> torch.Tensor:
    """exllamav3's own reconstruction (in_pad, out_pad) fp16 of our stored tensors."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    stored = {k.split(".", 1)[1]: v.cuda() for k, v in t.tensors("w").items()}
    k, n = stored["suh"].shape[0], stored["svh"].shape[0]
    layer = LinearEXL3(
        None,
        k,
        n,
        suh=stored["suh"],
        svh=stored["svh"],
        trellis=stored["trellis"],
        mcg=stored.get("mcg"),
        mul1=stored.get("mul1"),
    )
    return layer.get_weight_tensor().cpu()


def linear_check(t: EXL3Tensor) -> dict:
    """exllamav3's LinearEXL3 reconstruction vs our decoder (both fp16, padded dims must match)."""
    ours = decode_weight(t, torch.float16).T.float()  # (in, out)
    theirs = linear_exl3_weight(t).float()[: t.in_features, : t.out_features]
    diff = (ours - theirs).abs()
    return {
        "bit_identical": bool(torch.equal(ours, theirs)),
        "max_abs_diff": diff.max().item(),
        "max_rel_diff": (diff / theirs.abs().clamp(min=1e-3)).max().item(),
        "weight_abs_max": theirs.abs().max().item(),
    }


def exllamav3_quantize(
    w_in_out: torch.Tensor, h: torch.Tensor, bits: int, cb: Codebook, seed: int
) -> tuple[float, float, dict]:
    """exllamav3's quantize_exl3 on the same (W, H): (proxy error, seconds, its tensors)."""
    from exllamav3.modules.quant.exl3_lib.quantize import quantize_exl3

    h_data = {"H": h.cuda().float().clone(), "count": 1, "finalized": False}
    args = {"K": bits, "seed": seed, "devices": [0], "apply_out_scales": True}
    if cb is not Codebook.THREE_INST:
        args[cb.value] = True
    (_, err, tensors), seconds = timed(quantize_exl3, w_in_out.cuda().float().clone(), h_data, args, False)
    return err, seconds, tensors


def encode_all(
    entry: dict, w_hf: torch.Tensor, h: torch.Tensor, bits: int, cb: Codebook, skip_torch: bool, check_linear: bool
) -> dict[str, EXL3Tensor]:
    """Our encoder with every available backend; records seconds, proxy error, LinearEXL3 check."""
    out = {}
    for name, device in backends_to_compare(skip_torch):
        result, seconds = timed(encode_linear, w_hf, h, bits, cb, seed=0, device=device, backend=name)
        out[name] = result.tensor
        entry[f"ours_{name}"] = {
            "seconds": round(seconds, 3),
            "proxy_error": result.proxy_error,
            "fallback": result.fallback,
        }
        if check_linear and exllamav3_available():
            try:
                entry[f"ours_{name}"]["linear_exl3"] = linear_check(result.tensor)
            except Exception as err:  # noqa: BLE001 - recorded per backend
                entry[f"ours_{name}"]["linear_exl3"] = {"error": f"{type(err).__name__}: {err}"}
    names = list(out)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            entry[f"trellis_{a}_vs_{b}_identical_tiles"] = (
                (out[a].trellis == out[b].trellis).all(dim=-1).float().mean().item()
            )
    return out


def golden_step(rec: Recorder, golden_path: Path, skip_torch: bool) -> None:
    from safetensors.torch import load_file

    golden = load_file(str(golden_path))
    meta = json.loads(golden_path.with_suffix(".json").read_text())
    for tag in CASES:
        with rec.step(f"golden.{tag}") as entry:
            cb_name, k = tag.split(".K")
            cb, bits = Codebook(cb_name), int(k)
            entry["decode_Q_bit_exact"] = bool(
                torch.equal(
                    decode_inner(golden[f"{tag}.trellis"], cb).view(torch.int16), golden[f"{tag}.Q"].view(torch.int16)
                )
            )
            ref = EXL3Tensor.from_tensors(golden, tag, 256, 128)
            if exllamav3_available():
                entry["golden_linear_exl3"] = linear_check(ref)
            entry["reference_proxy_error"] = meta[f"golden.{tag}"]["proxy_err"]
            w_hf, h = golden[f"{tag}.W"].T.contiguous(), golden[f"{tag}.H"]
            encode_all(entry, w_hf, h, bits, cb, skip_torch, check_linear=True)
            if exllamav3_available():
                err, seconds, _ = exllamav3_quantize(golden[f"{tag}.W"], h, bits, cb, seed=1234)
                entry["exllamav3_quantize_exl3"] = {"proxy_error": err, "seconds": round(seconds, 3), "seed": 1234}


def random_layer(in_f: int, out_f: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and a Hessian of correlated activations with a few outlier channels."""
    g = torch.Generator(device=device).manual_seed(in_f + out_f)
    x = torch.randn(2 * in_f, in_f, generator=g, device=device)
    x = x @ (torch.randn(in_f, in_f, generator=g, device=device) / in_f**0.5)
    x[:, : in_f // 32] *= 6.0
    h = (x.T @ x / x.shape[0]).cpu()
    return (torch.randn(out_f, in_f, generator=g, device=device) * 0.02).cpu(), h


def large_step(rec: Recorder, skip_torch: bool, summary: dict) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with rec.step("large.warmup"):
        w, h = random_layer(256, 256, device)
        for name, dev in backends_to_compare(skip_torch):
            encode_linear(w, h, 2, Codebook.MCG, device=dev, backend=name)
    for in_f, out_f in LARGE:
        with rec.step(f"large.{in_f}x{out_f}.K2.mcg") as entry:
            w, h = random_layer(in_f, out_f, device)
            encode_all(entry, w, h, 2, Codebook.MCG, skip_torch, check_linear=True)
            if exllamav3_available():
                err, seconds, _ = exllamav3_quantize(w.T.contiguous(), h, 2, Codebook.MCG, seed=0)
                entry["exllamav3_quantize_exl3"] = {"proxy_error": err, "seconds": round(seconds, 3)}
            summary[f"{in_f}x{out_f}"] = {
                k: v["seconds"] for k, v in entry.items() if isinstance(v, dict) and "seconds" in v
            }
        if out_f > BATCH_MAX_OUT:
            continue
        with rec.step(f"large.batch{BATCH}.{in_f}x{out_f}.K2.mcg") as entry:
            g = torch.Generator().manual_seed(7)
            items = [(torch.randn(out_f, in_f, generator=g) * 0.02, h) for _ in range(BATCH)]
            for name, dev in backends_to_compare(skip_torch):
                results, seconds = timed(encode_linears, items, 2, Codebook.MCG, device=dev, backend=name)
                entry[f"ours_{name}"] = {
                    "seconds_per_tensor": round(seconds / BATCH, 3),
                    "proxy_errors": [r.proxy_error for r in results],
                }
            summary[f"{in_f}x{out_f} batch of {BATCH}, per tensor"] = {
                k: v["seconds_per_tensor"] for k, v in entry.items() if isinstance(v, dict)
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON results")
    parser.add_argument("--golden", type=Path, default=ROOT / "tests" / "data" / "exl3_golden.safetensors")
    parser.add_argument("--tiles", type=int, default=4096, help="random tiles per backend in the tiles step")
    parser.add_argument("--skip-torch", action="store_true", help="leave out the (slow) torch CUDA backend")
    parser.add_argument("--skip-large", action="store_true", help="leave out the 4096-wide timing tensors")
    args = parser.parse_args()
    encodes_computed()

    rec = Recorder(args.out)
    with rec.step("env") as entry:
        env_info(entry)
        print("    ", json.dumps(entry), flush=True)
    tiles_step(rec, args.tiles, args.skip_torch)
    golden_step(rec, args.golden, args.skip_torch)
    summary: dict = {"unit": "seconds per tensor, K2 MCG, (in x out)", "gpu": rec.data["steps"]["env"].get("gpu")}
    if not args.skip_large:
        large_step(rec, args.skip_torch, summary)
    failed = [name for name, e in rec.data["steps"].items() if not e.get("ok")]
    rec.data["failed_steps"] = failed
    rec.save()
    (args.out / "exl3_gpu_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"done: {len(rec.data['steps']) - len(failed)} steps ok, {len(failed)} failed {failed}; results in {args.out}"
    )


if __name__ == "__main__":
    main()
