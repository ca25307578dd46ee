"""The main job on the embedded default: every stage of the pipeline on the tiny model."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.fixtures import build_tiny_checkpoint
from glmquant.plan import load_source_shards, summarize


def run_demo(out_dir: Path, console: Console) -> str:
    source = out_dir / "source"
    console.rule("1. tiny BF16 source checkpoint")
    build_tiny_checkpoint(source)
    spec = load_model_spec(source)
    console.print(f"{spec.architecture}: {spec.num_hidden_layers} layers, MoE layers {spec.moe_layers}, "
                  f"{spec.n_routed_experts} experts, MTP layers {spec.mtp_layers}")
    console.rule("2. plan (tr3, K2, mcg)")
    plan = plan_artifact(spec, "tr3", source_shards=load_source_shards(source / "model.safetensors.index.json"))
    summary = summarize(plan)
    console.print(f"{summary.file_count} files ({summary.expert_file_count} expert shards), "
                  f"{summary.indexed_tensor_count} tensors, {summary.physical_bytes:,} bytes, "
                  f"decode reads {summary.decode_bytes_per_token:,} B/token")
    return str(source)
