"""On a GPU with exllamav3 1.6.5: does an exllamav3-layout artifact of the tiny model load in ExLlamaV3, and
are its per-expert weights (reconstructed by ExLlamaV3's own LinearEXL3) equal to our decoder's?

    python scripts/gpu_exllamav3_interop.py --out DIR

Writes DIR/exllamav3_interop.json; every step records its own success or error instead of aborting.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
import traceback
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
    except Exception as exc:  # recorded, not raised: the other steps still run
        record[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    record[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(name, json.dumps({k: v for k, v in record[name].items() if k != "trace"})[:600], flush=True)


def compare_experts(artifact: Path) -> dict:
    from exllamav3.modules.quant.exl3 import LinearEXL3

    worst, count = 0.0, 0
    with SourceCheckpoint.open(artifact) as art:
        keys = sorted({n.rsplit(".", 1)[0] for n in art.names() if n.endswith(".trellis")})
        for key in keys:
            parts = {n: art.read_tensor(n) for n in (f"{key}.trellis", f"{key}.suh", f"{key}.svh", f"{key}.mcg") if n in art}
            t = EXL3Tensor.from_tensors(parts, key, parts[f"{key}.suh"].numel(), parts[f"{key}.svh"].numel())
            ours = decode_weight(t, torch.float32).T.cuda()  # (in, out) as ExLlamaV3 holds it
            theirs = LinearEXL3(None, t.in_features, t.out_features, suh=t.suh.cuda(), svh=t.svh.cuda(),
                                trellis=t.trellis.cuda(), mcg=parts.get(f"{key}.mcg"), key=key).get_weight_tensor().float()
            worst = max(worst, ((ours - theirs).abs().max() / ours.abs().max()).item())
            count += 1
    return {"expert_tensors_compared": count, "max_rel_diff": worst, "equal_to_fp16_rounding": worst < 2e-3}


def load_model(artifact: Path) -> dict:
    from exllamav3 import Config, Model

    config = Config.from_directory(str(artifact))
    model = Model.from_config(config)
    model.load("cuda:0")
    ids = torch.tensor([[256, 258, 260, 72, 101, 108, 108, 111]], dtype=torch.long)
    logits = model.forward(ids, {"attn_mode": "flash_attn_nc"}) if hasattr(model, "forward") else None
    out = {"architecture": config.architecture, "loaded": True}
    if logits is not None:
        out["logits_shape"] = list(logits.shape)
        out["logits_finite"] = bool(torch.isfinite(logits).all())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    work = Path(tempfile.mkdtemp())
    source, artifact = work / "source", work / "artifact"
    step(record, "build_fixture", lambda: {"path": str(build_tiny_checkpoint(source))})
    step(record, "encode_exllamav3_layout", lambda: {"manifest_sha256": encode_artifact(
        EncodeConfig(source=source, out=artifact, layout="exllamav3", device="cuda"), Console(quiet=True)).artifact.manifest_sha256})
    step(record, "exllamav3_version", lambda: {"version": __import__("exllamav3").__version__})
    step(record, "per_expert_weights_equal", lambda: compare_experts(artifact))
    step(record, "exllamav3_model_load", lambda: load_model(artifact))
    (args.out / "exllamav3_interop.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
