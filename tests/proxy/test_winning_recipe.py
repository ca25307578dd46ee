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

    model = small_proxy / "model"
    _run(
        ["serve-check", str(art), "--bf16-source", str(model), "--gates", "fidelity,speed", "--out", str(tmp_path)]
        + ["--panel-rows", "2", "--panel-tokens", "48", "--speed-inputs", "128", "--max-tokens", "8"]
        + ["--min-decode-tps", "0.1", "--seed", "0", "--kl-max", "0.5", "--top1-min", "0.5"]
        + ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    )
    report = json.loads((tmp_path / "serve-check.json").read_text())
    gates = {g["name"]: g for g in report["gates"]}
    assert gates["fidelity"]["passed"] and gates["speed"]["passed"], report
    fidelity = gates["fidelity"]["cases"][0]
    assert fidelity["expected"] == {"mean_kl_max": 0.5, "top1_agreement_min": 0.5}
    metrics = fidelity["metrics"]
    # a 2-bit artifact is not the BF16 proxy: its KL is positive, yet small on a model this close to uniform
    assert 0 < metrics["mean_kl"] < 0.5 and math.isfinite(metrics["artifact_ppl"])
    speed = gates["speed"]["cases"][0]["metrics"]
    assert speed["tokens_per_step"] is not None and speed["tokens_per_step"] >= 1.0
