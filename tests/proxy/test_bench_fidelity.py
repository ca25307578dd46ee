"""scripts/bench_fidelity.py end to end on the CPU at smoke size: a tiny trained proxy, recipes of every kind (Hessian
blend, gate-weighted Hessians with MUL1 and tuned scales, pruning, a reference width) encoded, verified and measured
against the BF16 proxy on held-out text, the results file with its summary; and every row's recipe spends the seed's
trellis bytes (the CPU encodes the rest too slowly for the suite: the GPU run measures all rows)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from proxy_helpers import SMOKE_COST_BITS, SMOKE_ROWS, BenchRun, run_bench

from glmquant.observe.tiers import TierSpec, allocate_layer_widths

ROOT = Path(__file__).resolve().parents[2]


def _bench_module():
    sys.path.insert(0, str(ROOT / "scripts"))  # its helpers (bench_common), as when run as a script
    spec = importlib.util.spec_from_file_location("bench_fidelity", ROOT / "scripts" / "bench_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_rows_spend_the_seeds_trellis_bytes() -> None:
    """Per layer, sum over experts of K (the trellis bytes) equals the seed's 2 E, except the references; tiers by
    layer spend the seed's 2 E per layer summed over the MoE layers."""
    from glmquant.observe.tiers import TierSpec

    for experts, moe_layers in ((8, 3), (64, 6), (288, 42)):
        for r in _bench_module().recipes(experts, 4, moe_layers):
            kept = r.keep or experts
            spec = TierSpec.parse(r.tiers) if r.tiers else None
            if spec is not None and spec.ranks_layers:
                trellis = sum(b * n for b, n in spec.counts(moe_layers)) * kept
            else:
                trellis = moe_layers * sum(b * n for b, n in (spec.counts(kept) if spec else [(r.bits, kept)]))
            assert (trellis == 2 * experts * moe_layers) != r.reference, (experts, r.name)


@pytest.mark.slow
def test_mtp_acceptance_drafts_with_a_draft_head(tiny_source: Path, tmp_path: Path) -> None:
    """`--mtp-draft-head-bits`: the acceptance run's drafts read a draft-head file, the outputs stay plain greedy
    decoding's, and the file is named in the record."""
    import torch

    from glmquant.checkpoint.draft_head import DraftHead, write_draft_head
    from glmquant.checkpoint.reader import SourceCheckpoint
    from glmquant.exl3 import encode_linears
    from glmquant.fixtures.random_artifact import build_artifact

    artifact = build_artifact(tiny_source, tmp_path / "art", "tr3")
    with SourceCheckpoint.open(tiny_source) as source:
        weight = source.read_tensor("lm_head.weight").float()
    [encoded] = encode_linears([(weight, None)], 3)
    head = tmp_path / "head.safetensors"
    write_draft_head(
        head, DraftHead("lm_head", 3, "mcg", weight.shape[1], weight.shape[0]), encoded.tensor.tensors("lm_head")
    )
    prompts = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    record = _bench_module().mtp_acceptance(artifact, prompts, 6, "cpu", head)
    assert record["draft_head"] == "head.safetensors"
    for k in (1, 2, 3):
        assert record[f"k{k}"]["equals_plain_greedy"] and record[f"k{k}"]["verify_steps"] >= 2


def test_kept_measurements_are_measured_once_and_completed_in_place(tmp_path: Path) -> None:
    """A measurement kept in WORK is measured again only at other settings; at the same settings `complete` adds
    what it lacks (a K not yet measured) to the kept file, and the first measurement is not repeated."""
    evaluator = object.__new__(_bench_module().Evaluator)
    path, settings = tmp_path / "stocks" / "costs.json", {"text": 64}
    measured: list[str] = []

    def measure() -> dict[str, dict[str, float]]:
        measured.append("measure")
        return {"kl": {"3": 0.5}}

    def complete(kept: dict[str, dict[str, float]]) -> bool:
        if "2" in kept["kl"]:
            return False
        kept["kl"]["2"] = 0.9
        return True

    assert evaluator.kept_measurement(path, settings, measure) == {"settings": settings, "kl": {"3": 0.5}}
    assert evaluator.kept_measurement(path, settings, measure, complete)["kl"] == {"3": 0.5, "2": 0.9}
    assert json.loads(path.read_text())["kl"] == {"3": 0.5, "2": 0.9} and measured == ["measure"]
    assert evaluator.kept_measurement(path, {"text": 32}, measure, complete)["kl"] == {"3": 0.5}
    assert measured == ["measure", "measure"]


def test_depth_sweep_enumerates_every_byte_neutral_allocation_by_depth() -> None:
    """On six MoE layers the sweep is every non-increasing K1-K4 per layer with mean K2 but uniform K2 and
    depth-tiers' own (3, 3, 2, 2, 1, 1); each row's spec gives back its allocation; a 42-layer model has none."""
    from glmquant.observe.tiers import TierSpec

    bench = _bench_module()
    rows = [r for r in bench.recipes(64, 8, 6) if r.name.startswith("depth-k")]
    sweep = {r.name: r.tiers for r in rows if not r.tune_scales}
    assert sorted(sweep) == sorted(
        ["depth-k441111", "depth-k432111", "depth-k422211", "depth-k333111", "depth-k322221"]
    )
    for name, tiers in sweep.items():
        bits = [b for b, n in TierSpec.parse(tiers).counts(6) for _ in range(n)]
        assert "depth-k" + "".join(map(str, bits)) == name
    # each allocation tuned too, after the whole untuned sweep
    assert [r.name for r in rows] == [*sweep, *(f"{name}-tuned" for name in sweep)]
    assert all(r.tiers == sweep[r.name.removesuffix("-tuned")] for r in rows if r.tune_scales)
    assert [r.tiers for r in bench.recipes(8, 4, 3) if r.name == "depth-k411"] == ["depth:K4=1,K1=rest"]
    assert not [r for r in bench.recipes(288, 45, 42) if r.name.startswith("depth-k")]


def test_first_difference_names_where_speculative_output_leaves_plain_greedy() -> None:
    first_difference = _bench_module().first_difference
    assert first_difference([5, 6, 7], [5, 6, 7]) is None
    assert first_difference([5, 9, 7], [5, 6, 7]) == 1
    assert first_difference([5, 6], [5, 6, 7]) == 2  # a shorter output differs where it ends


def test_summary_picks_the_lowest_kl_at_the_seeds_bytes() -> None:
    rows = [
        {"recipe": "seed", "kl": 0.4, "top1": 0.7, "at_seed_bytes": True},
        {"recipe": "a", "kl": 0.2, "top1": 0.75, "at_seed_bytes": True},
        {"recipe": "k4", "kl": 0.01, "top1": 0.95, "at_seed_bytes": False, "reference": True},
        {"recipe": "exllamav3-1.6.5", "kl": 0.3, "top1": 0.72, "at_seed_bytes": True},
    ]
    summary = _bench_module().summarize(rows)
    assert (summary["seed_method"], summary["best"], summary["exllamav3"]) == ("seed", "a", "exllamav3-1.6.5")
    assert summary["goal"] == {
        "kl_at_most_0.7x_seed": True,
        "top1_at_least_seed_plus_3_points": True,
        "kl_ratio_to_seed": 0.5,
        "top1_points_over_seed": 5.0,
        "no_worse_than_exllamav3": True,
    }
    # (0.7 x 0.3 + 0.75 x 0.25) / 400 positions: a standard error of 0.0315, 3.15 points
    assert _bench_module().summarize(rows, 400)["goal"] == summary["goal"] | {"positions": 400, "top1_points_se": 3.15}


def test_scheduler_waits_for_the_hessian_rows_records_failures_and_keeps_the_canonical_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows on the best Hessians start only after seed, all-token and blend; a row that raises is recorded with
    its error while the others go on; the file lists rows in recipe order whatever order they finished in, with
    bytes ratios and the speed tier's KL cost ratio taken from the seed's row."""
    from concurrent.futures import Future

    bench_module = _bench_module()
    names = ["seed", "all-token", "blend-0.5", "codebook-mul1", "retained-k4"]
    queue = [r for r in bench_module.recipes(8, 4, 3) if r.name in names]
    started: list[tuple[str, str]] = []
    finish_order = ["codebook-mul1", "retained-k4", "blend-0.5", "all-token", "seed"]  # not the queue's order

    class Held:
        """A pool whose rows finish only when the (patched) wait says so."""

        def submit(self, _fn, task) -> Future:
            started.append((task.recipe.name, task.hessians))
            return Future()

    bench = object.__new__(bench_module.Bench)
    bench.args = type("Args", (), {"jobs": 3, "results": tmp_path / "fid.json"})()
    bench.console = bench_module.Console(quiet=True)
    bench.spec = type("Spec", (), {"n_routed_experts": 8, "num_hidden_layers": 4, "moe_layers": [1, 2, 3]})()
    bench.rows, bench.best_hessians = [], None
    bench.record = {"rows": bench.rows}

    def outcome(name: str) -> tuple[dict, dict]:
        if name == "all-token":
            raise RuntimeError("Cholesky failed in layer 3")
        kl = {"seed": 0.010, "blend-0.5": 0.008, "codebook-mul1": 0.007, "retained-k4": 0.013}[name]
        row = {"recipe": name, "routed_bytes": 1000, "kl": kl, "top1": 0.9, "ppl": 17.0}
        if name == "blend-0.5":
            row |= {"hessians": "natural", "blend": 0.5}
        if name == "seed":
            row |= {"hessians": "natural", "blend": None}
        if name == "retained-k4":
            row["retained_only_kl"] = 0.005
        return row, {"bf16_ppl": 17.0}

    real_wait = bench_module.wait

    def wait(running, return_when):  # completes the running row that comes first in finish_order
        name = next(n for n in finish_order if n in running.values())
        future = next(f for f, n in running.items() if n == name)
        try:
            future.set_result(outcome(name))
        except RuntimeError as exc:
            future.set_exception(exc)
        return real_wait([future], return_when=return_when)

    monkeypatch.setattr(bench_module, "wait", wait)
    bench.schedule(Held(), list(queue))
    first_three = {name for name, _ in started[:3]}
    assert first_three == {"seed", "all-token", "blend-0.5"}  # codebook-mul1 (best Hessians) waited for them
    order = [name for name, _ in started]
    assert order.index("retained-k4") < order.index("codebook-mul1")  # a row on its own Hessians did not wait
    assert ("codebook-mul1", "natural") in started  # the blend's Hessians won: best is natural + blend 0.5
    assert bench.record["hessians_chosen"] == {"hessians": "natural", "blend": 0.5, "from": "blend-0.5"}
    rows = json.loads((tmp_path / "fid.json").read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["seed", "all-token", "blend-0.5", "retained-k4", "codebook-mul1"]
    failed = rows[1]
    assert failed["kl"] is None and "Cholesky failed in layer 3" in failed["error"]
    assert rows[3]["kl_cost_ratio"] == 0.5 and all(r["bytes_vs_seed"] == 1.0 for r in rows if r["routed_bytes"])
    summary = bench_module.summarize(rows)
    assert summary["best"] == "codebook-mul1" and summary["goal"]["kl_ratio_to_seed"] == 0.7


def test_retained_cost_bits_are_checked_before_any_row(small_proxy: Path, tmp_path: Path) -> None:
    """--retained-cost-bits takes K2-K6; a retained-layer-cost row whose budget is a K left out is refused before
    anything is observed or encoded."""
    base = [sys.executable, str(ROOT / "scripts" / "bench_fidelity.py"), "--proxy", str(small_proxy)]
    base += ["--device", "cpu", "--work", str(tmp_path / "work"), "--results", str(tmp_path / "fid.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([*base, "--retained-cost-bits", "2,7"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--retained-cost-bits: takes K from 2,3,4,5,6, got '2,7'" in bad.stderr
    argv = [*base, "--retained-cost-bits", "3,2", "--recipes", "retained-layer-cost-head5", "--no-exllamav3"]
    short = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert short.returncode == 1, short.stderr[-2000:]
    assert "retained-layer-cost-head5 spends uniform K4's retained bytes; --retained-cost-bits 2,3 does not" in (
        " ".join(short.stderr.split())
    )
    assert not (tmp_path / "work" / "obs-full").exists() and not (tmp_path / "fid.json").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("fidelity-bench")  # pytest-xdist: on the worker that runs `bench_run`, once
def test_bench_runs_end_to_end_and_summarizes(bench_run: BenchRun) -> None:
    argv, env, results = bench_run.argv, bench_run.env, bench_run.results
    record = json.loads(results.read_text())
    rows = {r["recipe"]: r for r in record["rows"]}
    measured = [r for r in rows.values() if r.get("kl") is not None]
    assert [r["recipe"] for r in measured] == list(SMOKE_ROWS)
    assert all(
        isinstance(r["routed_bytes"], int) and r["kl"] >= 0 and 0 <= r["top1"] <= 1 and r["ppl"] > 1 for r in measured
    )
    assert rows["blend-0.5"]["routed_bytes"] == rows["seed"]["routed_bytes"] and rows["blend-0.5"]["blend"] == 0.5
    # where the seed's KL sits, layer by layer, and what the tiers by layer rank the layers by
    shares = record["routed_share_by_layer"]
    assert set(rows["seed"]["kl_by_layer"]) == set(shares) and len(shares) == 2  # the small proxy's MoE layers
    assert all(kl >= 0 for kl in rows["seed"]["kl_by_layer"].values()) and all(v > 0 for v in shares.values())
    tiered = rows["depth-tiers-tuned"]  # the same bytes as K3 / K2 / K1 by depth, the scales tuned
    assert tiered["routed_bytes"] == rows["seed"]["routed_bytes"] and tiered["tiers"] == "depth:K3=1,K2=rest,K1=1"
    assert tiered["tune_scales"] > 0 and set(tiered["kl_by_layer"]) == set(shares)
    for tuning in tiered["tuning_by_layer"].values():  # each unit's held-out curve, the kept step its lowest
        for best, curve in zip(tuning["best_steps"], tuning["heldout_by_step"], strict=True):
            assert len(curve) == tiered["tune_scales"] + 1 and curve[best] == min(curve)
    assert "tuning_by_layer" not in rows["seed"]
    assert tiered["manifest_sha256"] != rows["seed"]["manifest_sha256"]
    assert rows["prune25-k3"]["at_seed_bytes"] and rows["prune25-k3"]["routed_bytes"] < rows["seed"]["routed_bytes"]
    # the seed's experts, each decoder layer's retained linears at the K (or exact) of least summed KL alone on
    # calibration text within uniform K4's bytes, lm_head K5 (issue 18)
    tier = rows["retained-layer-cost-head5"]
    assert tier["routed_bytes"] == rows["seed"]["routed_bytes"] and tier["head_bits"] == 5
    widths = tier["retained_layer_bits"].split(",")
    costs, chosen = tier["retained_layer_costs"], [w.lower() for w in widths]
    offered = {"exact", *(f"k{k}" for k in SMOKE_COST_BITS)}  # --retained-cost-bits: K2, K4 and exact
    assert len(widths) == len(costs) == 3 and set(chosen) <= offered  # the small proxy's three layers
    assert all(
        set(c) == offered and c["exact"] == 0 and all(v > 0 for k, v in c.items() if k != "exact")
        for c in costs.values()
    )
    assert tier["retained_predicted_kl"] == pytest.approx(sum(costs[str(i)][w] for i, w in enumerate(chosen)))
    nbytes = tier["retained_layer_bytes"]
    spent = sum(nbytes[str(i)][w] for i, w in enumerate(chosen))
    assert spent <= tier["retained_budget_bytes"] == sum(b["k4"] for b in nbytes.values())  # uniform K4's bytes
    assert tier["retained_predicted_kl"] <= sum(c["k4"] for c in costs.values())  # uniform K4 is one choice in it
    # the artifact's EXL3 linears are the chosen ones (at the bytes measured) and the K5 head
    assert tier["retained_exl3_bytes"] > sum(nbytes[str(i)][w] for i, w in enumerate(chosen) if w != "exact")
    assert tier["retained_linears"] > 0 and tier["retained_exl3_bytes"] < tier["retained_bf16_bytes"]
    assert tier["kl"] > 0 and tier["retained_only_kl"] > 0
    by_role = tier["retained_only_kl_by_role"]  # each role's linears alone: the encoded layers' kinds and the head
    assert "lm_head" in by_role and len(by_role) >= 2
    # each role's linears alone move the distribution (float32 on the CPU: an unchanged model gives 0 exactly);
    # their KLs need not add up to the whole set's, whose errors may cancel (one role alone has measured above it)
    assert all(kl > 0 for kl in by_role.values())
    errors = tier["retained_weight_error_by_role"]  # what the encoder minimises, per role: small at K3-K6
    assert set(errors) == set(by_role) and all(0 < e < 0.1 for e in errors.values()), errors
    assert tier["kl_cost_ratio"] == pytest.approx(tier["retained_only_kl"] / rows["seed"]["kl"], rel=1e-3)
    assert (
        record["summary"]["best"] != "retained-layer-cost-head5"
    )  # another question than the recipes at the seed's bytes
    mtp = record["mtp_acceptance"]  # the seed artifact's own MTP layer drafting for its quantized model
    assert "error" not in mtp, mtp.get("traceback")
    assert (mtp["prompts"], mtp["prompt_tokens"], mtp["new_tokens"]) == (2, 16, 5)
    for k in (1, 2, 3):
        run = mtp[f"k{k}"]
        assert run["equals_plain_greedy"] and 0 <= run["acceptance_rate"] <= 1 and run["verify_steps"] >= 2
        assert run["first_difference"] == [None, None]  # float32 on the CPU: exact
        assert 1 <= run["tokens_per_step"] <= k + 1
    summary = record["summary"]
    assert summary["seed_method"] == "seed" and rows[summary["best"]]["at_seed_bytes"]
    assert {"kl_at_most_0.7x_seed", "top1_at_least_seed_plus_3_points"} <= set(summary["goal"])
    assert record["hessians_chosen"]["from"] in ("seed", "all-token", "blend-0.5") and record["bf16_ppl"] > 1
    assert record["bf16_repeat"]["top1"] == 1.0 and record["bf16_repeat"]["kl"] < 1e-6  # the CPU repeats itself
    # rows are measured in float32 arithmetic, which repeats itself; BF16 arithmetic of the same weights is its own,
    # nonzero distance (below the seed's on the trained proxy, not necessarily on this barely trained one)
    assert record["compute_dtype"] == "float32" and record["bf16_compute"]["kl"] > 100 * record["bf16_repeat"]["kl"]
    assert 0 < record["bf16_compute"]["top1"] <= 1
    exl = next(r for r in record["rows"] if r["recipe"].startswith("exllamav3"))
    assert exl.get("error") or exl["kl"] is not None  # measured where exllamav3 imports, else why not
    # the canonical order whatever order the two workers finished in: the peer's row right after the seed's
    assert [r["recipe"] for r in record["rows"]] == ["seed", exl["recipe"], *SMOKE_ROWS[1:]]
    again = subprocess.run([*argv, "--resume"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    n = len(SMOKE_ROWS)
    assert again.returncode == 0 and f"resuming: {n} rows" in again.stderr, again.stderr[-3000:]
    resumed = json.loads(results.read_text())
    assert resumed["rows"] == record["rows"]
    assert resumed["mtp_acceptance"] == record["mtp_acceptance"]


@pytest.mark.slow
@pytest.mark.xdist_group("fidelity-bench")
def test_composed_rows_equal_the_encoded_ones(bench_run: BenchRun, small_proxy: Path, tmp_path: Path) -> None:
    """--compose-layers: the seed and depth-tiers-tuned rows taken layer by layer from uniform K1, K2 and K3
    stocks (tuned where the row is) give the figures, bytes and tuning of encoding each row; the stocks are kept
    and a second composed row reuses them instead of encoding again. The layer-cost row measures each layer at
    K1-K4 on calibration text from the stocks and takes the least-cost widths at the seed's bytes; the
    layer-cost-estimated row takes them from `glmquant layer-costs` on the K2 stock. A speed-tier row takes its
    experts from the K2 stock and its retained linears encoded beside it: the figures of encoding the whole row. Its
    retained costs, kept in the first run's WORK at the same proxy and calibration, are taken from there, not
    measured again (most of a CPU run's time)."""
    recipes = ("seed", "depth-tiers-tuned", "depth-tiers", "uniform-k3", "layer-cost", "layer-cost-estimated")
    kept = tmp_path / "work" / "stocks" / "retained-costs-cpu.json"
    kept.parent.mkdir(parents=True)
    shutil.copyfile(bench_run.work / "stocks" / kept.name, kept)
    composed = run_bench(
        small_proxy, tmp_path, (*recipes, "retained-layer-cost-head5"), "--compose-layers", "--no-exllamav3"
    )
    rows = {r["recipe"]: r for r in json.loads(composed.results.read_text())["rows"]}
    encoded = {r["recipe"]: r for r in json.loads(bench_run.results.read_text())["rows"]}
    for name in ("seed", "depth-tiers-tuned", "retained-layer-cost-head5"):
        got, want = rows[name], encoded[name]
        keys = ["kl", "top1", "ppl", "routed_bytes", "routed_bpw"]
        keys += ["kl_by_layer"] if name != "retained-layer-cost-head5" else ["retained_layer_bits", "retained_only_kl"]
        keys += ["retained_exl3_bytes", "retained_layer_costs"] if name == "retained-layer-cost-head5" else []
        for key in keys:
            assert got[key] == want[key], (name, key)
        assert got["manifest_sha256"] is None and got["stock_manifests"]
    assert kept.read_text() == (bench_run.work / "stocks" / kept.name).read_text()  # reused, not measured again
    assert rows["seed"]["stock_manifests"]["k2"] == encoded["seed"]["manifest_sha256"]  # the seed is its K2 stock
    assert rows["depth-tiers-tuned"]["composed_from"] == {"1": "k3", "2": "k1"}
    assert rows["depth-tiers-tuned"]["tuning_by_layer"] == encoded["depth-tiers-tuned"]["tuning_by_layer"]
    untuned = rows["depth-tiers"]
    assert untuned["routed_bytes"] == rows["seed"]["routed_bytes"] and "tuning_by_layer" not in untuned
    assert rows["retained-layer-cost-head5"]["composed_from"] == {"1": "k2", "2": "k2"}  # the seed's experts
    stocks = sorted(p.name for p in (composed.work / "stocks").glob("k*.json"))
    assert len(stocks) == 6 and all(name.endswith("-exllamav3-cpu.json") for name in stocks)  # k2, k4; k3, k1 twice
    built = [rows[name]["stocks_built_here"] for name in ("depth-tiers", "uniform-k3")]
    assert sorted(k for b in built for k in b) == ["k1", "k3"]  # the K3 stock built once, by whichever came first
    assert rows["uniform-k3"]["composed_from"] == {"1": "k3", "2": "k3"}
    # other experts above the seed's bytes; not which KL is lower: on this proxy of three training steps the widths'
    # KLs differ by noise (on the trained proxies K3 cuts the seed's KL 4x, docs/fidelity.md)
    assert rows["uniform-k3"]["kl"] != rows["seed"]["kl"] and not rows["uniform-k3"]["at_seed_bytes"]
    assert rows["uniform-k3"]["routed_bytes"] > rows["seed"]["routed_bytes"]
    assert not (composed.work / "artifact-seed").exists()
    by_cost = rows["layer-cost"]
    costs = {int(layer): {int(k[1:]): v for k, v in c.items()} for layer, c in by_cost["layer_costs"].items()}
    assert sorted(costs) == [1, 2] and all(sorted(c) == [1, 2, 3, 4] for c in costs.values())
    assert all(c[1] > c[4] > 0 for c in costs.values())  # a narrower K costs more KL
    widths = allocate_layer_widths(costs, 2)
    assert by_cost["tiers"] == TierSpec.of_widths([widths[1], widths[2]]).text
    assert by_cost["composed_from"] == {str(layer): f"k{k}" for layer, k in widths.items()}
    assert by_cost["predicted_kl"] == pytest.approx(sum(costs[layer][k] for layer, k in widths.items()))
    assert by_cost["routed_bytes"] == rows["seed"]["routed_bytes"] and by_cost["kl_by_layer"]
    estimated = rows["layer-cost-estimated"]
    guessed = {int(layer): {int(k[1:]): v for k, v in c.items()} for layer, c in estimated["layer_costs"].items()}
    assert all(guessed[int(layer)][2] == pytest.approx(v) for layer, v in estimated["kl_alone"].items())  # K2 measured
    assert estimated["experts_sampled"] == {"1": 1, "2": 1}  # --estimate-experts 1
    assert all(c[1] > c[2] > c[3] > c[4] > 0 for c in guessed.values())
    chosen = allocate_layer_widths(guessed, 2)
    assert estimated["tiers"] == TierSpec.of_widths([chosen[1], chosen[2]]).text
    assert estimated["routed_bytes"] == rows["seed"]["routed_bytes"]
    (measured,) = (composed.work / "stocks").glob("layer-costs-*.json")
    assert json.loads(measured.read_text())["settings"]["text"] == ["calibration", 2, 32]  # not the held-out text
    # the seed's MTP run drafts on its K2 stock as it did on its own artifact
    drafted = json.loads(composed.results.read_text())["mtp_acceptance"]
    assert "error" not in drafted, drafted.get("traceback")
    for k in ("k1", "k2", "k3"):
        assert drafted[k] == json.loads(bench_run.results.read_text())["mtp_acceptance"][k]
    # a stock of other settings in the same WORK (here: calibration sizes edited in its record) is built again
    (k2,) = (composed.work / "stocks").glob("k2-*.json")
    k2.write_text(json.dumps(json.loads(k2.read_text()) | {"settings": {"calibration": [1, 1, 1]}}))
    argv = [*composed.argv, "--mtp-prompts", "0"]  # the seed row alone, its results file written anew
    argv[argv.index("--recipes") + 1] = "seed"
    again = subprocess.run(argv, capture_output=True, text=True, env=composed.env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    (seed,) = [r for r in json.loads(composed.results.read_text())["rows"] if r["recipe"] == "seed"]
    assert seed["stocks_built_here"] == ["k2"] and seed["kl"] == rows["seed"]["kl"]


def test_exllamav3_experts_keep_the_evaluated_layers_and_count_the_mtp_layer_apart(tmp_path: Path) -> None:
    """ExLlamaV3 quantizes the MTP layer's experts too (layer num_hidden_layers, which the proxy's forward never
    runs; at K4 in the H200 run): they are left out of the row's experts, bytes and widths and counted apart; the
    rest decode as written, expert 1's tensors not mixed with expert 10's; a projection missing is refused."""
    import torch
    from safetensors.torch import save_file

    from glmquant.arch import PROJECTIONS
    from glmquant.exl3 import decode_weight
    from glmquant.fixtures.random_artifact import random_exl3

    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}
    written, tensors = {}, {}
    for layer, expert, bits in ((1, 0, 2), (1, 1, 2), (1, 10, 2), (4, 1, 4)):  # layer 1's; the MTP layer's at K4
        for proj, (inf, outf) in shapes.items():
            t = random_exl3(inf, outf, gen, bits)
            parts = t.tensors(f"model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}")
            tensors.update(parts)
            written[(layer, expert, proj)] = (t, sum(v.numel() * v.element_size() for v in parts.values()))
    save_file(tensors, str(tmp_path / "model.safetensors"))

    read = _bench_module().exllamav3_experts
    with pytest.raises(RuntimeError, match=r"6 routed expert projections .* layers\.2\.mlp\.experts\.0\.gate_proj"):
        read(tmp_path, {1, 2}, 2)  # layer 2 has no experts there: the first missing one is named
    experts, nbytes, widths, other = read(tmp_path, {1}, 2)
    assert sorted(experts) == [(1, 0), (1, 1), (1, 10)] and all(
        sorted(e) == sorted(PROJECTIONS) for e in experts.values()
    )
    assert nbytes == sum(size for (layer, _, _), (_, size) in written.items() if layer == 1)
    assert other == sum(size for (layer, _, _), (_, size) in written.items() if layer == 4)
    assert widths == [2]  # the MTP layer's K4 stays out
    for (layer, expert, proj), (t, _) in written.items():
        if layer == 1:
            assert torch.equal(experts[(layer, expert)][proj], decode_weight(t, torch.float32)), (expert, proj)
