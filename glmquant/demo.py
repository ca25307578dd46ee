"""The main job on the embedded default: every stage of the pipeline on the tiny model.

fixture -> plan -> observe (REAP statistics + Hessians) -> encode (tr3, K2, MCG) -> verify-manifest ->
serve-check (the gates a tiny random model can be judged on: speed cells with the server's token counts,
and the fidelity of the artifact against its BF16 source; a random model cannot answer the text, tool,
multilingual, media or needle prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.summary import summary_table
from glmquant.errors import GlmquantError
from glmquant.fixtures import build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe
from glmquant.plan import load_source_shards, summarize
from glmquant.servecheck.config import ServeCheckConfig
from glmquant.servecheck.run import serve_check


@dataclass(frozen=True)
class DemoResult:
    artifact: Path
    manifest_sha256: str


def run_demo(out_dir: Path, console: Console) -> DemoResult:
    source, observations, artifact = out_dir / "source", out_dir / "observations", out_dir / "artifact"
    console.rule("1. tiny BF16 source checkpoint")
    build_tiny_checkpoint(source)
    spec = load_model_spec(source)
    console.print(f"{spec.architecture}: {spec.num_hidden_layers} layers, MoE layers {spec.moe_layers}, "
                  f"{spec.n_routed_experts} experts, MTP layers {spec.mtp_layers}")
    console.rule("2. plan (tr3, K2, mcg)")
    summary = summarize(plan_artifact(spec, "tr3", source_shards=load_source_shards(source / "model.safetensors.index.json")))
    console.print(f"{summary.file_count} files ({summary.expert_file_count} expert shards), "
                  f"{summary.indexed_tensor_count} tensors, {summary.physical_bytes:,} bytes, "
                  f"decode reads {summary.decode_bytes_per_token:,} B/token")
    console.rule("3. observe: layer-streamed calibration, REAP statistics, Hessians")
    obs = observe(ObserveConfig(source=source, out=observations), progress=True)
    console.print(f"{len(obs.layers)} layers observed, token rows {obs.token_rows_sha256[:16]}…, "
                  f"peak RSS {obs.peak_rss_bytes / 2**20:.0f} MiB")
    console.rule("4. encode (tr3, K2, mcg, natural-routing Hessians)")
    result = encode_artifact(EncodeConfig(source=source, out=artifact, observations=observations), console)
    console.print(summary_table(result.layers))
    console.rule("5. verify-manifest (run by encode: every file hashed against EXL3_MANIFEST.json)")
    console.print(f"all {len(result.verification.checks)} checks passed")
    console.rule("6. serve-check (embedded server, official openai client)")
    check = serve_check(ServeCheckConfig(artifact=artifact, gates=("speed", "fidelity"), speed_inputs=(256, 1024),
                                         max_tokens=16, bf16_source=source, kl_max=0.05, top1_min=0.25, seed=1))
    for gate in check.gates:
        console.print(f"{gate.name}: {'[green]pass' if gate.passed else '[red]FAIL'}[/]  {gate.summary}")
    if not check.passed:
        raise GlmquantError(f"serve-check failed; see {artifact / 'serve-check.md'}")
    console.print(f"[bold]structural manifest SHA-256:[/] {result.artifact.manifest_sha256}")
    return DemoResult(artifact, result.artifact.manifest_sha256)
