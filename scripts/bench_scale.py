"""Rehearse the build at GLM-5.3-Flash's real widths and extrapolate it to the full model (docs/scale.md).

Stages, each in its own process (clean peak RSS and GPU figures; a crash or an overrun names its stage):
  fixture  synthetic real-width source (`glmquant fixture --layers N`), weights generated on --device
  build    fused observe + encode (`glmquant build`): every routed expert observed (REAP statistics, natural
           Hessians kept on the device), the first --encode-experts of each MoE layer encoded (a prune plan),
           the hidden streams capped at --stream-budget-factor x one layer's streams (so the recompute path runs)
  verify   `verify-manifest`, every file hashed
  runtime  the artifact loaded by the runtime, a prompt prefilled and --decode-tokens tokens decoded greedily
  resume   (device streams only) a killed run's worst recompute in a fresh process: the streams recomputed from the
           embeddings through every layer, the plain forward `observe` runs on resuming, each layer timed
Measured per stage: wall time, peak host RSS, peak GPU memory, bytes written; per layer kind: observe times.
Results go to --results after every stage (a failed or overrun stage is recorded, then the run stops loudly).
The `full_model` object extrapolates to --full-config with the --full-recipe token count; every figure in
`extrapolation` carries its formula and inputs.

    # H200 rehearsal (fits one ~8-minute call, 64 GiB of disk; docs/scale.md has the current command):
    python scripts/bench_scale.py --device cuda --layers 5 --experts 144 --encode-experts 32 --rows 32 \
        --work /tmp/scale --results bench/results/scale_h200.json
    # CPU smoke at tiny widths (tests/scripts/test_bench_scale.py runs this):
    python scripts/bench_scale.py --device cpu --config TINY/config.json --layers 3 --experts 4 --encode-experts 2 \
        --rows 2 --tokens 32 --batch-rows 1 --work /tmp/scale-cpu --results /tmp/scale_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench_common import git_commit

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("fixture", "build", "verify", "runtime", "resume")
# what --extrapolate-only takes from the record: the rehearsal's shape (its paths are this machine's)
DEFAULT_RESULTS = ROOT / "bench" / "results" / "scale_h200.json"
SHAPE_SETTINGS = ("layers", "experts", "encode_experts", "rows", "tokens", "batch_rows", "device_streams_every")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from glmquant.fixtures.synthetic import REFERENCE_CONFIG
    from glmquant.observe.config import DEFAULT_RECIPE

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/glmquant-scale"), help="scratch directory (emptied)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help=f"the record (default: {DEFAULT_RESULTS.relative_to(ROOT)}; required with --extrapolate-only)",
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--config", type=Path, default=REFERENCE_CONFIG, help="config whose widths the fixture takes")
    p.add_argument("--layers", type=int, default=6, help="decoder layers of the fixture (6: every layer kind)")
    p.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the config's)")
    p.add_argument(
        "--encode-experts",
        type=int,
        default=32,
        help="experts per MoE layer encoded (a prune plan; at least the router's top-k; 32 = one batch of the full "
        "encode, so the per-tensor time is the production one)",
    )
    p.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE, help="calibration recipe (offline built-in)")
    p.add_argument("--rows", type=int, default=8, help="calibration rows per lane")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    p.add_argument("--batch-rows", type=int, default=4, help="rows per forward step")
    p.add_argument(
        "--stream-budget-factor",
        type=float,
        default=1.6,
        help="stream budget as a multiple of one layer's streams (>= 1 + one chunk's share)",
    )
    p.add_argument(
        "--device-streams-every",
        type=int,
        default=None,
        help="hold the hidden streams on the device, checkpointing them to disk every N layers (0: never); "
        "default: disk streams under the stream budget",
    )
    p.add_argument("--runtime-backend", default=None, help="expert backend (default: triton on cuda, torch on cpu)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--time-limit-s", type=float, default=540, help="the whole run; a stage past it is killed")
    p.add_argument("--allow-torch-kda", action="store_true", help="on cuda, run even without flash-linear-attention")
    p.add_argument("--full-config", type=Path, default=REFERENCE_CONFIG)
    p.add_argument("--full-recipe", type=Path, default=ROOT / "calibration" / "glm-5.3-flash.yaml")
    p.add_argument("--full-stream-budget-gb", type=float, default=90.0)
    p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse HEAD, if any)")
    p.add_argument(
        "--extrapolate-only",
        type=Path,
        default=None,
        metavar="RECORD",
        help="run nothing: extrapolate RECORD (an earlier run's results) again with today's formulas, its shape "
        "settings (rows, tokens, experts, streams) taken from it and the config and recipe paths from this command, "
        "into --results",
    )
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.extrapolate_only is not None:
        if args.results is None:
            p.error("--extrapolate-only needs --results (a new file: the record it reads stays as it is)")
        if args.results.resolve() == args.extrapolate_only.resolve():
            p.error(f"--results {args.results} is the record --extrapolate-only reads; name another file")
    args.results = args.results or DEFAULT_RESULTS
    return args


def paths(args: argparse.Namespace) -> dict[str, Path]:
    return {name: args.work / name for name in ("source", "obs", "artifact", "prune_plan.json")}


# ---------------------------------------------------------------- stages (each runs in a child process)


def stage_fixture(args: argparse.Namespace) -> dict[str, Any]:
    from glmquant.fixtures.synthetic import SyntheticOptions, build_synthetic_checkpoint

    options = SyntheticOptions(args.layers, args.config, args.experts, device=args.device)
    build_synthetic_checkpoint(paths(args)["source"], options, progress=True)
    return {"bytes_written": dir_bytes(paths(args)["source"])}


def observe_config(args: argparse.Namespace):
    """The build's observation settings (the resume stage recomputes with the same ones)."""
    from glmquant.arch import load_model_spec
    from glmquant.observe.config import ObserveConfig
    from glmquant.observe.hessians import HessianMode

    p = paths(args)
    spec = load_model_spec(p["source"])
    budget = args.stream_budget_factor * stream_bytes(args.recipe, args.rows, args.tokens, spec) / 1e9
    return ObserveConfig(
        p["source"],
        p["obs"],
        args.recipe,
        args.rows,
        args.tokens,
        HessianMode.NATURAL,
        False,
        None,
        args.device,
        args.batch_rows,
        budget,
        device_streams_every=args.device_streams_every,
    )


def stage_build(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    from glmquant.arch import load_model_spec
    from glmquant.build import BuildConfig, build_artifact
    from glmquant.encode import EncodeConfig
    from glmquant.encode.run import EncodeJob
    from glmquant.exl3.backends import select_backend
    from glmquant.observe.streaming import kda_implementation

    p = paths(args)
    spec = load_model_spec(p["source"])
    kept = list(range(args.encode_experts))
    p["prune_plan.json"].write_text(json.dumps({"layers": {str(layer): kept for layer in spec.moe_layers}}))
    config = BuildConfig(
        observe_config(args),
        EncodeConfig(
            source=p["source"],
            out=p["artifact"],
            observations=p["obs"],
            prune_plan=p["prune_plan.json"],
            device=args.device,
        ),
    )
    encoded: list[dict[str, Any]] = []
    real_encode, real_finish = EncodeJob.encode, EncodeJob.finish

    def encode(job, layer, hessians):
        with Peak(args.device) as peak:
            summary = real_encode(job, layer, hessians)
        encoded.append(
            {
                "layer": layer,
                "tensors": summary.tensors,
                "seconds": peak.seconds,
                "peak_gpu_bytes": peak.gpu_bytes,
                "bytes_written": summary.bytes_written,
            }
        )
        return summary

    finish: dict[str, Any] = {}

    def finish_job(job):
        with Peak(args.device) as peak:
            result = real_finish(job)
        finish.update(seconds=peak.seconds, peak_gpu_bytes=peak.gpu_bytes)
        return result

    EncodeJob.encode, EncodeJob.finish = encode, finish_job  # type: ignore[method-assign]  # timed wrappers
    with DiskPeak(p["obs"]) as disk:
        result = build_artifact(config, Console(stderr=True), progress=True)
    obs = json.loads((p["obs"] / "observations.json").read_text())
    return {
        "kda": kda_implementation(),
        "viterbi_backend": select_backend(args.device).name,
        "stream_budget_gb": config.observe.stream_budget_gb,
        "observation": {
            "elapsed_s": obs["elapsed_s"],
            "layers": obs["layers"],
            "peak_device_bytes": obs["peak_device_bytes"],
        },
        "encode_layers": encoded,
        "finish": finish,
        "observation_disk_peak_bytes": disk.peak,
        "observation_bytes": dir_bytes(p["obs"]),
        "artifact_bytes": dir_bytes(p["artifact"]),
        "manifest_sha256": result.encode.artifact.manifest_sha256,
    }


def stage_verify(args: argparse.Namespace) -> dict[str, Any]:
    from glmquant.checkpoint.verify import verify_artifact

    report = verify_artifact(paths(args)["artifact"], fast=False, show_progress=True)
    if not report.ok:
        raise SystemExit(f"verify-manifest failed: {report.failure_summary()}")
    return {"ok": True, "bytes_read": dir_bytes(paths(args)["artifact"])}


def stage_runtime(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.options import RuntimeOptions

    backend = args.runtime_backend or ("triton" if args.device == "cuda" else "torch")
    started = time.monotonic()
    loaded = load_model(paths(args)["artifact"], RuntimeOptions(device=args.device, backend=backend))
    load_s = time.monotonic() - started
    ids = torch.randint(0, 256, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    generate(loaded.model, PromptInputs(ids), SamplingParams(max_tokens=2), lambda t: "")  # warm-up: compiles, graphs
    times = {}
    for n in (1, args.decode_tokens):
        started = time.monotonic()
        out = generate(loaded.model, PromptInputs(ids), SamplingParams(max_tokens=n), lambda t: "")
        times[n] = time.monotonic() - started
    if out.completion_tokens != args.decode_tokens:
        raise SystemExit(f"decoded {out.completion_tokens} tokens, expected {args.decode_tokens}")
    return {
        "backend": backend,
        "load_s": round(load_s, 3),
        "prefill_s": round(times[1], 3),
        "decode_s_per_token": round((times[args.decode_tokens] - times[1]) / max(args.decode_tokens - 1, 1), 4),
        "tokens": list(out.token_ids),
    }


def stage_resume(args: argparse.Namespace) -> dict[str, Any]:
    """What a killed device-stream run pays at most on resuming, in a fresh process (its first calls included): the
    streams entering the last layer's successor recomputed from the embeddings (no checkpoint left) through every
    layer, `observe`'s own recompute, each layer's plain forward timed with its load and stream parts."""
    from dataclasses import asdict

    import torch

    from glmquant.calibration import TokenRows
    from glmquant.observe import run as observe_run
    from glmquant.observe.checkpointing import RunState
    from glmquant.observe.streaming import TextModel
    from glmquant.observe.streams import DeviceStreamStore
    from glmquant.observe.summary import LayerCost

    config, obs = observe_config(args), paths(args)["obs"]
    started = time.monotonic()
    model = TextModel.open(config.source, config.device)
    rows = TokenRows.load(obs)
    scratch = args.work / "resume-state"
    lanes = [(lane.name, *lane.ids.shape) for lane in rows.lanes]
    shape = (model.cfg.hc_mult, model.cfg.hidden_size)
    streams = DeviceStreamStore(
        scratch, lanes, config.batch_rows, shape, model.dtype, config.stream_budget_bytes, device=model.device
    )
    layers: list[dict[str, Any]] = []
    plain_advance = observe_run._advance

    def timed_advance(model_, streams_, layer, advance, _cost, module=None):  # each layer a cost of its own
        cost = LayerCost(chunks=len(streams_.chunks))
        cost.recomputed_chunks = observe_run._measured(
            model_.device, cost, "advance_s", plain_advance, model_, streams_, layer, advance, cost, module
        )
        attention, mlp = model_.spec.attention_types[layer], model_.spec.mlp_layer_types[layer]
        layers.append({"layer": layer, "attention": attention, "mlp": "moe" if mlp == "sparse" else "dense"})
        layers[-1]["cost"] = asdict(cost)
        return cost.recomputed_chunks

    observe_run._advance = timed_advance  # timed per layer
    total = LayerCost()
    with model.ckpt:
        recompute_started = time.monotonic()
        observe_run._recompute_streams(model, rows, streams, RunState({}, model.num_layers, False, None), total)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        recompute_s = time.monotonic() - recompute_started
    streams.drop_layer(model.num_layers)
    shutil.rmtree(scratch, ignore_errors=True)
    return {
        "open_s": round(recompute_started - started, 3),
        "recompute_s": round(recompute_s, 3),
        "embed_s": round(recompute_s - sum(layer["cost"]["advance_s"] for layer in layers), 3),
        "layers": layers,
    }


# ---------------------------------------------------------------- measuring helpers


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


class Peak:
    """Wall time and CUDA peak allocated of a block."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __enter__(self) -> Peak:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self.seconds = round(time.monotonic() - self.started, 3)
        self.gpu_bytes = torch.cuda.max_memory_allocated() if self.cuda else None


class DiskPeak:
    """The largest size a directory reaches while the block runs (sampled every 0.5 s and at the end)."""

    def __init__(self, path: Path) -> None:
        self.path, self.peak, self._stop = path, 0, threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, dir_bytes_safe(self.path))

    def __enter__(self) -> DiskPeak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, dir_bytes_safe(self.path))


def dir_bytes_safe(path: Path) -> int:
    """dir_bytes while files come and go."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def stream_bytes(recipe: Path, rows: int | None, tokens: int | None, spec) -> int:
    """One layer's hidden streams: every calibration token's hc x H values in BF16."""
    from glmquant.calibration import load_recipe

    lanes = load_recipe(recipe).with_shape(rows, tokens).lanes
    return sum(lane.rows * lane.tokens for lane in lanes) * int(spec.text.get("hc_mult", 1)) * spec.hidden_size * 2


def run_stage_here(args: argparse.Namespace) -> None:
    """Child side: run one stage and print its measurements as the last line of stdout."""
    import torch

    from glmquant.observe.run import peak_rss_bytes

    fn = {
        "fixture": stage_fixture,
        "build": stage_build,
        "verify": stage_verify,
        "runtime": stage_runtime,
        "resume": stage_resume,
    }
    with Peak(args.device) as peak:
        result = fn[args.stage](args)
    result.update(wall_s=peak.seconds, peak_host_rss_bytes=peak_rss_bytes(), peak_gpu_bytes=peak.gpu_bytes)
    if args.device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps(result))


# ---------------------------------------------------------------- orchestration (parent process)


def preflight(args: argparse.Namespace) -> dict[str, Any]:
    """Fail before anything runs when the machine cannot hold the rehearsal."""
    import torch

    from glmquant.checkpoint.layouts import plan_artifact
    from glmquant.errors import UsageError
    from glmquant.fixtures.synthetic import SyntheticOptions, synthetic_layout
    from glmquant.observe.prune import check_keep
    from glmquant.observe.streaming import kda_implementation

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    kda = kda_implementation()
    if args.device == "cuda" and kda == "torch reference" and not args.allow_torch_kda:
        raise SystemExit(
            "flash-linear-attention is not importable (pip install fla-core flash-linear-attention "
            "einops, or PYTHONPATH to their wheels): the KDA layers would run transformers' slow "
            "reference loop; pass --allow-torch-kda to measure that anyway"
        )
    layout = synthetic_layout(SyntheticOptions(args.layers, args.config, args.experts, device="cpu"))
    try:
        check_keep(layout.spec, args.encode_experts, "--encode-experts")
    except UsageError as exc:
        raise SystemExit(str(exc)) from None
    artifact = sum(f.size for f in plan_artifact(layout.spec, "tr3", source_shards=layout.weight_map).files)
    streams = stream_bytes(args.recipe, args.rows, args.tokens, layout.spec)
    need = layout.tensor_bytes + artifact + args.stream_budget_factor * streams
    args.work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.work).free + dir_bytes(args.work)
    if free < 1.05 * need:
        raise SystemExit(
            f"{args.work}: the rehearsal needs about {need / 1e9:.1f} GB of disk (source "
            f"{layout.tensor_bytes / 1e9:.1f}, artifact at most {artifact / 1e9:.1f}, streams "
            f"{args.stream_budget_factor * streams / 1e9:.1f}) but {free / 1e9:.1f} GB are free; "
            "shrink it with --experts, --layers or --rows"
        )
    shutil.rmtree(args.work)
    args.work.mkdir(parents=True)
    return {
        "source_bytes_planned": layout.tensor_bytes,
        "artifact_bytes_at_most": artifact,
        "stream_bytes_per_layer": streams,
        "disk_free_bytes": free,
        "kda": kda,
    }


def run_stages(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """Each stage in a child process, within what is left of --time-limit-s. The resume stage is a measurement beside
    the build, not a part of it: where it fails or overruns, that is recorded (`resume_not_measured`) and the record
    is extrapolated without it."""
    deadline = time.monotonic() + args.time_limit_s
    child_argv = sys.argv[1:]
    for stage in STAGES:
        if stage == "resume" and args.device_streams_every is None:
            continue  # disk streams resume from their files: nothing is recomputed
        left = deadline - time.monotonic()
        why = run_stage(args, record, stage, child_argv, left)
        if why is None:
            write(args, record)
        elif stage == "resume":
            record["resume_not_measured"] = why
            print(f"bench_scale: stage 'resume' {why}; extrapolated without it", file=sys.stderr, flush=True)
        else:
            fail(args, record, stage, why)


def run_stage(
    args: argparse.Namespace, record: dict[str, Any], stage: str, child_argv: list[str], left: float
) -> str | None:
    """Run `stage` and record its measurements; returns why it did not finish, None when it did."""
    if left <= 5:
        return f"no time left of --time-limit-s {args.time_limit_s:.0f}"
    print(f"== {stage} (at most {left:.0f} s)", file=sys.stderr, flush=True)
    try:
        child = subprocess.run(
            [sys.executable, __file__, *child_argv, "--stage", stage],
            stdout=subprocess.PIPE,
            text=True,
            timeout=left,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return (
            f"did not finish within {left:.0f} s (--time-limit-s {args.time_limit_s:.0f}); shrink it with "
            "--experts, --encode-experts, --rows or --layers"
        )
    if child.returncode != 0:
        return f"exited with code {child.returncode} (its error is printed above)"
    record["stages"][stage] = json.loads(child.stdout.strip().splitlines()[-1])
    return None


def fail(args: argparse.Namespace, record: dict[str, Any], stage: str, why: str) -> None:
    record["failed"] = {"stage": stage, "reason": why}
    write(args, record)
    raise SystemExit(f"bench_scale: stage {stage!r} {why}; partial results in {args.results}")


def write(args: argparse.Namespace, record: dict[str, Any]) -> None:
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.metadata as md

    import torch
    import transformers

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    commit = args.commit or git_commit()
    return {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": version("triton"),
        "fla_core": version("fla-core"),
        "flash_linear_attention": version("flash-linear-attention"),
        "exllamav3": version("exllamav3"),
        "glmquant_commit": commit,
        "exl3_backend_env": os.environ.get("GLMQUANT_EXL3_BACKEND"),
        "date": time.strftime("%Y-%m-%d"),
    }


def extrapolation_source(args: argparse.Namespace) -> dict[str, Any]:
    """The record --extrapolate-only reads, checked: a finished scale rehearsal whose token count this command's
    --recipe gives at its shape; its shape settings are set on `args`."""
    from scale_extrapolation import recipe_tokens

    path = args.extrapolate_only
    record = json.loads(path.read_text())
    missing = [s for s in ("build", "verify", "runtime") if s not in record.get("stages", {})]
    if record.get("bench") != "scale" or "failed" in record or missing:
        raise SystemExit(f"bench_scale: {path} is not a finished scale rehearsal (stages missing: {missing})")
    for name in SHAPE_SETTINGS:  # device_streams_every came later: older records ran disk streams
        setattr(args, name, record["settings"].get(name))
    recorded = record.get("extrapolation", {}).get("tokens", {}).get("inputs", {}).get("rehearsal_tokens")
    tokens = recipe_tokens(args.recipe, args.rows, args.tokens)
    if recorded is not None and recorded != tokens:
        raise SystemExit(
            f"bench_scale: {path} ran {recorded} calibration tokens; --recipe {args.recipe} gives {tokens} at its "
            "shape: pass the recipe it ran"
        )
    return record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.stage:
        run_stage_here(args)
        return
    from scale_extrapolation import extrapolate  # beside this script

    record: dict[str, Any]
    if args.extrapolate_only is not None:
        record = extrapolation_source(args)
        record["extrapolation"], record["full_model"] = extrapolate(args, record)
        record["extrapolated_again"] = {
            "from": str(args.extrapolate_only),
            "commit": args.commit or git_commit(),
            "full_config": str(args.full_config),
            "full_recipe": str(args.full_recipe),
        }
        write(args, record)
        print(json.dumps(record["full_model"], indent=2))
        return
    record = {
        "bench": "scale",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "stage"},
    }
    record["environment"] = environment(args)
    record["preflight"] = preflight(args)
    record["stages"] = {}
    write(args, record)
    run_stages(args, record)
    record["extrapolation"], record["full_model"] = extrapolate(args, record)
    write(args, record)
    print(json.dumps(record["full_model"], indent=2))


if __name__ == "__main__":
    main()
