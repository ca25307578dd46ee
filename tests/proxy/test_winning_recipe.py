"""Issue 17's best recipe on the trained proxy, end to end: the fidelity benchmark's depth-tiers-tuned artifact
(K3 experts in the first MoE layer, K1 in the last, K2 between: the seed's bytes; scales tuned on the unit's output)
passes verify-manifest, then serve-check's fidelity gate against the BF16 proxy and its speed gate with the proxy's
own MTP layer drafting, through the CLI as a user runs them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip(
    "glmquant.runtime.server", reason="the runtime's embedded server (glmquant.runtime.server) is not importable here"
)

from proxy_helpers import BenchRun

from glmquant.cli import app
from glmquant.encode.scale_tuning import LEARNING_RATE

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fidelity-bench")]  # pytest-xdist: `bench_run` built once


def _run(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (args[0], result.output, result.exception)
    return result.output


def _serve_check(art: Path, model: Path, out: Path) -> dict:
    """serve-check's fidelity gate against the BF16 proxy and its speed gate with the proxy's MTP layer drafting:
    both pass, the 2-bit artifact's KL positive yet small; the fidelity case's metrics."""
    _run(
        ["serve-check", str(art), "--bf16-source", str(model), "--gates", "fidelity,speed", "--out", str(out)]
        + ["--panel-rows", "2", "--panel-tokens", "48", "--speed-inputs", "128", "--max-tokens", "8"]
        + ["--min-decode-tps", "0.1", "--seed", "0", "--kl-max", "0.5", "--top1-min", "0.5"]
        + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    )
    report = json.loads((out / "serve-check.json").read_text())
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["fidelity"]["passed"] and gates["speed"]["passed"], report
    fidelity = gates["fidelity"]["cases"][0]
    assert fidelity["expected"] == {"mean_kl_max": 0.5, "top1_agreement_min": 0.5}
    metrics = fidelity["metrics"]
    # a 2-bit artifact is not the BF16 proxy: its KL is positive, yet small on a model this close to uniform
    assert 0 < metrics["mean_kl"] < 0.5 and math.isfinite(metrics["artifact_ppl"])
    speed = gates["speed"]["cases"][0]["metrics"]
    assert speed["tokens_per_step"] is not None and speed["tokens_per_step"] >= 1.0
    return metrics


def test_depth_tiers_tuned_verifies_and_passes_serve_check(
    small_proxy: Path, bench_run: BenchRun, tmp_path: Path
) -> None:
    art = bench_run.work / "artifact-depth-tiers-tuned"  # the benchmark's row: observe --tuning-tokens N, encode
    # --tiers depth:K3=1,K2=rest,K1=1 --tune-scales 50 (the options a user passes)
    _run(["verify-manifest", str(art)])
    manifest = json.loads((art / "EXL3_MANIFEST.json").read_text())
    by_layer = manifest["layout"]["tier_experts_by_layer"]  # the small proxy's two MoE layers, first to last
    assert [set(by_layer[layer]) for layer in sorted(by_layer, key=int)] == [{"k3"}, {"k1"}], by_layer
    assert f"50 Adam steps at lr {LEARNING_RATE:g}" in json.dumps(manifest)
    _serve_check(art, small_proxy / "model", tmp_path)


def test_widths_named_per_layer_encode_verify_and_pass_serve_check(
    small_proxy: Path, bench_run: BenchRun, tmp_path: Path
) -> None:
    """The measured-widths recipe as a user runs it: `encode --tiers layers:K1,K3 --tune-scales 50` (K1 for the first
    MoE layer, K3 for the second: against the order of depth) from the benchmark's observations, then verify-manifest
    and serve-check."""
    art = tmp_path / "art"
    _run(
        ["encode", str(small_proxy / "model"), "--observations", str(bench_run.work / "obs-full"), "--out", str(art)]
        + ["--tiers", "layers:K1,K3", "--tune-scales", "50", "--layout", "exllamav3"]
    )
    _run(["verify-manifest", str(art)])
    by_layer = json.loads((art / "EXL3_MANIFEST.json").read_text())["layout"]["tier_experts_by_layer"]
    assert [set(by_layer[layer]) for layer in sorted(by_layer, key=int)] == [{"k1"}, {"k3"}], by_layer
    _serve_check(art, small_proxy / "model", tmp_path / "check")
