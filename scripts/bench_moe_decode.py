"""Decode time of one real-shape GLM-5.3-Flash MoE layer on EXL3 experts: ours vs ExLlamaV3 vs BF16 torch.

One layer of 288 experts, gate/up 4096 -> 2048 and down 2048 -> 4096, K2 MCG, top-8, in both layouts: plain
(one EXL3 tensor per projection) and rank-stacked tr3 (1,152 virtual experts of width 512, 32 routes per
token, each logical route expanded to its 4 slices). Batches 1, 4, 16, 64 with random routes; every replay
takes the next of `--routings` routing sets, so a batch-1 step's 50 MB are not served from the 60 MB L2.
Times are medians of event-timed CUDA-graph replays (eager times for ours too). Bytes per step = unique
virtual experts routed x their EXL3 bytes (trellis + scales); roofline = bytes / HBM bandwidth (4.3 TB/s, and
the copy bandwidth measured here). The GB10 projection: batch-1 tr3 roofline fraction x GB10 bandwidth /
`plan`'s decode bytes per token of the reference artifact. Writes moe_decode.json under --out.

    python scripts/bench_moe_decode.py --out DIR [--with-exllamav3] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from glmquant.runtime.kernels.cuda_graphs import StepGraphs
from glmquant.runtime.kernels.exl3_decode import codebook_id
from glmquant.runtime.kernels.exl3_gemm import exl3_rows, rotate_in, rotate_out
from glmquant.runtime.kernels.exl3_gemv import takes_fp16_pairs
from glmquant.runtime.kernels.exl3_jobs import GemmConfig, WeightStack, job_rows
from glmquant.runtime.kernels.fused_moe import (
    MoEConfig,
    MoEWeights,
    choose_moe_config,
    fused_moe,
    plan_routes,
    swiglu,
)
from glmquant.runtime.quantized_experts import expand_routes

PLAN_BYTES_TR3 = 18_724_935_672  # `glmquant plan` decode bytes per token of the reference tr3 K2 artifact
H200_SM_CLOCK_GHZ = 1.98


@dataclass(frozen=True)
class Layout:
    name: str
    ranks: int  # virtual experts per logical expert


@dataclass(frozen=True)
class Timing:
    layout: str
    batch: int
    impl: str
    median_us: float
    p10_us: float
    p90_us: float
    bytes_per_step: float
    roofline_us: float
    roofline_fraction: float
    roofline_fraction_copy_bw: float
    us_per_token: float


def random_stack(
    gen: torch.Generator, p: int, v: int, inf: int, outf: int, bits: int, codebook: str, scale: float
) -> WeightStack:
    """Random valid EXL3 weights straight into a [P, V, ...] stack on the generator's device."""
    dev = gen.device
    trellis = torch.randint(
        -32768, 32768, (p, v, inf // 16, outf // 16, 16 * bits), generator=gen, device=dev, dtype=torch.int32
    ).to(torch.int16)

    def signed(*s: int) -> torch.Tensor:
        return (torch.randint(0, 2, s, generator=gen, device=dev) * 2 - 1) * (
            0.5 + torch.rand(s, generator=gen, device=dev)
        )

    return WeightStack(
        trellis, (signed(p, v, inf) * scale).half(), signed(p, v, outf).half(), codebook_id(codebook), inf, outf
    )


def make_layer(gen: torch.Generator, args: argparse.Namespace, ranks: int) -> MoEWeights:
    v, width = args.experts * ranks, args.inter // ranks
    return MoEWeights(
        random_stack(gen, 2, v, args.hidden, width, args.bits, args.codebook, 0.06),
        random_stack(gen, 1, v, width, args.hidden, args.bits, args.codebook, 0.01),
        10.0,
    )


def routing_sets(gen: torch.Generator, args: argparse.Namespace, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logical top-k routes (distinct experts per token) and normalized router weights x 2.5."""
    sets = []
    for _ in range(args.routings):
        ids = torch.rand(batch, args.experts, generator=gen, device=gen.device).argsort(dim=1)[:, : args.top_k]
        w = torch.rand(batch, args.top_k, generator=gen, device=gen.device)
        sets.append((ids, 2.5 * w / w.sum(1, keepdim=True)))
    return sets


def expert_bytes(w: MoEWeights) -> int:
    """EXL3 bytes of one virtual expert: gate, up and down, each trellis + fp16 suh + svh."""

    def proj(s: WeightStack) -> int:
        return s.trellis[0, 0].numel() * 2 + 2 * (s.suh.shape[-1] + s.svh.shape[-1])

    return 2 * proj(w.gate_up) + proj(w.down)


class Clock:
    """CUDA events on a GPU; on the CPU (interpreter dry runs) a wall clock around a synchronous call."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def span(self, work: Callable[[], object]) -> Callable[[], float]:
        """Run work now; return a function giving its duration in microseconds (after a later synchronize)."""
        if not self.cuda:
            t0 = time.perf_counter()
            work()
            us = (time.perf_counter() - t0) * 1e6
            return lambda: us
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        return lambda: start.elapsed_time(end) * 1e3

    def repeat(self, run: Callable[[int], Callable[[], float]], reps: int) -> list[float]:
        pending = [run(i) for i in range(reps)]
        if self.cuda:
            torch.cuda.synchronize()
        return [p() for p in pending]


def capture(clock: Clock, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor):
    """A CUDA graph of fn (after an eager warm-up); on the CPU an eager stand-in with the same interface."""
    fn(*inputs)
    if clock.cuda:
        return StepGraphs().capture(fn, *inputs)
    static = tuple(t.clone() for t in inputs)
    replay = type("Eager", (), {"replay": staticmethod(lambda: fn(*static))})
    return type("Step", (), {"graph": replay, "inputs": static})


def graph_timer(clock: Clock, fn: Callable[..., torch.Tensor], inputs: Sequence[tuple[torch.Tensor, ...]]):
    """Per call i: copy inputs[i] into the captured step's static inputs (untimed), time one replay."""
    step = capture(clock, fn, *inputs[0])

    def run(i: int) -> Callable[[], float]:
        for static, value in zip(step.inputs, inputs[i % len(inputs)], strict=True):
            static.copy_(value)
        return clock.span(step.graph.replay)

    return run


def replays(clock: Clock, graph: torch.cuda.CUDAGraph) -> Callable[[int], Callable[[], float]]:
    """A `Clock.repeat` run that replays `graph` once per repetition."""
    return lambda _i: clock.span(graph.replay)


def eager_timer(clock: Clock, fn: Callable[..., torch.Tensor], inputs: Sequence[tuple[torch.Tensor, ...]]):
    fn(*inputs[0])
    return lambda i: clock.span(lambda: fn(*inputs[i % len(inputs)]))


def bf16_timer(
    clock: Clock,
    weights: tuple[torch.Tensor, torch.Tensor],
    hidden: torch.Tensor,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    limit: float,
):
    """BF16 torch, the best case for a per-expert loop: routes known on the host, one graph per routing set."""
    gate_up, down = weights

    def step_for(ids: torch.Tensor, rw: torch.Tensor) -> Callable[[], torch.Tensor]:
        ids_h, rw = ids.cpu(), rw.to(torch.bfloat16)
        plan = [(e, *(i.to(hidden.device) for i in torch.where(ids_h == e))) for e in torch.unique(ids_h).tolist()]

        def step() -> torch.Tensor:
            out = torch.zeros_like(hidden)
            for e, tok, slot in plan:
                g, u = F.linear(hidden[tok], gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit), down[e]) * rw[tok, slot, None]
                out.index_add_(0, tok, y)
            return out

        return step

    # each step function is kept with its graph: the graph reads the route index tensors the function holds,
    # and freeing them would let the allocator hand their memory to later tensors under a replaying graph
    steps = [(capture(clock, fn), fn) for fn in (step_for(ids, rw) for ids, rw in routes)]
    return lambda i: clock.span(steps[i % len(steps)][0].graph.replay)


def copy_bandwidth(clock: Clock, device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 20 copies of 2 GiB)."""
    src = torch.empty(1 << (29 if clock.cuda else 20), dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    us = statistics.median(clock.repeat(eager_timer(clock, lambda x: dst.copy_(x), [(src,)]), 20))
    return 2 * src.numel() * 4 / (us * 1e-6)


def summarize(
    layout: str, batch: int, impl: str, times: list[float], nbytes: float, bw: float, copy_bw: float
) -> Timing:
    med = statistics.median(times)
    q = statistics.quantiles(times, n=10)
    roof = nbytes / bw * 1e6
    return Timing(
        layout, batch, impl, med, q[0], q[-1], nbytes, roof, roof / med, nbytes / copy_bw * 1e6 / med, med / batch
    )


def exllamav3_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("exllamav3")
    except PackageNotFoundError:
        return None


def sweep_configs() -> list[GemmConfig]:
    return [
        GemmConfig(ti=ti, tj=tj, split_tiles=st, num_warps=nw)
        for ti, tj, st, nw in ((4, 8, 64, 4), (4, 8, 32, 4), (8, 4, 32, 4), (8, 4, 64, 4), (4, 4, 32, 4))
    ]


@dataclass(frozen=True)
class Case:
    """One (layout, batch): the layer, its inputs per routing set and the bytes a step reads."""

    layout: Layout
    batch: int
    w: MoEWeights
    logical: list[tuple[torch.Tensor, torch.Tensor]]  # top-k routes per routing set
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (hidden, virtual ids, weights)
    exl3_bytes: float
    bf16_bytes: float


def make_cases(args, gen, layers: dict[str, tuple[Layout, MoEWeights]]) -> list[Case]:
    cases = []
    for layout, w in layers.values():
        for batch in args.batches:
            hidden = torch.randn(batch, args.hidden, generator=gen, device=gen.device).to(torch.bfloat16)
            logical = routing_sets(gen, args, batch)
            routes = [expand_routes(ids, rw, layout.ranks) for ids, rw in logical]
            unique = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in logical)
            cases.append(
                Case(
                    layout,
                    batch,
                    w,
                    logical,
                    [(hidden, ids, rw) for ids, rw in routes],
                    statistics.mean(expert_bytes(w) * int(torch.unique(i).numel()) for i, _ in routes),
                    unique * 3 * args.hidden * args.inter * 2,
                )
            )
    return cases


def time_impl(
    args,
    clock: Clock,
    case: Case,
    impl: str,
    make_timer: Callable[[], Callable],
    copy_bw: float,
    results: list,
    notes: dict,
) -> bool:
    """Time one implementation on one case; False once the CUDA context is broken (later work would fail)."""
    key = f"{impl}.{case.layout.name}.b{case.batch}"
    try:
        times = clock.repeat(make_timer(), args.reps)
    except Exception as exc:  # noqa: BLE001 - recorded in the notes: one failed case must not lose the others
        notes[key] = traceback.format_exc()[-2000:]
        print(f"{key}: FAILED {exc!r}"[:300], flush=True)
        return "CUDA error" not in str(exc)
    nbytes = case.bf16_bytes if impl.startswith("bf16") else case.exl3_bytes
    results.append(summarize(case.layout.name, case.batch, impl, times, nbytes, args.hbm_gbs * 1e9, copy_bw))
    r = results[-1]
    print(
        f"{case.layout.name:5s} b{case.batch:<3d} {impl:22s} {r.median_us:9.1f} us  {r.bytes_per_step / 1e6:8.1f} MB  "
        f"roofline {r.roofline_fraction:6.1%}",
        flush=True,
    )
    return True


def run_ours(args, clock: Clock, cases: list[Case], copy_bw: float, results: list, notes: dict) -> bool:
    for case in cases:
        ours = partial(fused_moe, w=case.w)  # choose_moe_config sizes the jobs
        for impl, timer in (("ours_graph", graph_timer), ("ours_eager", eager_timer)):
            if not time_impl(
                args, clock, case, impl, partial(timer, clock, ours, case.inputs), copy_bw, results, notes
            ):
                return False
    return True


def run_bf16(args, clock: Clock, cases: list[Case], bf16, copy_bw: float, results: list, notes: dict) -> bool:
    for case in cases:
        if case.layout.ranks == 1:  # the dense weights are the same for both layouts
            make = partial(bf16_timer, clock, bf16, case.inputs[0][0], case.logical[: args.bf16_routings], 10.0)
            if not time_impl(args, clock, case, "bf16_torch_graph", make, copy_bw, results, notes):
                return False
    return True


def run_exllamav3(args, clock: Clock, cases: list[Case], copy_bw: float, results: list, notes: dict) -> None:
    """ExLlamaV3's fused exl3_moe on the same weights and inputs (last: a failure there cannot cost our numbers)."""
    from glmquant.runtime.kernels.backend import ExllamaV3MoE

    kernels: dict[str, ExllamaV3MoE] = {}
    for case in cases:
        exl = kernels.get(case.layout.name)
        if exl is None:
            exl = kernels[case.layout.name] = ExllamaV3MoE(case.w, max_tokens=max(args.batches))
        ours = fused_moe(*case.inputs[0], case.w).float()
        notes[f"exllamav3_vs_ours_rel_diff.{case.layout.name}.b{case.batch}"] = float(
            (exl(*case.inputs[0]).float() - ours).norm() / ours.norm()
        )
        torch.cuda.synchronize()
        for impl, timer in (("exllamav3_fused_graph", graph_timer), ("exllamav3_fused_eager", eager_timer)):
            if not time_impl(args, clock, case, impl, partial(timer, clock, exl, case.inputs), copy_bw, results, notes):
                return


def run_sweep(args, gen, clock: Clock, results: list) -> None:
    """Graphed steps per core config (`sweep_configs`) at each --batches size.

    Jobs are sized as `choose_moe_config` sizes them.
    """
    for ranks in (1, args.ranks):
        w = make_layer(gen, args, ranks)
        for batch in args.batches:
            inputs = [
                (
                    torch.randn(batch, args.hidden, generator=gen, device=gen.device).to(torch.bfloat16),
                    *expand_routes(i, r, ranks),
                )
                for i, r in routing_sets(gen, args, batch)
            ]
            job_rows = choose_moe_config(batch, inputs[0][1].numel(), w).job_rows
            for cfg in sweep_configs():
                row = {"ranks": ranks, "batch": batch, "job_rows": job_rows, "config": asdict(cfg)}
                try:
                    step = partial(fused_moe, w=w, cfg=MoEConfig(job_rows, cfg, cfg))
                    row["median_us"] = statistics.median(clock.repeat(graph_timer(clock, step, inputs), args.reps))
                except Exception as exc:  # noqa: BLE001 - recorded in the row: a config that fails is a result
                    row["error"] = repr(exc)[-500:]
                results.append(row)
                print("sweep", ranks, batch, job_rows, asdict(cfg), row.get("median_us"), flush=True)


def stage_calls(
    w: MoEWeights, hidden: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, cfg: MoEConfig
) -> dict[str, Callable[[], object]]:
    """The launches of one fused_moe step as separate calls on precomputed intermediates (same order)."""
    plan = plan_routes(ids, cfg.job_rows)
    pairs = takes_fp16_pairs(job_rows(plan.jobs))
    x_gu = rotate_in(hidden, plan.tokens, w.gate_up, plan.experts, pairs)
    part_gu = exl3_rows(x_gu, w.gate_up, plan.experts, plan.jobs, cfg.gate_up)
    x_d = swiglu(part_gu, plan, w)
    part_d = exl3_rows(x_d, w.down, plan.experts, plan.jobs, cfg.down)
    out = torch.empty((hidden.shape[0], w.down.out_features), dtype=hidden.dtype, device=hidden.device)
    rwf = rw.float().contiguous()
    return {
        "plan_routes": partial(plan_routes, ids, cfg.job_rows),
        "rotate_in": partial(rotate_in, hidden, plan.tokens, w.gate_up, plan.experts, pairs),
        "core_gate_up": partial(exl3_rows, x_gu, w.gate_up, plan.experts, plan.jobs, cfg.gate_up),
        "swiglu": partial(swiglu, part_gu, plan, w),
        "core_down": partial(exl3_rows, x_d, w.down, plan.experts, plan.jobs, cfg.down),
        "rotate_out": partial(rotate_out, part_d, plan.pos, rwf, plan.experts, w.down, out),
        "whole_step": partial(fused_moe, hidden, ids, rw, w, cfg),
    }


def run_stages(args, gen, clock: Clock, cfg: GemmConfig) -> list[dict]:
    """Batch-1 time of each launch of a step: one graph replays the launch for every routing set in turn
    (different experts each time, so the weights come from HBM), time / sets = time per launch."""
    rows = []
    for ranks in (1, args.ranks):
        w = make_layer(gen, args, ranks)
        sets = [
            (
                torch.randn(1, args.hidden, generator=gen, device=gen.device).to(torch.bfloat16),
                *expand_routes(i, r, ranks),
            )
            for i, r in routing_sets(gen, args, 1)
        ]
        calls = [stage_calls(w, *s, MoEConfig(1, cfg, cfg)) for s in sets]
        for stage in calls[0]:
            for c in calls:
                c[stage]()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for c in calls:
                    c[stage]()
            times = clock.repeat(replays(clock, graph), 20)
            rows.append(
                {
                    "ranks": ranks,
                    "stage": stage,
                    "config": asdict(cfg),
                    "us_per_call": statistics.median(times) / len(calls),
                }
            )
            print(f"stage ranks={ranks} {stage:14s} {rows[-1]['us_per_call']:8.1f} us", flush=True)
    return rows


def profile_one_step(args, gen) -> None:
    """One eager batch-1 step of each layout between cudaProfilerStart/Stop, for `ncu --profile-from-start off`."""
    for ranks in (1, args.ranks):
        w = make_layer(gen, args, ranks)
        ids, rw = expand_routes(*routing_sets(gen, args, 1)[0], ranks)
        hidden = torch.randn(1, args.hidden, generator=gen, device=gen.device).to(torch.bfloat16)
        fused_moe(hidden, ids, rw, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fused_moe(hidden, ids, rw, w)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def projection(results: list[Timing], plan_bytes: int, gb10: list[float]) -> dict:
    """GB10 single-stream tok/s from the batch-1 roofline fraction of the tr3 (reference) layout."""
    out: dict[str, Any] = {"plan_decode_bytes_per_token": plan_bytes}
    for r in results:
        if r.batch == 1 and r.impl in ("ours_graph", "exllamav3_fused_graph"):
            key = f"{r.impl}.{r.layout}"
            out[key] = {
                "roofline_fraction": r.roofline_fraction,
                **{f"gb10_{int(bw)}GBs_tok_per_s": r.roofline_fraction * bw * 1e9 / plan_bytes for bw in gb10},
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--impls",
        type=lambda s: s.split(","),
        default=["ours", "bf16"],
        help="comma-separated: ours, bf16, exllamav3 (ExLlamaV3's fused exl3_moe kernel, timed last)",
    )
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=["plain", "tr3"])
    parser.add_argument("--sweep", action="store_true", help="then time a few core launch configs at each batch")
    parser.add_argument("--stages", action="store_true", help="only time each launch of a batch-1 step, per config")
    parser.add_argument("--profile-step", action="store_true", help="only run one step per layout for ncu")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--codebook", default="mcg")
    parser.add_argument("--routings", type=int, default=16, help="routing sets rotated across replays")
    parser.add_argument("--bf16-routings", type=int, default=4, help="routing sets (one graph each) for BF16")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument(
        "--hbm-gbs", type=float, default=4300.0, help="roofline bandwidth (H200 measured copy: 4.3 TB/s)"
    )
    parser.add_argument("--plan-bytes", type=int, default=PLAN_BYTES_TR3)
    parser.add_argument("--gb10-gbs", type=lambda s: [float(b) for b in s.split(",")], default=[273.0, 218.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (tiny shapes)")
    args = parser.parse_args()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    clock = Clock(gen.device)
    cuda = clock.cuda
    report = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "exllamav3": exllamav3_version(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile_step:
        return profile_one_step(args, gen)
    if args.stages:
        report["stages"] = [row for cfg in sweep_configs() for row in run_stages(args, gen, clock, cfg)]
        (args.out / "moe_stages.json").write_text(json.dumps(report, indent=2) + "\n")
        return None
    t0 = time.time()
    report["copy_bandwidth_gbs"] = copy_bandwidth(clock, gen.device) / 1e9
    print(f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s", flush=True)
    bf16 = None
    if "bf16" in args.impls:
        bf16 = (
            torch.randn(args.experts, 2 * args.inter, args.hidden, device=gen.device, dtype=torch.bfloat16) * 0.02,
            torch.randn(args.experts, args.hidden, args.inter, device=gen.device, dtype=torch.bfloat16) * 0.02,
        )
    results: list[Timing] = []
    notes: dict = {}
    layers = {
        name: (Layout(name, ranks), make_layer(gen, args, ranks))
        for name, ranks in (("plain", 1), ("tr3", args.ranks))
        if name in args.layouts
    }
    cases = make_cases(args, gen, layers)
    copy_bw = report["copy_bandwidth_gbs"] * 1e9

    def save() -> None:
        report.update(
            results=[asdict(r) for r in results],
            notes=notes,
            projection=projection(results, args.plan_bytes, args.gb10_gbs),
            seconds=time.time() - t0,
        )
        (args.out / "moe_decode.json").write_text(json.dumps(report, indent=2) + "\n")

    healthy = "ours" not in args.impls or run_ours(args, clock, cases, copy_bw, results, notes)
    save()
    if healthy and bf16 is not None:
        healthy = run_bf16(args, clock, cases, bf16, copy_bw, results, notes)
        save()
    if healthy and "exllamav3" in args.impls:
        try:
            run_exllamav3(args, clock, cases, copy_bw, results, notes)
        except Exception:  # noqa: BLE001 - recorded in the notes: ours and BF16 are already measured
            notes["exllamav3"] = traceback.format_exc()[-3000:]
        save()
    print(json.dumps(report["projection"], indent=1), flush=True)
    del bf16
    if args.sweep and healthy:
        report["sweep"] = []
        run_sweep(args, gen, clock, report["sweep"])
        (args.out / "moe_decode.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
