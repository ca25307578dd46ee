"""The whole-model benchmark runs every part on the CPU at tiny sizes (`--smoke`, the code path the H200 runs with
the real config) and writes the report the issue asks for: decode and prefill rows, the per-class breakdown with
bytes, the GB10 projection with its formula and assumptions, and the summary keys; `--merge` recombines parts."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from glmquant.arch import load_model_spec
from glmquant.checkpoint.layouts import quantizable_retained

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_model.py"

pytestmark = pytest.mark.slow


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the smoke run uses the torch expert backend
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )


def _refused(script: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """The exit status and message of a run the script refuses, in this process (no interpreter to start): the
    status argparse or `sys.exit(message)` gives, and what it wrote to stderr."""
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exited:
        mp.setattr(sys, "argv", [str(SCRIPT), *argv])
        script.main()
    code, err = exited.value.code, capsys.readouterr().err
    return (1, f"{err}{code}\n") if isinstance(code, str) else (int(code or 0), err)


def test_smoke_run_writes_every_part_and_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    run = _run("--smoke", "--commit", "abc123", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert not [key for key in parts if key.endswith("_error")], parts
    assert report["commit"] == "abc123" and report["environment"]["torch"]
    assert report["model"]["not_resident"]["tensors"] > 0  # the MTP layer and vision tower
    assert (report["model"]["retained_linears"], report["model"]["head_exl3"]) == (0, False)
    assert all(row["tokens_equal"] for row in parts["graphs"])
    assert {(r["context"], r["batch"]) for r in parts["decode"]} == {(24, 1), (24, 2), (40, 1), (40, 2)}
    assert all(r["tok_s"] > 0 for r in parts["decode"]) and parts["prefill"][0]["tokens"] == 48
    classes = parts["classes"]["classes"]
    assert set(classes) == {"kda", "mla_dsa", "routed_moe", "shared_dense_mlp", "lm_head", "rest"}
    assert all(c["bytes_per_token"] > 0 for c in classes.values())
    projection = parts["classes"]["projection"]
    assert "max(bytes_c / BW" in projection["formula"] and projection["assumptions"]["gb10"]["clock_source"]
    assert set(projection["classes"]) == set(classes)
    for work in ("decode_step_eager_b1", "prefill_chunk"):
        table = parts["kernels"][work]
        assert table["launches"] >= table["distinct"] >= len(table["top"]) > 0
        assert table["total_ms"] > 0 and 0 < sum(r["share"] for r in table["top"]) <= 1 + 1e-6
    mtp = parts["mtp"]
    assert [r["k"] for r in mtp["rows"]] == [1, 2, 3] and "(draft_ms x k + verify_ms)" in mtp["formula"]
    for row in mtp["rows"]:
        assert row["draft_ms"] > 0 and row["verify_ms"] > 0 and row["rollback_ms"] > 0 and row["measured_tok_s"] > 0
        assert 0 <= row["measured_acceptance_rate"] <= 1
        verify_classes = row["verify_classes_ms"]  # where the verify's time goes, class by class
        assert set(verify_classes) == {*classes, "rest"}
        assert all(verify_classes[c] > 0 for c in classes if c != "rest")
        assert verify_classes["rest"] == pytest.approx(
            row["verify_ms"] - sum(v for c, v in verify_classes.items() if c != "rest"), abs=1e-3
        )
        rates = row["tok_s_at_accepted_per_step"]
        assert rates["0"] < rates[f"{row['k']:g}"]  # more accepted drafts, more tokens per second
        read = row["verify_bytes"]  # more routed experts and KDA state records than one token's
        assert set(read) == set(verify_classes)
        assert read["routed_moe"] > classes["routed_moe"]["bytes_per_token"]
        assert read["kda"] > classes["kda"]["bytes_per_token"]
    assert mtp["draft_bytes"] > classes["lm_head"]["bytes_per_token"]  # the MTP layer besides the head
    summary = report["summary"]
    assert set(summary) >= {
        "decode_tok_s_b1",
        "decode_tok_s_b16",
        "prefill_200k_s",
        "peak_gpu_gb",
        "gb10_tok_s_218",
        "gb10_tok_s_273",
    }
    assert summary["decode_tok_s_b1"] > 0 and summary["gb10_tok_s_273"] >= summary["gb10_tok_s_218"] > 0
    assert summary["graphs_equal_eager"] is True and summary["logits_finite"] is True
    assert all(summary[f"mtp_verify_ms_k{k}"] > 0 for k in (1, 2, 3)) and summary["mtp_draft_ms"] > 0

    merged = tmp_path / "merged.json"
    assert _run("--merge", str(out), str(out), "--out", str(merged)).returncode == 0
    assert json.loads(merged.read_text())["summary"] == summary

    # projected at a trained proxy's MTP acceptance (bench_fidelity's mtp_acceptance): k = 2 only measured there
    fidelity = tmp_path / "fidelity.json"
    fidelity.write_text(json.dumps({"mtp_acceptance": {"k2": {"tokens_per_step": 2.2, "acceptance_rate": 0.6}}}))
    run = _run("--merge", str(out), "--fidelity", str(fidelity), "--out", str(merged))
    assert run.returncode == 0, run.stderr[-3000:]
    projected = json.loads(merged.read_text())["mtp_at_proxy_acceptance"]
    mtp = report["parts"]["mtp"]
    row = next(r for r in mtp["rows"] if r["k"] == 2)
    tok_s = 1000 * 2.2 / (2 * row["draft_ms"] + row["verify_ms"])
    assert [r["k"] for r in projected["rows"]] == [2] and projected["best_k"] == 2
    assert projected["rows"][0]["tok_s"] == pytest.approx(tok_s, abs=0.01)
    assert projected["speedup"] == pytest.approx(tok_s / mtp["plain_tok_s"], abs=1e-3)
    # the same step on the GB10, each class and the draft at max(bytes / 218 GB/s, H200 ms x compute scale)
    scale = projection["assumptions"]["compute_scale"]

    def gb10_ms(ms: float, nbytes: int) -> float:
        return max(nbytes / 218e6, ms * scale)

    verify = sum(gb10_ms(ms, row["verify_bytes"][c]) for c, ms in row["verify_classes_ms"].items())
    step = 2 * gb10_ms(row["draft_ms"], mtp["draft_bytes"]) + verify
    gb10 = projected["rows"][0]["gb10_218"]
    assert gb10["step_ms"] == pytest.approx(step, rel=1e-3)
    assert gb10["speedup"] == pytest.approx(2.2 * projection["gb10_ms_218"] / step, rel=1e-3)
    assert projected["gb10_best_k"] == 2 and projected["gb10_speedup_218"] == gb10["speedup"]


def test_smoke_run_of_the_speed_tier_fills_speed_tier(tiny_source: Path, tmp_path: Path) -> None:
    """`--retained-bits 4 --head-bits 6`: the dummy artifact holds EXL3 retained linears and head, the engine runs
    them, `model` records both K, the retained linears (the head apart) and the EXL3 head, and `speed_tier` holds
    both K, bytes per token and the GB10 projection, with MTP speedup and KL cost left to others; merged with a
    proxy fidelity run the KL cost is its row with the same retained and head K (not the head-less row's)."""
    out = tmp_path / "tier.json"
    args = ("--retained-bits", "4", "--head-bits", "6", "--parts", "graphs,decode,classes")
    run = _run("--smoke", *args, "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not [key for key in report["parts"] if key.endswith("_error")], report["parts"]
    model = report["model"]
    assert (model["retained_bits"], model["head_bits"], model["head_exl3"]) == (4, 6, True)
    assert not Path(model["config"]).exists()  # the smoke model lived in the run's scratch directory
    assert model["retained_linears"] == len(quantizable_retained(load_model_spec(tiny_source / "config.json"))) > 1
    assert all(row["tokens_equal"] and row["logits_finite"] for row in report["parts"]["graphs"])
    tier, classes = report["speed_tier"], report["parts"]["classes"]
    assert (tier["retained_bits"], tier["head_bits"]) == (4, 6)
    assert tier["bytes_per_token"] == sum(c["bytes_per_token"] for c in classes["classes"].values()) > 0
    assert tier["gb10_tok_s_218"] == classes["projection"]["gb10_tok_s_218"] > 0
    assert tier["gb10_bandwidth_bound_tok_s_218"] == pytest.approx(218e9 / tier["bytes_per_token"], abs=0.01)
    assert tier["gb10_bandwidth_bound_tok_s_218"] >= tier["gb10_tok_s_218"]
    assert tier["mtp_speedup"] is None and "mtp part" in tier["mtp_speedup_from"]
    assert tier["kl_cost_ratio"] is None and "retained-k4-head6 row" in tier["kl_cost_ratio_from"]

    fidelity = tmp_path / "fidelity.json"
    fidelity.write_text(json.dumps({"rows": FIDELITY_ROWS, "commit": "abc1234"}))
    merged = tmp_path / "merged.json"
    run = _run("--merge", str(out), "--fidelity", str(fidelity), "--out", str(merged))
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(merged.read_text())
    assert record["speed_tier"]["kl_cost_ratio"] == 0.71 and record["fidelity_from"]["commit"] == "abc1234"
    assert "lm_head EXL3 K6" in record["speed_tier"]["kl_cost_ratio_from"]


def test_smoke_mtp_part_drafts_with_a_draft_head(
    bench_model: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--draft-head-bits 4`: the engine's drafts read a random EXL3 K4 copy of lm_head; refused without the mtp
    part or outside K2-K8."""
    out = tmp_path / "mtp.json"
    run = _run("--smoke", "--parts", "mtp", "--draft-head-bits", "4", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["draft_head_bits"] == 4 and "mtp_error" not in report["parts"], report["parts"]
    assert [r["k"] for r in report["parts"]["mtp"]["rows"]] == [1, 2, 3]
    assert all(r["draft_ms"] > 0 for r in report["parts"]["mtp"]["rows"])
    fidelity = tmp_path / "fidelity.json"
    acceptance: dict[str, object] = {"artifact": "seed", "draft_head": "draft_head_k4.safetensors"}
    acceptance |= {f"k{k}": {"tokens_per_step": 1.5, "acceptance_rate": 0.5} for k in (1, 2, 3)}
    fidelity.write_text(json.dumps({"rows": [], "mtp_acceptance": acceptance}))
    merged = tmp_path / "merged.json"
    assert _run("--merge", str(out), "--fidelity", str(fidelity), "--out", str(merged)).returncode == 0
    projected = json.loads(merged.read_text())["mtp_at_proxy_acceptance"]
    assert projected["timed_draft_head_bits"] == 4
    assert projected["acceptance_from"]["draft_head"] == "draft_head_k4.safetensors"
    assert [r["k"] for r in projected["rows"]] == [1, 2, 3]
    for argv in (("--parts", "decode", "--draft-head-bits", "4"), ("--parts", "mtp", "--draft-head-bits", "9")):
        status, err = _refused(bench_model, capsys, "--smoke", *argv, "--out", str(tmp_path / "bad.json"))
        assert status == 2 and "--draft-head-bits takes K 2..8 with the mtp part" in err
    status, err = _refused(bench_model, capsys, "--smoke", "--parts", "mtp", "--draft-mtp-bits", "4")
    assert status == 2 and "--draft-mtp-bits takes K 2..8 with --draft-head-bits" in err


def test_smoke_mtp_part_drafts_with_an_mtp_copy(tmp_path: Path) -> None:
    """`--draft-mtp-bits 4`: the draft file also holds a random EXL3 copy of the MTP layer (K4 linears, K2 routed
    experts), which the drafts read; the report records it."""
    out = tmp_path / "mtp.json"
    run = _run("--smoke", "--parts", "mtp", "--draft-head-bits", "4", "--draft-mtp-bits", "4", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["draft_mtp_bits"] == 4 and "mtp_error" not in report["parts"], report["parts"]
    assert all(r["draft_ms"] > 0 for r in report["parts"]["mtp"]["rows"])
    fidelity = tmp_path / "fidelity.json"
    acceptance = {f"k{k}": {"tokens_per_step": 1.5, "acceptance_rate": 0.5} for k in (1, 2, 3)}
    fidelity.write_text(json.dumps({"rows": [], "mtp_acceptance": acceptance}))
    merged = tmp_path / "merged.json"
    assert _run("--merge", str(out), "--fidelity", str(fidelity), "--out", str(merged)).returncode == 0
    projected = json.loads(merged.read_text())["mtp_at_proxy_acceptance"]
    assert projected["timed_draft_head_bits"] == 4 and projected["timed_draft_mtp_bits"] == 4


def test_fewer_routed_experts_held_read_the_whole_models_bytes(
    bench_model: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--routed-experts 3` builds the tiny model's MoE layers with 3 of their 4 experts (a GPU smaller than the
    model): a decode step's bytes, the left-out router rows added back, equal the whole model's, and the MTP draft's
    too; the report records what was held. Fewer than a token picks, or more than the config has, are refused."""
    reports = {}
    for held in ("3", None):
        out = tmp_path / f"held{held}.json"
        run = _run(
            "--smoke", "--parts", "classes,mtp", *(("--routed-experts", held) if held else ()), "--out", str(out)
        )
        assert run.returncode == 0, run.stderr[-3000:]
        reports[held] = json.loads(out.read_text())
    fewer, whole = reports["3"], reports[None]
    assert fewer["model"]["routed_experts"] | {"unheld_are": None} == {
        "per_layer": 3,
        "per_token": 2,
        "unheld_per_layer": 1,
        "unheld_are": None,
    }
    assert whole["model"]["routed_experts"]["unheld_per_layer"] == 0
    bytes_of = {
        h: {c: v["bytes_per_token"] for c, v in r["parts"]["classes"]["classes"].items()} for h, r in reports.items()
    }
    assert bytes_of["3"] == bytes_of[None]
    assert fewer["parts"]["mtp"]["draft_bytes"] == whole["parts"]["mtp"]["draft_bytes"]
    for count in ("1", "5"):
        status, err = _refused(bench_model, capsys, "--smoke", "--routed-experts", count, "--out", str(tmp_path / "b"))
        assert status == 1 and "--routed-experts takes 2..4" in err and f"not {count}" in err
        assert not (tmp_path / "b").exists()


FIDELITY_ROWS = [
    {"recipe": "retained-k5", "kl_cost_ratio": 0.62},
    {"recipe": "retained-k4", "kl_cost_ratio": 1.04},
    {"recipe": "retained-k4-head6", "kl_cost_ratio": 0.71},
    {"recipe": "retained-k4-head6-exact2", "kl_cost_ratio": 0.09},
]


@pytest.fixture(scope="module")
def bench_model() -> ModuleType:
    """The script as a module (a script, not a package: its dataclasses resolve their module by name)."""
    spec = importlib.util.spec_from_file_location("bench_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_with_widths_by_layer(
    bench_model: ModuleType, capsys: pytest.CaptureFixture[str], tiny_source: Path, tmp_path: Path
) -> None:
    """`--retained-layer-bits exact,K4,K5`: the dummy artifact holds layer 1's linears at K4 and layer 2's at K5,
    layer 0's exact; `model` and `speed_tier` record the widths; the KL cost waits for --kl-cost-row. Given with
    --retained-bits it is refused before anything runs."""
    out = tmp_path / "layers.json"
    widths = "exact,K4,K5"
    run = _run("--smoke", "--retained-layer-bits", widths, "--parts", "classes", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    model, tier = report["model"], report["speed_tier"]
    spec = load_model_spec(tiny_source / "config.json")  # the smoke model is the default tiny model
    assert spec.num_hidden_layers == 3 and model["retained_layer_bits"] == tier["retained_layer_bits"] == [None, 4, 5]
    assert model["retained_bits"] is None
    assert model["retained_linears"] == sum(1 for t in quantizable_retained(spec) if t.layer in (1, 2)) > 0
    assert (
        tier["bytes_per_token"] > 0 and tier["kl_cost_ratio"] is None and "--kl-cost-row" in tier["kl_cost_ratio_from"]
    )
    status, err = _refused(
        bench_model, capsys, "--smoke", "--retained-layer-bits", widths, "--retained-bits", "4", "--out", str(out)
    )
    assert status == 2 and "replaces --retained-bits" in err and json.loads(out.read_text()) == report  # untouched
    status, err = _refused(bench_model, capsys, "--smoke", "--retained-layer-bits", "K4,5", "--out", str(out))
    assert status == 2 and "entry 1 ('5') is neither" in err


def test_kl_cost_is_the_fidelity_row_with_the_same_retained_and_head_k(bench_model: ModuleType) -> None:
    """Merged with a proxy fidelity run, a speed-tier report takes the KL cost of the row with its retained K and
    head K and exact first layers (`retained-k4`, `retained-k4-head6`, `retained-k4-head6-exact2`), not another's;
    with an EXL3 head alone it stays null with a note (the bench has no such row); `kl_cost_row` names another row,
    and the proxy's widths of a widths row are named beside its cost."""
    fidelity = {"rows": FIDELITY_ROWS}
    for model, want, row in (
        ({"retained_bits": 4, "head_bits": None}, 1.04, "retained-k4 row"),
        ({"retained_bits": 4, "head_bits": 6}, 0.71, "retained-k4-head6 row"),
        ({"retained_bits": 4, "head_bits": 6, "retained_exact_layers": 2}, 0.09, "retained-k4-head6-exact2 row"),
        ({"retained_bits": 5, "head_bits": 6}, None, "retained-k5-head6 row"),  # not measured: not retained-k5's
    ):
        tier = bench_model.merge([{"model": model, "parts": {}}], fidelity)["speed_tier"]
        assert tier["kl_cost_ratio"] == want and row in tier["kl_cost_ratio_from"], model
    named = bench_model.merge([{"model": {"retained_bits": 4, "head_bits": 6}, "parts": {}}], fidelity, "retained-k4")
    assert (
        named["speed_tier"]["kl_cost_ratio"] == 1.04
        and "retained-k4 row, named by" in named["speed_tier"]["kl_cost_ratio_from"]
    )
    widths = {"recipe": "retained-layer-cost-k3-head5", "kl_cost_ratio": 1.2, "retained_layer_bits": "K5,K2"}
    by_widths = bench_model.merge(
        [{"model": {"retained_bits": 3, "head_bits": 5}, "parts": {}}], {"rows": [widths]}, widths["recipe"]
    )["speed_tier"]
    assert by_widths["kl_cost_ratio"] == 1.2 and "(the proxy's layers at K5,K2)" in by_widths["kl_cost_ratio_from"]
    tier = bench_model.merge([{"model": {"retained_bits": None, "head_bits": 6}, "parts": {}}], fidelity)["speed_tier"]
    assert tier["kl_cost_ratio"] is None
    assert "head_bits 6" in tier["kl_cost_ratio_from"] and "kNone" not in tier["kl_cost_ratio_from"]


def test_head_bits_alone_make_a_speed_tier_report(bench_model: ModuleType) -> None:
    """A report whose model has an EXL3 head and exact retained linears (`--head-bits` alone) gets its `speed_tier`
    when merged; one from before --head-bits (no head_bits key) and without retained_bits gets none."""
    head_only = bench_model.merge([{"model": {"retained_bits": None, "head_bits": 6}, "parts": {}}])
    assert {k: head_only["speed_tier"][k] for k in ("retained_bits", "head_bits")} == {
        "retained_bits": None,
        "head_bits": 6,
    }
    assert "speed_tier" not in bench_model.merge([{"model": {"retained_bits": None}, "parts": {}}])


def test_merge_refuses_parts_timed_apart_and_recomputes_what_it_derives(bench_model: ModuleType) -> None:
    """Parts timed at another commit, on another card or of another model are not merged (the error names what
    differs); an earlier merge's MTP projection, fidelity source and speed tier are not carried into a new merge;
    an unknown --kl-cost-row is an error, and a KL cost with no row says why it is missing."""
    base: dict[str, Any] = {
        "commit": "abc1234",
        "environment": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
        "model": {"retained_bits": 3, "head_bits": 5, "routed_experts": {"per_layer": 160}},
        "parts": {"classes": {}},
    }
    for key, other in (
        ("commit", {"commit": "def5678"}),
        ("environment.gpu", {"environment": {**base["environment"], "gpu": "NVIDIA H200"}}),
        ("model.retained_bits", {"model": {**base["model"], "retained_bits": 4}}),
        ("model.routed_experts.per_layer", {"model": {**base["model"], "routed_experts": {"per_layer": 288}}}),
        ("draft_head_bits", {"draft_head_bits": 4}),
    ):
        with pytest.raises(ValueError, match=rf"not timed alike: {re.escape(key)} .* in report 1, .* in report 2"):
            bench_model.merge([base, {**base, **other, "parts": {"mtp": {}}}])
    stale = {**base, "mtp_at_proxy_acceptance": {"speedup": 9.9}, "fidelity_from": {"commit": "old"}}
    again = bench_model.merge([stale])
    assert "mtp_at_proxy_acceptance" not in again and "fidelity_from" not in again
    assert again["speed_tier"]["mtp_speedup"] is None
    assert again["speed_tier"]["kl_cost_ratio_from"].startswith("not measured (no --fidelity given)")
    with pytest.raises(ValueError, match="--kl-cost-row retained-k3-hed5: no such row"):
        bench_model.merge([base], {"rows": FIDELITY_ROWS}, "retained-k3-hed5")
    absent = bench_model.merge([base], {"rows": FIDELITY_ROWS})["speed_tier"]
    assert absent["kl_cost_ratio"] is None
    assert absent["kl_cost_ratio_from"].startswith("not measured (the --fidelity results have no such row)")
