"""Correctness of the EXL3 Triton kernels on a CUDA GPU; writes kernels_check.json under --out.

For every codebook and K in {2, 3, 4}, with fresh random inputs each time:
  - decode: unit-vector activations through the production core return the inner weight Q bit for bit;
  - linear: real expert shapes (4096 x 2048, 2048 x 4096) at 1 and 33 rows (one-row and 16-row jobs) against an
    exact float64 W (relative Frobenius error < LINEAR_BOUND, GEMV_ERROR_BOUND through the GEMV core), and three
    4096 x 2048 linears as one stack at 1, 3 and 33 rows written into columns of a wider output; outputs
    pre-filled with NaN and the allocator's free blocks poisoned with NaN, so any element a kernel fails to write
    shows up;
  - moe: the fused step, plain (16 experts of 4096 x 2048, top-8) and rank-stacked (64 virtual experts of
    width 512, 32 routes), 1 and 16 tokens, against a float64 reference (error < MOE_BOUND, GEMV_ERROR_BOUND
    through the GEMV core), same poisoning.
Also: graph replay equals eager bit for bit, compile reports of the core for sm_90 and sm_121, and the tiny
artifact decoded by the runtime on CUDA (triton backend with graphs) against the torch backend.

    python scripts/gpu_kernels_check.py --out DIR [--commit C]   # C: the commit measured (default: HEAD)
    python scripts/gpu_kernels_check.py --out DIR --compile-only   # no GPU needed: kernels_compile.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import tempfile
import time
import traceback
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from bench_common import git_commit

from glmquant.exl3 import Codebook, EXL3Tensor, decode_inner
from glmquant.runtime.kernels.cuda_graphs import StepGraphs
from glmquant.runtime.kernels.exl3_gemm import exl3_linear, exl3_rows, linear_job_rows
from glmquant.runtime.kernels.exl3_gemv import GEMV_ERROR_BOUND, fp16_pairs, takes_fp16_pairs
from glmquant.runtime.kernels.exl3_jobs import LARGE_JOBS, ONE_ROW_GEMV, GemmConfig, Jobs, WeightStack, one_row_gemv
from glmquant.runtime.kernels.fused_moe import MoEConfig, MoEWeights, choose_moe_config, fused_moe

LINEAR_BOUND = 2e-5  # tensor-core core: fp16 hi + lo activation planes, fp32 sums
MOE_BOUND = 1e-4
TAGS = [(cb, k) for cb in ("3inst", "mcg", "mul1") for k in (2, 3, 4)]


def random_exl3(gen: torch.Generator, inf: int, outf: int, bits: int, codebook: str, scale: float) -> EXL3Tensor:
    """Random trellis and random-sign scales on the generator's device (|suh| ~ scale, |svh| ~ 1)."""

    def signed(n: int) -> torch.Tensor:
        s = torch.randint(0, 2, (n,), generator=gen, device=gen.device) * 2 - 1
        return s * (0.5 + torch.rand(n, generator=gen, device=gen.device))

    trellis = torch.randint(
        -32768, 32768, (inf // 16, outf // 16, 16 * bits), generator=gen, device=gen.device, dtype=torch.int32
    ).to(torch.int16)
    return EXL3Tensor(trellis, (signed(inf) * scale).half(), signed(outf).half(), Codebook(codebook), inf, outf)


def exact_w(t: EXL3Tensor) -> torch.Tensor:
    """float64 W (in, out) = diag(suh) P Q P diag(svh) from the bit-exact Q, on the tensor's device."""
    i = torch.arange(128, device=t.trellis.device)
    parity = sum((((i[:, None] & i[None, :]) >> b) & 1 for b in range(7)), torch.zeros_like(i[:, None] * i)) % 2
    h = (1 - 2 * parity).double() / 128**0.5
    q = decode_inner(t.trellis, t.codebook).double()
    kp, np_ = q.shape
    q = (h @ q.view(kp // 128, 128, np_)).view(kp, np_)
    q = (q.view(kp, np_ // 128, 128) @ h).view(kp, np_)
    return t.suh.double()[:, None] * q * t.svh.double()[None, :]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float("inf") if not torch.isfinite(got).all() else float((got - want).norm() / want.norm())


def poison_allocator(device: torch.device) -> None:
    """Leave NaN in the caching allocator's free blocks (large and small pools) for the next allocations."""
    if device.type == "cuda":
        big = torch.full((1 << 28,), float("nan"), device=device)  # 1 GiB
        small = [torch.full((1 << 18,), float("nan"), device=device) for _ in range(64)]  # 1 MiB blocks
        del big, small


def check_decode(gen: torch.Generator, cb: str, k: int) -> dict:
    """x = identity rows: the core's fp32 partial sums are exactly Q (one product 1.0 * q per output)."""
    dev = gen.device
    t = random_exl3(gen, 256, 512, k, cb, 1.0)
    stack = WeightStack.from_tensors([[t]], dev)
    xr = torch.zeros((1, 256, 2, 256), dtype=torch.float16, device=dev)
    xr[0, :, 0] = torch.eye(256, device=dev)
    starts = torch.arange(0, 256, 16, dtype=torch.int32, device=dev)
    part = exl3_rows(
        xr,
        stack,
        torch.zeros(256, dtype=torch.int32, device=dev),
        Jobs(starts, torch.full_like(starts, 16), 16),
        GemmConfig(split_tiles=8),
    ).sum(0)[0]
    q = decode_inner(t.trellis, t.codebook).float()
    result = {"bit_exact": bool(torch.equal(part, q)), "mismatches": int((part != q).sum())}
    # one-row jobs, fp16-pair activations: the GEMV core at K2 and K4, the small-job core's fp16x2 products at other K
    xg = fp16_pairs(torch.eye(256, device=dev)[None])
    pairs = exl3_rows(xg, stack, torch.zeros(256, dtype=torch.int32, device=dev), None, GemmConfig(split_tiles=8))
    pairs = pairs.sum(0)[0]
    result.update(pairs_bit_exact=bool(torch.equal(pairs, q)), pairs_mismatches=int((pairs != q).sum()))
    return result


def check_linear(gen: torch.Generator, cb: str, k: int, hidden: int, inter: int) -> dict:
    result, dev = {}, gen.device
    for inf, outf in ((hidden, inter), (inter, hidden)):
        t = random_exl3(gen, inf, outf, k, cb, 0.02)
        stack = WeightStack.from_tensors([[t]], dev)
        w = exact_w(t)
        for rows in (1, 33):
            x = torch.randn(rows, inf, generator=gen, device=dev)
            out = torch.full((rows, outf), float("nan"), device=dev)
            poison_allocator(dev)
            exl3_linear(x, stack, out=out)
            bound = GEMV_ERROR_BOUND if takes_fp16_pairs(linear_job_rows(rows, stack)) else LINEAR_BOUND
            result[f"{inf}x{outf}.rows{rows}"] = {"rel_err": rel_err(out, x.double() @ w), "bound": bound}
    # three linears sharing their input as one stack, written into columns of a wider output as `project` does
    # (rows 3: an MTP verify's GEMV jobs of 2 and 1 rows); a column outside the stack's written fails the case
    linears = [random_exl3(gen, hidden, inter, k, cb, 0.02) for _ in range(3)]
    stack = WeightStack.from_tensors([[t] for t in linears], dev)
    w = torch.cat([exact_w(t) for t in linears], dim=1)
    for rows in (1, 3, 33):
        x = torch.randn(rows, hidden, generator=gen, device=dev)
        wide = torch.full((rows, 3 * inter + 16), float("nan"), device=dev)
        cols = slice(8, 8 + 3 * inter)
        poison_allocator(dev)
        exl3_linear(x, stack, out=wide[:, cols])
        untouched = bool(wide[:, :8].isnan().all() and wide[:, -8:].isnan().all())
        err = rel_err(wide[:, cols], x.double() @ w) if untouched else float("inf")
        bound = GEMV_ERROR_BOUND if takes_fp16_pairs(linear_job_rows(rows, stack)) else LINEAR_BOUND
        result[f"stack3.{hidden}x{inter}.rows{rows}"] = {"rel_err": err, "bound": bound}
    return result


def moe_case(gen: torch.Generator, cb: str, k: int, experts: int, hidden: int, inter: int):
    def make(i: int, o: int, s: float) -> list[EXL3Tensor]:
        return [random_exl3(gen, i, o, k, cb, s) for _ in range(experts)]

    gates, ups, downs = make(hidden, inter, 0.06), make(hidden, inter, 0.06), make(inter, hidden, 0.01)
    dev = gen.device
    w = MoEWeights(WeightStack.from_tensors([gates, ups], dev), WeightStack.from_tensors([downs], dev), 10.0)
    return w, [exact_w(t) for t in gates], [exact_w(t) for t in ups], [exact_w(t) for t in downs]


def moe_reference(x, ids, weights, wg, wu, wd, limit=10.0):
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    clamped = 0
    for t in range(x.shape[0]):
        for j, v in enumerate(ids[t].tolist()):
            g, u = x[t].double() @ wg[v], x[t].double() @ wu[v]
            clamped += int((g > limit).sum() + (u.abs() > limit).sum())
            out[t] += weights[t, j].double() * ((F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ wd[v])
    return out, clamped


def check_moe(gen: torch.Generator, cb: str, k: int, hidden: int, inter: int) -> dict:
    result, dev = {}, gen.device
    for layout, experts, width, n in (("plain", 16, inter, 8), ("tr3", 64, inter // 4, 32)):
        w, wg, wu, wd = moe_case(gen, cb, k, experts, hidden, width)
        for tokens in (1, 16):
            x = torch.randn(tokens, hidden, generator=gen, device=dev)
            ids = torch.stack([torch.randperm(experts, generator=gen, device=dev)[:n] for _ in range(tokens)])
            weights = torch.rand(tokens, n, generator=gen, device=dev)
            want, clamped = moe_reference(x, ids, weights, wg, wu, wd)
            for rows in (1, 2, 16, None):  # GEMV 1-, 2-row jobs (K2, K4), tensor-core jobs, choose_moe_config
                cfg = choose_moe_config(tokens, ids.numel(), w) if rows is None else MoEConfig(rows)
                out = torch.full((tokens, hidden), float("nan"), device=dev)
                poison_allocator(dev)
                fused_moe(x, ids, weights, w, cfg, out=out)
                bound = GEMV_ERROR_BOUND if takes_fp16_pairs(cfg.job_rows) else MOE_BOUND
                result[f"{layout}.tokens{tokens}.jobs{rows or 'chosen'}"] = {
                    "rel_err": rel_err(out, want),
                    "bound": bound,
                    "clamped_values": clamped,
                    "config": asdict(cfg),
                }
    return result


def check_graphs(gen: torch.Generator, hidden: int, inter: int) -> dict:
    """Eager, capture, then replays with fresh inputs: every replay equals an eager run bit for bit."""
    w, *_ = moe_case(gen, "mcg", 2, 16, hidden, inter)
    graphs, diffs = StepGraphs(), []

    def step(h: torch.Tensor, i: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return fused_moe(h, i, r, w)

    for _ in range(5):
        x = torch.randn(2, hidden, generator=gen, device="cuda")
        ids = torch.stack([torch.randperm(16, generator=gen, device="cuda")[:8] for _ in range(2)])
        weights = torch.rand(2, 8, generator=gen, device="cuda")
        diffs.append(float((graphs("moe", step, x, ids, weights) - step(x, ids, weights)).abs().max()))
    return {"max_abs_diff_per_call": diffs, "graphs_captured": graphs.captured}


def loop_mix(sass: str) -> dict:
    """Instruction counts of the longest loop body in a SASS listing (the core's K loop)."""
    instr = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(instr)}
    best: list[str] = []
    for i, (a, text) in enumerate(instr):
        target = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < a and int(target[1], 16) in where:
            body = [t for _, t in instr[where[int(target[1], 16)] : i + 1]]
            best = body if len(body) > len(best) else best
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best]
    return {op: ops.count(op) for op in sorted(set(ops), key=lambda o: -ops.count(o))}


def compile_for(fn, signature: dict, constexprs: dict, cc: int, num_warps: int, attrs: dict | None = None):
    """Compile a Triton kernel for sm_`cc` without a GPU: (kernel, `cuobjdump -res-usage` text, SASS listing)."""
    from triton.backends.compiler import GPUTarget

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    src = triton.compiler.ASTSource(
        fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs, attrs=attrs
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return kernel, usage, sass


def resource_usage(usage: str) -> list[str]:
    return re.findall(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)


def compile_reports() -> dict:
    """Per core (tensor-core rows, GEMV) and target (sm_90, sm_121): registers, spills, shared memory, the K-loop
    SASS instruction mix (K2 MCG, and K4 MCG through the GEMV core; default config, and the one-row-job GEMV
    configs; Triton's nvdisasm cannot decode sm_121a, so that mix is empty) and the PTX ops that only Hopper has
    (wgmma, TMA bulk tensor copies, setmaxnreg). Needs triton only, no GPU."""
    from glmquant.runtime.kernels.exl3_gemm import _exl3_rows_kernel
    from glmquant.runtime.kernels.exl3_gemv import _exl3_gemv_kernel
    from glmquant.runtime.kernels.exl3_gemv_kbit import (
        FLUSH,
        ONE_ROW_KBIT,
        SMALL_JOB_KBIT,
        TWO_ROW_KBIT,
        _exl3_row_kernel,
    )

    common = {
        "expert_ptr": "*i32",
        "job_start_ptr": "*i32",
        "job_rows_ptr": "*i32",
        "part_ptr": "*fp32",
        "R": "i32",
        "V": "i32",
        "KT": "i32",
        "NT": "i32",
        "hash_mask": "i32",
        "hash_flip": "i32",
    }
    rows_sig = {"x_ptr": "*fp16", "trellis_ptr": "*i32", **common}
    gemv_sig = {"x_ptr": "*i32", "words_ptr": "*i32", **common}
    pairs_sig = {"x_ptr": "*i32", "trellis_ptr": "*i32", **common}
    packed, planes = {"PAIRS": True, "PACKED": True}, {"PAIRS": False, "PACKED": False}

    def consts(cfg: GemmConfig, **extra: int | bool) -> dict:
        return {"STEP_TILES": cfg.split_tiles, "K": 2, "CB": 1, "TI": cfg.ti, "TJ": cfg.tj, **extra}

    default = GemmConfig()
    cores: dict[
        str, tuple[Any, dict, GemmConfig, dict[str, int | bool]]
    ] = {  # name: (kernel, signature, config, extra constexprs)
        "rows": (_exl3_rows_kernel, rows_sig, default, {"JOB_M": 16}),
        "rows_large_jobs": (_exl3_rows_kernel, rows_sig, LARGE_JOBS, {"JOB_M": 64}),
        "gemv": (_exl3_gemv_kernel, gemv_sig, default, {"JOB_ROWS_MAX": 1, "PACKED": True}),
        "gemv_one_row_jobs": (_exl3_gemv_kernel, gemv_sig, ONE_ROW_GEMV, {"JOB_ROWS_MAX": 1, "PACKED": True}),
        "gemv_one_row_jobs_3inst": (
            _exl3_gemv_kernel,
            gemv_sig,
            ONE_ROW_GEMV,
            {"JOB_ROWS_MAX": 1, "PACKED": True, "CB": 0},
        ),
        "gemv_two_row_jobs": (_exl3_gemv_kernel, gemv_sig, default, {"JOB_ROWS_MAX": 2, "PACKED": True}),
        "gemv_k4_one_row_jobs": (
            _exl3_gemv_kernel,
            gemv_sig,
            one_row_gemv(4),
            {"K": 4, "JOB_ROWS_MAX": 1, "PACKED": True},
        ),
        "gemv_k4_two_row_jobs": (_exl3_gemv_kernel, gemv_sig, default, {"K": 4, "JOB_ROWS_MAX": 2, "PACKED": True}),
        # the small-job core at the K it runs (K3, K5, K6: not the GEMV core's), one row and an MTP verify's 2-4
        # (one and two rows: fp16 pairs, fp16x2 products; more: hi/lo planes)
        "row_kbit_k3": (_exl3_row_kernel, pairs_sig, ONE_ROW_KBIT, {"K": 3, "ROWS": 1, **packed}),
        "row_kbit_k3_two_rows": (_exl3_row_kernel, pairs_sig, TWO_ROW_KBIT, {"K": 3, "ROWS": 2, **packed}),
        "row_kbit_k5_four_rows": (_exl3_row_kernel, rows_sig, SMALL_JOB_KBIT, {"K": 5, "ROWS": 4, **planes}),
    }
    reports = {}
    for name, (fn, sig, cfg, extra) in cores.items():
        # pointers are 16-byte aligned, as Triton specializes them at launch
        divisible = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(sig.values()) if kind.startswith("*")}
        weights_per_thread = cfg.ti * 16 * cfg.tj * 16 // (32 * cfg.num_warps)
        # the small-job core's packed loop runs FLUSH steps per iteration (64-tile splits: whole groups)
        steps_per_loop = FLUSH.value if extra.get("PACKED") and fn is _exl3_row_kernel else 1
        reports[f"{name}.config"] = {
            **consts(cfg, **extra),
            "num_warps": cfg.num_warps,
            "weights_per_thread_per_step": weights_per_thread,
            "steps_per_loop": steps_per_loop,
        }
        for cc in (90, 121):
            kernel, usage, sass = compile_for(fn, sig, consts(cfg, **extra), cc, cfg.num_warps, divisible)
            mix = loop_mix(sass)
            ptx = kernel.asm["ptx"]
            reports[f"{name}.sm_{cc}"] = {
                "target": ptx_target(ptx),
                "resource_usage": resource_usage(usage),
                "shared_bytes_launch": kernel.metadata.shared,
                "k_loop_sass": mix,
                "sass_instructions_per_weight": sum(mix.values()) / (weights_per_thread * steps_per_loop)
                if mix
                else None,
                "ptx_mma_sync": len(re.findall(r"\bmma\.sync", ptx)),
                "ptx_hopper_only": sorted(set(re.findall(r"wgmma|cp\.async\.bulk\.tensor|setmaxnreg", ptx))),
            }
    reports.update(launch_kernel_reports())
    return reports


def launch_kernel_reports() -> dict:
    """Registers, stack and shared memory per target of the smaller launches: the three Hadamard ones (rotate_in,
    SwiGLU, rotate_out), mHC's three at GLM-5.3-Flash's width (4 streams of 4096) and the router's scores."""
    from glmquant.runtime.kernels.exl3_gemm import _rotate_in_kernel, _rotate_out_kernel
    from glmquant.runtime.kernels.fused_moe import _swiglu_kernel
    from glmquant.runtime.kernels.mhc import _hyper_enter_kernel, _hyper_expand_kernel, _mix_partials_kernel
    from glmquant.runtime.kernels.router import _router_scores_kernel

    kernels: dict[str, tuple[Any, dict[str, str], dict[str, int | bool], int]] = {  # fn, signature, consts, warps
        "rotate_in": (
            _rotate_in_kernel,
            {
                "x_ptr": "*bf16",
                "src_ptr": "*i32",
                "scale_ptr": "*fp16",
                "scale_row_ptr": "*i32",
                "out_ptr": "*i32",
                "R": "i32",
                "V": "i32",
                "x_cols": "i32",
                "x_stride": "i32",
                "Kp": "i32",
            },
            {"ROWS": 16, "PAIRS": True},
            4,
        ),
        "swiglu": (
            _swiglu_kernel,
            {
                "part_ptr": "*fp32",
                "R": "i32",
                "expert_ptr": "*i32",
                "svh_ptr": "*fp16",
                "suh_d_ptr": "*fp16",
                "out_ptr": "*i32",
                "V": "i32",
                "Ip": "i32",
                "n_inter": "i32",
                "limit": "fp32",
            },
            {"SPLITS": 4, "ROWS": 16, "PAIRS": True},
            4,
        ),
        "rotate_out": (
            _rotate_out_kernel,
            {
                "part_ptr": "*fp32",
                "P_R": "i32",
                "pos_ptr": "*i32",
                "w_ptr": "*fp32",
                "expert_ptr": "*i32",
                "svh_ptr": "*fp16",
                "out_ptr": "*bf16",
                "n_routes": "i32",
                "Np": "i32",
                "n_cols": "i32",
                "out_stride": "i32",
                "proj_tokens": "i32",
            },
            {"SPLITS": 2, "ROWS": 16},
            4,
        ),
        "mhc_mix_partials": (
            _mix_partials_kernel,
            {"streams_ptr": "*bf16", "fn_ptr": "*bf16", "dots_ptr": "*fp32", "squares_ptr": "*fp32", "K": "i32"},
            {"W": 24, "WP": 32, "BLOCK": 256},
            4,
        ),
        "mhc_enter": (
            _hyper_enter_kernel,
            {
                "streams_ptr": "*bf16",
                "dots_ptr": "*fp32",
                "squares_ptr": "*fp32",
                "base_ptr": "*fp32",
                "scale_ptr": "*fp32",
                "norm_ptr": "*bf16",
                "out_ptr": "*bf16",
                "post_ptr": "*fp32",
                "comb_ptr": "*fp32",
                "P": "i32",
                "H": "i32",
                "rms_eps": "fp32",
                "hc_eps": "fp32",
            },
            {"N": 4, "ITERS": 20, "PP": 64, "HP": 4096},
            16,
        ),
        "mhc_expand": (
            _hyper_expand_kernel,
            {
                "streams_ptr": "*bf16",
                "out_ptr": "*bf16",
                "post_ptr": "*fp32",
                "comb_ptr": "*fp32",
                "next_ptr": "*bf16",
                "H": "i32",
            },
            {"N": 4, "BLOCK": 1024},
            4,
        ),
        "router_scores": (
            _router_scores_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "H": "i32", "E": "i32"},
            {"BE": 8, "BH": 512},
            4,
        ),
    }
    reports = {}
    for name, (fn, sig, consts, warps) in kernels.items():
        for cc in (90, 121):
            kernel, usage, _ = compile_for(fn, sig, consts, cc, num_warps=warps)
            reports[f"{name}.sm_{cc}"] = {
                "resource_usage": resource_usage(usage),
                "shared_bytes_launch": kernel.metadata.shared,
            }
    return reports


def check_runtime(tmp: Path) -> dict:
    """Greedy tokens of the tiny tr3 artifact: triton (graphs) on CUDA vs the torch backend on CUDA and CPU."""
    from glmquant.fixtures import build_tiny_checkpoint
    from glmquant.fixtures.random_artifact import build_artifact
    from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.options import RuntimeOptions

    artifact = build_artifact(build_tiny_checkpoint(tmp / "source"), tmp / "artifact", "tr3")
    prompt = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))
    tokens, captured = {}, 0
    for name, device, backend in (
        ("triton_cuda_graphs", "cuda", "triton"),
        ("torch_cuda", "cuda", "torch"),
        ("torch_cpu", "cpu", "torch"),
    ):
        loaded = load_model(artifact, RuntimeOptions(device=device, dtype="float32", backend=backend))
        tokens[name] = list(generate(loaded.model, prompt, SamplingParams(max_tokens=24), lambda ids: "").token_ids)
        captured = max(captured, getattr(getattr(loaded.backend, "graphs", None), "captured", 0))
    return {
        "tokens": tokens,
        "graphs_captured": captured,
        "triton_equals_torch_cuda": tokens["triton_cuda_graphs"] == tokens["torch_cuda"],
        "triton_equals_torch_cpu": tokens["triton_cuda_graphs"] == tokens["torch_cpu"],
    }


def ptx_target(ptx: str) -> str:
    """The `.target` a PTX module was compiled for."""
    found = re.search(r"\.target\s+(\S+)", ptx)
    if found is None:
        raise ValueError("the PTX names no .target")
    return found[1]


def run(name: str, fn, results: dict) -> None:
    t0 = time.time()
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - a failing check is recorded and the others still run
        results[name] = {"error": traceback.format_exc()[-3000:]}
    print(f"{name}: {time.time() - t0:.1f}s", flush=True)


def passed(results: dict) -> dict:
    def cases(name: str) -> list[dict]:
        section = results.get(name, {"error": "not run"})
        return [{"rel_err": float("inf"), "bound": 0.0}] if "error" in section else list(section.values())

    verdict = {}
    for cb, k in TAGS:
        tag = f"{cb}.K{k}"
        decode = results.get(f"decode.{tag}", {})
        linear, moe = cases(f"linear.{tag}"), cases(f"moe.{tag}")
        verdict[tag] = {
            "decode_bit_exact": decode.get("bit_exact", False) and decode.get("pairs_bit_exact", False),
            "linear_max_rel_err": max(c["rel_err"] for c in linear),
            "moe_max_rel_err": max(c["rel_err"] for c in moe),
        }
        verdict[tag]["pass"] = verdict[tag]["decode_bit_exact"] and all(c["rel_err"] < c["bound"] for c in linear + moe)
    return verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=4096, help="expert input width (GLM-5.3-Flash: 4096)")
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate width (GLM-5.3-Flash: 2048)")
    parser.add_argument("--device", default="cuda", help="cpu only for a dry run under TRITON_INTERPRET=1")
    parser.add_argument("--compile-only", action="store_true", help="only the sm_90/sm_121 compile reports (no GPU)")
    parser.add_argument("--commit", default=None, help="the commit measured (default: the checkout's HEAD)")
    args = parser.parse_args()
    if args.compile_only:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"triton": triton.__version__, **compile_reports()}
        (args.out / "kernels_compile.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=1))
        return
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    cuda = gen.device.type == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    header = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "shapes": {"hidden": args.hidden, "inter": args.inter},
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": args.commit or git_commit(),
        "bounds": {
            "linear_rel_frobenius": LINEAR_BOUND,
            "moe_rel_frobenius": MOE_BOUND,
            "gemv_rel_frobenius": GEMV_ERROR_BOUND,
        },
    }

    def save() -> dict:
        verdict = passed(results)
        report = {
            **header,
            "verdict": verdict,
            "all_pass": all(v["pass"] for v in verdict.values()),
            "results": results,
        }
        (args.out / "kernels_check.json").write_text(json.dumps(report, indent=2) + "\n")
        return verdict

    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            run("runtime_tiny_artifact", lambda: check_runtime(Path(tmp)), results)
        run("graphs", lambda: check_graphs(gen, args.hidden, args.inter), results)
    for cb, k in TAGS:
        run(f"decode.{cb}.K{k}", partial(check_decode, gen, cb, k), results)
        run(f"linear.{cb}.K{k}", partial(check_linear, gen, cb, k, args.hidden, args.inter), results)
        run(f"moe.{cb}.K{k}", partial(check_moe, gen, cb, k, args.hidden, args.inter), results)
        save()
    if cuda:
        run("compile", compile_reports, results)
    verdict = save()
    for tag, v in verdict.items():
        print(
            f"{tag:10s} decode_exact={v['decode_bit_exact']!s:5s} linear={v['linear_max_rel_err']:.2e} "
            f"moe={v['moe_max_rel_err']:.2e} {'PASS' if v['pass'] else 'FAIL'}"
        )
    for name in ("graphs", "runtime_tiny_artifact", "compile"):
        if name in results:
            print(name, json.dumps({k: v for k, v in results[name].items() if k != "tokens"})[:600])


if __name__ == "__main__":
    main()
