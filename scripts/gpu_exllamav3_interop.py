"""On a GPU with exllamav3 1.6.5: does an exllamav3-layout artifact of the tiny model load in ExLlamaV3, and
are its per-expert weights (reconstructed by ExLlamaV3's own LinearEXL3) equal to our decoder's?

    python scripts/gpu_exllamav3_interop.py --out DIR

Writes DIR/exllamav3_interop.json; every step records its own success or error instead of aborting.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

import torch
from rich.console import Console

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.exl3 import EXL3Tensor, decode_weight
from glmquant.fixtures import build_tiny_checkpoint


def step(record: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        record[name] = {"ok": True, **(fn() or {})}
    except Exception as exc:  # noqa: BLE001 - recorded, not raised: the other steps still run
        record[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    record[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps({k: v for k, v in record[name].items() if k != "trace"})[:600], flush=True)


def our_expert_weights(artifact: Path) -> dict[str, torch.Tensor]:
    """Every EXL3 tensor of the artifact decoded by our codec: prefix -> fp32 W (in, out), as ExLlamaV3 holds it."""
    out = {}
    with SourceCheckpoint.open(artifact) as art:
        for key in sorted({n.rsplit(".", 1)[0] for n in art.names() if n.endswith(".trellis")}):
            parts = {
                n: art.read_tensor(n) for n in (f"{key}.trellis", f"{key}.suh", f"{key}.svh", f"{key}.mcg") if n in art
            }
            t = EXL3Tensor.from_tensors(parts, key, parts[f"{key}.suh"].numel(), parts[f"{key}.svh"].numel())
            out[key] = decode_weight(t, torch.float32).T.contiguous()
    return out


def rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.cuda() - theirs.float()).abs().max() / ours.abs().max()).item()


def encode_plain(source: Path, artifact: Path) -> dict:
    """The tiny checkpoint encoded in ExLlamaV3's layout (uncalibrated) on the GPU."""
    cfg = EncodeConfig(source=source, out=artifact, layout="exllamav3", device="cuda", uncalibrated=True)
    result = encode_artifact(cfg, Console(quiet=True))
    assert result is not None  # one process: it writes the artifact
    return {"manifest_sha256": result.artifact.manifest_sha256}


def load_and_compare(artifact: Path) -> dict:
    """Load the artifact with ExLlamaV3's own loader and compare each expert Linear it built with our decode."""
    from exllamav3 import Config, Model

    config = Config.from_directory(str(artifact))
    model = Model.from_config(config)
    model.load("cuda:0")
    ours = our_expert_weights(artifact)
    seen, worst, missing_shape = set(), 0.0, []
    for module in model:
        inner = getattr(module, "inner", None)
        if inner is None or type(inner).__name__ != "LinearEXL3":
            continue
        key = next(
            (k for k in ours if module.key == k or module.key.endswith("." + k) or k.endswith("." + module.key)), None
        )
        if key is None:
            continue
        theirs = inner.get_weight_tensor()
        if tuple(theirs.shape) != tuple(ours[key].shape):
            missing_shape.append(key)
            continue
        worst = max(worst, rel_diff(ours[key], theirs))
        seen.add(key)
    result = {
        "architecture": config.architecture,
        "loaded": True,
        "exl3_tensors_in_artifact": len(ours),
        "expert_modules_compared": len(seen),
        "not_loaded_as_exl3": sorted(set(ours) - seen)[:10],
        "shape_mismatch": missing_shape[:10],
        "max_rel_diff": worst,
        "all_equal_to_fp16_rounding": len(seen) == len(ours) and worst < 2e-3,
    }
    try:
        ids = torch.tensor([[256, 258, 260, 72, 101, 108, 108, 111]], dtype=torch.long)
        logits = model.forward(ids, {"attn_mode": "flash_attn_nc"})
        result.update(forward_logits_shape=list(logits.shape), forward_logits_finite=bool(torch.isfinite(logits).all()))
    except Exception as exc:  # noqa: BLE001 - recorded: the load and the weights are the check, the tiny dims may not suit its kernels
        result["forward_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    work = Path(tempfile.mkdtemp())
    source, artifact = work / "source", work / "artifact"
    step(record, "build_fixture", lambda: {"path": str(build_tiny_checkpoint(source))})
    step(record, "encode_exllamav3_layout", lambda: encode_plain(source, artifact))
    step(record, "exllamav3_version", lambda: {"version": version("exllamav3")})
    step(record, "load_in_exllamav3_and_compare_experts", lambda: load_and_compare(artifact))
    (args.out / "exllamav3_interop.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
