"""The main job on the embedded default: every stage of the pipeline on the tiny model.

fixture -> plan -> observe (REAP statistics + Hessians) -> encode (tr3, K2, MCG) -> verify-manifest ->
serve-check (the gates a tiny random model can be judged on: speed cells with the server's token counts,
and the fidelity of the artifact against its BF16 source; a random model cannot answer the text, tool,
multilingual, media or needle prompts, so those are listed as skipped). The manifest's time is fixed
(DEMO_EPOCH, or SOURCE_DATE_EPOCH), so the demo's headline hash is the same on every run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.provenance import build_timestamp
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.summary import summary_table
from glmquant.errors import GlmquantError, UsageError
from glmquant.fixtures import build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe
from glmquant.plan import load_source_shards, summarize
from glmquant.servecheck.config import REPORT_MD, ServeCheckConfig
from glmquant.servecheck.report import summary_table as serve_check_summary
from glmquant.servecheck.run import serve_check

DEMO_EPOCH = 1_767_225_600  # 2026-01-01T00:00:00Z: the demo's manifest time unless SOURCE_DATE_EPOCH says otherwise
CANNOT_ANSWER = "a tiny random model cannot answer it (run it on a real artifact)"


@dataclass(frozen=True)
class DemoResult:
    artifact: Path
    manifest_sha256: str
    verified_at: str
    serve_check_report: Path

    def summary_lines(self) -> list[str]:
        """What a person needs at the end: where the artifact is, its pinned hash, how to check it again."""
        return [
            f"artifact: {self.artifact} (manifest time {self.verified_at})",
            f"structural manifest SHA-256: {self.manifest_sha256}",
            f"serve-check report: {self.serve_check_report}",
            f"verify again: glmquant verify-manifest {self.artifact} --expect-sha256 {self.manifest_sha256}",
        ]


def _step(console: Console, title: str) -> None:
    console.print(f"\n[bold]== {title}[/]", highlight=False)


def run_demo(out_dir: Path, console: Console) -> DemoResult:
    source, observations, artifact = out_dir / "source", out_dir / "observations", out_dir / "artifact"
    _step(console, "1. tiny BF16 source checkpoint")
    build_tiny_checkpoint(source)
    spec = load_model_spec(source)
    console.print(
        f"{spec.architecture}: {spec.num_hidden_layers} layers, MoE layers {spec.moe_layers}, "
        f"{spec.n_routed_experts} experts, MTP layers {spec.mtp_layers}"
    )
    _step(console, "2. plan (tr3, K2, mcg)")
    summary = summarize(
        plan_artifact(spec, "tr3", source_shards=load_source_shards(source / "model.safetensors.index.json"))
    )
    console.print(
        f"{summary.file_count} files ({summary.expert_file_count} expert shards), "
        f"{summary.indexed_tensor_count} tensors, {summary.physical_bytes:,} bytes, "
        f"decode reads {summary.decode_bytes_per_token:,} B/token"
    )
    _step(console, "3. observe: layer-streamed calibration, REAP statistics, Hessians")
    obs = observe(ObserveConfig(source=source, out=observations), progress=True)
    console.print(
        f"{len(obs.layers)} layers observed, token rows {obs.token_rows_sha256[:16]}…, "
        f"peak RSS {obs.peak_rss_bytes / 2**20:.0f} MiB"
    )
    _step(console, "4. encode (tr3, K2, mcg, natural-routing Hessians)")
    verified_at = build_timestamp(DEMO_EPOCH)
    result = encode_artifact(
        EncodeConfig(source=source, out=artifact, observations=observations, verified_at=verified_at), console
    )
    if result is None or result.verification is None:
        raise UsageError("the demo runs in one process (not under torchrun) and verifies what it encodes")
    console.print(summary_table(result.layers))
    _step(console, "5. verify-manifest (run by encode: every file hashed against EXL3_MANIFEST.json)")
    console.print(f"all {len(result.verification.checks)} checks passed")
    _step(console, "6. serve-check (embedded server, official openai client)")
    check = serve_check(
        ServeCheckConfig(
            artifact=artifact,
            gates=("speed", "fidelity"),
            speed_inputs=(256, 1024),
            max_tokens=16,
            bf16_source=source,
            kl_max=0.05,
            top1_min=0.25,
            min_decode_tps=1.0,
            seed=1,
            deselected_reason=CANNOT_ANSWER,
        )
    )
    console.print(serve_check_summary(check))
    if not check.passed:
        raise GlmquantError(f"serve-check failed; see {artifact / REPORT_MD}")
    return DemoResult(artifact, result.artifact.manifest_sha256, verified_at, artifact / REPORT_MD)
