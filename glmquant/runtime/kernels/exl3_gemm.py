"""EXL3 matrix products that decode trellis codes in registers (no dequantized weight in memory).

`y = (((x ∘ suh) P) Q) P ∘ svh` runs as three launches (for one linear, or for a stack of linears of one shape that
share their input, `exl3_linear`): `rotate_in` (activations only: scale by suh, 128-block
Hadamard), `exl3_rows` (the decode-and-multiply core over the packed trellis, split along K into fp32
partial sums) and `rotate_out` (sum the partials, Hadamard, svh, optional router weights). The core works on
jobs (`exl3_jobs`): rows that share one weight, decoded once per job. Jobs of one or two rows at K2 or K4 (K2
experts, the speed tier's K4 retained linears and K4 expert tiers at batch 1, an MTP verify's 2-4 rows as one or
two jobs) take the GEMV core (`exl3_gemv`: fp16 activations, fp16x2 CUDA-core products, nothing through shared
memory); jobs of up to four rows at other K the small-job core (`exl3_gemv_kbit`: CUDA-core products in the decode
layout, fp16x2 at one or two rows, fp32 at three or four); larger jobs the tensor-core core here (fp16 hi/lo
activation planes, mma.sync).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from glmquant.exl3 import EXL3Tensor
from glmquant.runtime.kernels.exl3_decode import HASH_FLIP, HASH_MASK, load_window, ring_fields, window_values
from glmquant.runtime.kernels.exl3_gemv import (
    GEMV_BITS,
    GEMV_JOB_ROWS,
    _exl3_gemv_kernel,
    packed_gemv,
    takes_fp16_pairs,
    uses_gemv,
)
from glmquant.runtime.kernels.exl3_gemv_kbit import (
    ONE_ROW_KBIT,
    SMALL_JOB_KBIT,
    SMALL_JOB_ROWS,
    TWO_ROW_KBIT,
    _exl3_row_kernel,
)
from glmquant.runtime.kernels.exl3_jobs import (
    JOB_ROWS,
    LARGE_JOB_ROWS,
    LARGE_JOBS,
    GemmConfig,
    Jobs,
    WeightStack,
    job_program,
    job_rows,
    one_row_gemv,
    tile_rows,
)


@triton.jit
def had128_rows(v):
    """v [ROWS, 128] fp32 times the normalized Sylvester Hadamard block: a fast Walsh-Hadamard butterfly in fp32.

    Stage k pairs columns c and c ^ 2^k into (a + b, a - b); no matrix is built and no tensor core is used.
    """
    ROWS: tl.constexpr = v.shape[0]
    for k in tl.static_range(7):
        pairs = tl.permute(tl.reshape(v, (ROWS, 64 >> k, 2, 1 << k)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, 128))
    return v * 0.08838834764831845


@triton.jit
def store_hi_lo(ptr, plane, v, mask):
    """Store fp32 v as two fp16 planes (hi at ptr, lo = v - hi at ptr + plane): ~fp32 accurate tensor-core input."""
    hi = v.to(tl.float16)
    tl.store(ptr, hi, mask=mask)
    tl.store(ptr + plane, (v - hi.to(tl.float32)).to(tl.float16), mask=mask)


@triton.jit
def store_activations(out_ptr, row, cols, Kp, v, live, PAIRS: tl.constexpr):
    """Store rotated activations v [ROWS, 128] (row: [ROWS, 1] int64) in a core's input format.

    PAIRS: fp16 twice per int32 [R, Kp] (an fp16x2 operand, `takes_fp16_pairs`); else fp16 hi/lo planes [R, 2, Kp].
    """
    if PAIRS:
        half = v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        tl.store(out_ptr + row * Kp + cols, (half | (half << 16)).to(tl.int32, bitcast=True), mask=live)
    else:
        store_hi_lo(out_ptr + row * (2 * Kp) + cols, Kp, v, live)


@triton.jit
def _rotate_in_kernel(
    x_ptr,
    src_ptr,
    scale_ptr,
    scale_row_ptr,
    out_ptr,
    R,
    V,
    x_cols,
    x_stride,
    Kp,
    ROWS: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """out[p, i, blk] = had(x[src[i], blk] ∘ scale[p, scale_row[i], blk]) in the core's format.

    Columns of x at or beyond x_cols read as 0.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    p = tl.program_id(1)
    cols = tl.program_id(2) * 128 + tl.arange(0, 128)[None, :]
    live = rows < R
    src = tl.load(src_ptr + rows, mask=live, other=0).to(tl.int64)
    x = tl.load(x_ptr + src * x_stride + cols, mask=live & (cols < x_cols), other=0.0).to(tl.float32)
    srow = tl.load(scale_row_ptr + rows, mask=live, other=0).to(tl.int64)
    su = tl.load(scale_ptr + (p * V + srow) * Kp + cols, mask=live, other=0.0).to(tl.float32)
    store_activations(out_ptr, p * R + rows.to(tl.int64), cols, Kp, had128_rows(x * su), live, PAIRS)


@triton.jit
def _exl3_rows_kernel(
    x_ptr,
    trellis_ptr,
    expert_ptr,
    job_start_ptr,
    job_rows_ptr,
    part_ptr,
    R,
    V,
    KT,
    NT,
    hash_mask,
    hash_flip,
    STEP_TILES: tl.constexpr,
    K: tl.constexpr,
    CB: tl.constexpr,
    TI: tl.constexpr,
    TJ: tl.constexpr,
    JOB_M: tl.constexpr,
):
    """part[s, p, job rows, cols] = x[p, job rows, k-split s] @ Q[p, expert] for one 16*TJ-column block (jobs from
    the job tables: one-row jobs take `exl3_gemv_kbit`); JOB_M rows per tile (`tile_rows`: 16, or 64 so that a
    prefill's many rows per expert share one decode of each weight block).

    Each step decodes a [TI*16, TJ*16] weight block in registers as dims [ti, tj, e1, e0, e2, g, l4]: the
    stream window depends on (ti, tj, g, l4) only, so it is built once per block of positions (and loaded two
    steps ahead, hiding the memory latency of these 4-byte gathers that cp.async pipelining cannot take); the
    block is then permuted to (k, n) order and fed to two fp16 tensor-core products (activation hi and lo).
    """
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, False)
    if rows > 0:
        ti_, tj_, e1, e0, e2, g, l4 = ring_fields(TI, TJ)
        expert = tl.load(expert_ptr + row0).to(tl.int64)
        tiles = trellis_ptr + (p * V + expert) * (KT * NT * 8 * K) + (nb * TJ + tj_) * (8 * K)
        m = tl.arange(0, JOB_M)[:, None]
        xrow = x_ptr + (p * R + row0 + m).to(tl.int64) * (2 * KT * 16) + tl.arange(0, TI * 16)[None, :]
        acc = tl.zeros([JOB_M, TJ * 16], dtype=tl.float32)
        first = split * STEP_TILES
        rows_step = NT * 8 * K  # int32 words per row of tiles
        win = load_window(tiles + (first + ti_) * rows_step, g, l4, e2, 2 * e1 + e0, K)
        win1 = load_window(tiles + (first + TI % STEP_TILES + ti_) * rows_step, g, l4, e2, 2 * e1 + e0, K)
        for step in range(0, STEP_TILES, TI):  # constexpr trip count: one K split
            # windows are loaded two steps ahead (the last steps reload the first: in cache, never used)
            win2 = load_window(
                tiles + (first + (step + 2 * TI) % STEP_TILES + ti_) * rows_step, g, l4, e2, 2 * e1 + e0, K
            )
            q = window_values(win, e2, 2 * e1 + e0, K, CB, hash_mask, hash_flip)
            q = tl.reshape(
                tl.permute(q, (0, 2, 6, 3, 1, 4, 5)), (TI * 16, TJ * 16)
            )  # k = (ti, e1, l4, e0), n = (tj, e2, g)
            hi = tl.load(xrow + 16 * (first + step), mask=m < rows, other=0.0)
            lo = tl.load(xrow + KT * 16 + 16 * (first + step), mask=m < rows, other=0.0)
            acc = tl.dot(lo, q, tl.dot(hi, q, acc))
            win, win1 = win1, win2
        cols = nb * TJ * 16 + tl.arange(0, TJ * 16)[None, :]
        dst = part_ptr + ((split * n_proj + p) * R + row0 + m).to(tl.int64) * (NT * 16)
        tl.store(dst + cols, acc, mask=m < rows)


@triton.jit
def _rotate_out_kernel(
    part_ptr,
    P_R,
    pos_ptr,
    w_ptr,
    expert_ptr,
    svh_ptr,
    out_ptr,
    n_routes,
    Np,
    n_cols,
    out_stride,
    proj_tokens,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out[t % proj_tokens, (t // proj_tokens) n_cols + blk] = sum_j w[t, j] * had(sum_s part[s, pos[t, j], blk]) ∘
    svh[expert[pos[t, j]], blk]: tokens t of projection t // proj_tokens fill that projection's columns."""
    t = tl.program_id(0)
    j = tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)[None, :]
    live = j < n_routes
    row = tl.load(pos_ptr + t * n_routes + j, mask=live, other=0).to(tl.int64)
    acc = tl.zeros([ROWS, 128], dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: the partial loads overlap instead of queueing
        acc += tl.load(part_ptr + (s * P_R + row) * Np + cols, mask=live, other=0.0)
    expert = tl.load(expert_ptr + row, mask=live, other=0).to(tl.int64)
    sv = tl.load(svh_ptr + expert * Np + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * n_routes + j, mask=live, other=0.0).to(tl.float32)
    y = tl.sum(had128_rows(acc) * sv * w, axis=0)
    out_cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    dst = out_ptr + (t % proj_tokens).to(tl.int64) * out_stride + (t // proj_tokens) * n_cols + out_cols
    tl.store(dst, y, mask=out_cols < n_cols)


def activation_buffer(P: int, R: int, kp: int, pairs: bool, device: torch.device) -> torch.Tensor:
    """Uninitialized core input: int32 [P, R, kp] holding each fp16 activation twice (`pairs`, jobs of one or two
    rows: `takes_fp16_pairs`), fp16 hi/lo planes [P, R, 2, kp] otherwise."""
    if pairs:
        return torch.empty((P, R, kp), dtype=torch.int32, device=device)
    return torch.empty((P, R, 2, kp), dtype=torch.float16, device=device)


def rotate_in(
    x: torch.Tensor, src: torch.Tensor, stack: WeightStack, scale_row: torch.Tensor, pairs: bool
) -> torch.Tensor:
    """had(x[src[i]] ∘ suh[p, scale_row[i]]) for every projection p, as `activation_buffer` lays it out."""
    P, V, kp = stack.suh.shape
    R = src.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = activation_buffer(P, R, kp, pairs, x.device)
    _rotate_in_kernel[(triton.cdiv(R, 16), P, kp // 128)](
        x, src, stack.suh, scale_row, out, R, V, x.shape[1], x.stride(0), kp, ROWS=16, PAIRS=pairs
    )
    return out


def exl3_rows(
    xr: torch.Tensor, stack: WeightStack, experts: torch.Tensor, jobs: Jobs | None, cfg: GemmConfig
) -> torch.Tensor:
    """fp32 partial sums [splits, P, R, out_pad] of xr (`activation_buffer` layout) @ Q[p, experts[row]].

    `jobs`: rows of a job share one expert, whose weights are decoded once per job; None: one row per job.
    """
    P, V, kt, nt, _ = stack.trellis.shape
    R = xr.shape[1]
    gemv = uses_gemv(stack, job_rows(jobs))
    pairs = (xr.dtype, xr.dim()) == (torch.int32, 3)
    # fp16 pairs for the GEMV core, hi/lo planes for jobs of 3 rows or more; the small-job core takes both
    formats = (True,) if gemv else (True, False) if takes_fp16_pairs(job_rows(jobs)) else (False,)
    if pairs not in formats or (not pairs and (xr.dtype, xr.dim()) != (torch.float16, 4)):
        core = "GEMV" if gemv else "small-job" if job_rows(jobs) <= SMALL_JOB_ROWS else "tensor-core"
        raise ValueError(
            f"activations {xr.dtype} {tuple(xr.shape)} are not the {core} core's format (activation_buffer)"
        )
    if nt % cfg.tj:
        raise ValueError(f"{nt} column tiles do not split into blocks of tj = {cfg.tj}")
    part = torch.empty((cfg.splits(kt), P, R, nt * 16), dtype=torch.float32, device=xr.device)
    starts, counts = (jobs.starts, jobs.counts) if jobs is not None else (experts, experts)  # unread for one-row jobs
    grid = (R if jobs is None else starts.numel(), P * (nt // cfg.tj), cfg.splits(kt))
    common_args = (part, R, V, kt, nt, HASH_MASK, HASH_FLIP)  # every core's arguments after its job tables
    shape = {
        "STEP_TILES": cfg.tiles_per_split(kt),
        "K": stack.bits,
        "CB": stack.codebook,
        "TI": cfg.ti,
        "TJ": cfg.tj,
        "num_warps": cfg.num_warps,
    }
    words = stack.trellis.view(torch.int32)  # every core reads the stream as uint32 words
    if gemv:
        extra = {"JOB_ROWS_MAX": job_rows(jobs), "PACKED": packed_gemv(xr, stack)}
        _exl3_gemv_kernel[grid](xr, words, experts, starts, counts, *common_args, **shape, **extra)
    elif job_rows(jobs) <= SMALL_JOB_ROWS:  # CUDA cores, no 16-row tile of mostly empty rows
        ROWS = triton.next_power_of_2(job_rows(jobs))
        extra = {"ROWS": ROWS, "PAIRS": pairs, "PACKED": pairs and packed_gemv(xr, stack)}
        _exl3_row_kernel[grid](xr, words, experts, starts, counts, *common_args, **shape, **extra)
    else:
        _exl3_rows_kernel[grid](
            xr, words, experts, starts, counts, *common_args, **shape, JOB_M=tile_rows(job_rows(jobs))
        )
    return part


def rotate_out(
    part: torch.Tensor,
    pos: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    stack: WeightStack,
    out: torch.Tensor,
    proj_tokens: int | None = None,
) -> torch.Tensor:
    """Fill out [T, out_features] with sum_j weights[t, j] * (had(sum_s part[s, pos[t, j]]) ∘ svh[expert[pos[t, j]]]),
    pos indexing part's P x R rows and expert the stack's P x V weights.

    `proj_tokens` (a stack of P linears: T = P x proj_tokens): out is [proj_tokens, P x out_features] instead,
    token t filling projection t // proj_tokens's columns of row t % proj_tokens."""
    splits, P, R, np_ = part.shape
    T, n = weights.shape
    _rotate_out_kernel[(T, np_ // 128)](
        part,
        P * R,
        pos,
        weights,
        experts,
        stack.svh,
        out,
        n,
        np_,
        stack.out_features,
        out.stride(0),
        proj_tokens or T,
        SPLITS=splits,
        ROWS=max(16, triton.next_power_of_2(n)),
    )
    return out


LINEAR_PROGRAMS = 1024  # programs a single linear's core launch aims for (~8 per H200 SM, ~21 per GB10 SM)
LINEAR_SPLIT_TILES = (64, 32, 16, 8)  # K splits tried for a single linear, coarsest (fewest partial sums) first


def linear_job_rows(rows: int, stack: WeightStack) -> int:
    """Rows per job of one linear's `rows` activation rows. Up to `SMALL_JOB_ROWS` (batch 1 and an MTP verify step,
    CUDA cores): at K2 and K4 GEMV jobs of at most `GEMV_JOB_ROWS` (a verify of 2-3 drafts is two jobs, whose
    programs are adjacent in the grid and decode each weight block while the other's read holds it in L2), at other
    K all of them in one small-job core job; then 16, or 64 from 64 rows (a prefill chunk: one decode of each weight
    block for four tensor-core tiles)."""
    if rows <= SMALL_JOB_ROWS:
        return min(rows, GEMV_JOB_ROWS) if stack.bits in GEMV_BITS else rows
    return JOB_ROWS.value if rows < LARGE_JOB_ROWS else LARGE_JOB_ROWS


def linear_config(
    rows: int, stack: WeightStack, programs: int = LINEAR_PROGRAMS, base: GemmConfig | None = None
) -> GemmConfig:
    """Launch shape of one linear's core for `rows` activation rows.

    A linear has one job per 16 rows (one per row at one row), so only column blocks and K splits make programs:
    at the expert-sized default a 4096 x 4096 linear is 128 programs at batch 1, under one per SM of an H200.
    K is cut finer until one job's launch reaches `programs`, a fixed count so every GPU sums alike (Triton's CPU
    interpreter runs programs one after another: `exl3_linear` asks it for the fewest), and up to `SMALL_JOB_ROWS`
    rows as finely as for one row (at K4 a verify's rows then equal one-row products bit for bit); one-row
    products take the one-row cores' steps (`one_row_gemv` at K2 and K4, `ONE_ROW_KBIT` otherwise), the small-job
    core's jobs of two rows `TWO_ROW_KBIT` and of 3-4 rows `SMALL_JOB_KBIT`; two-row GEMV jobs take the default
    steps at K2, as the fused MoE runs them, and K4's one-row steps.
    A stack of P linears (one launch for projections that share their input) counts P times the programs.
    `base` overrides the steps (a launch-shape sweep, `scripts/bench_exl3_linear.py`).
    """
    n_proj, _, kt, nt, _ = stack.trellis.shape
    job = linear_job_rows(rows, stack)
    base = base or _linear_steps(job, stack)
    jobs = 1 if rows <= SMALL_JOB_ROWS else -(-rows // job)  # a verify's jobs split K as one row does
    cfg = base
    for split_tiles in LINEAR_SPLIT_TILES:
        if math.gcd(kt, split_tiles) % base.ti:  # splits must be whole steps
            continue
        cfg = replace(base, split_tiles=split_tiles)
        if jobs * n_proj * (nt // base.tj) * cfg.splits(kt) >= programs:
            break
    return cfg


def _linear_steps(job: int, stack: WeightStack) -> GemmConfig:
    """The steps (ti, tj, warps) of a linear's core for jobs of `job` rows."""
    if job == LARGE_JOB_ROWS:
        return LARGE_JOBS
    if uses_gemv(stack, job):
        # K4 two-row jobs (a one-draft verify of the speed tier's linears) keep the one-row steps: the 4 x 8 default
        # made that verify 3.3 ms slower than the small-job core on the H200 (41.8 against 38.4 ms, 67737f4), and
        # one step shape makes the first row of a two-row job equal a one-row job's, bit for bit
        return one_row_gemv(stack.bits) if job == 1 or stack.bits == 4 else GemmConfig()
    if job <= SMALL_JOB_ROWS:
        return (ONE_ROW_KBIT, TWO_ROW_KBIT)[job - 1] if job <= GEMV_JOB_ROWS else SMALL_JOB_KBIT
    return GemmConfig()


def exl3_linear(
    x: torch.Tensor, tensor: EXL3Tensor | WeightStack, cfg: GemmConfig | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W.T for one EXL3 linear, or for a stack of P linears of one shape (`WeightStack` with V = 1) that
    share their input: y = x @ [W_0; ...; W_P-1].T, three launches for all of them in decode and verify steps (up
    to SMALL_JOB_ROWS rows), one linear after another for more rows.

    x is [..., in_features] of any float dtype; y is [..., P x out_features] in x's dtype, or out's
    ([M, P x out_features] for a 2-D x) when given. `cfg` defaults to `linear_config`'s.
    """
    stack = tensor if isinstance(tensor, WeightStack) else WeightStack.single(tensor, x.device)
    n_proj, experts = stack.trellis.shape[:2]
    if experts != 1:
        raise ValueError(f"exl3_linear takes linears (one weight per projection), not a stack of {experts} experts")
    lead, width = x.shape[:-1], n_proj * stack.out_features
    x = x.reshape(-1, x.shape[-1])
    M = x.shape[0]
    if out is not None and (out.shape != (M, width) or out.stride(-1) != 1 or out.device != x.device):
        raise ValueError(f"out {tuple(out.shape)} on {out.device} is not [{M}, {width}] with unit column stride")
    if M == 0:
        return x.new_zeros((*lead, width)) if out is None else out
    out = torch.empty((M, width), dtype=x.dtype, device=x.device) if out is None else out
    if n_proj > 1 and M > SMALL_JOB_ROWS:  # a prefill chunk: one projection at a time, whose partial sums (up to
        # splits x M x out fp32: 512 MiB for 4,096 rows of 4096 -> 8192) are one linear's, not the stack's
        for p in range(n_proj):
            exl3_linear(x, stack.projection(p), cfg, out[:, p * stack.out_features : (p + 1) * stack.out_features])
        return out.view(*lead, width)
    cfg = cfg or linear_config(M, stack, LINEAR_PROGRAMS if x.is_cuda else 1)
    tokens, proj, ones, jobs = linear_tables(M, n_proj, linear_job_rows(M, stack), x.device)
    xr = rotate_in(x, tokens[:M], stack, proj[:M], takes_fp16_pairs(job_rows(jobs)))
    part = exl3_rows(xr, stack, proj[:M], jobs, cfg)
    return rotate_out(part, tokens, ones, proj, stack, out, M).view(*lead, width)


LinearTables = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Jobs | None]
_SMALL_TABLES: dict[tuple[int, int, int, torch.device], LinearTables] = {}


def linear_tables(M: int, n_proj: int, size: int, device: torch.device) -> LinearTables:
    """The job tables of n_proj stacked linears for M rows in jobs of `size`: tokens 0..n_proj M - 1 (row
    t % M of projection t // M, the first M also the rows), each token's projection (0 for the first M: expert 0
    of every row), weight 1 per token, the jobs.

    Read-only, so those of decode and verify steps (M <= SMALL_JOB_ROWS) are made once per (M, n_proj, size,
    device) and shared: built per call they were four launches per one-row linear (seven from two rows), about
    2,100 of a speed-tier decode step's 6,479 launches on the H200 (62e2343). Tables first asked for while a CUDA
    graph is captured are built for that call only, since the graph's memory pool would own them."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (M, n_proj, size, device)
    if key in _SMALL_TABLES:
        return _SMALL_TABLES[key]
    tokens = torch.arange(n_proj * M, dtype=torch.int32, device=device)
    proj = torch.div(tokens, M, rounding_mode="floor")
    ones = torch.ones((n_proj * M, 1), dtype=torch.float32, device=device)
    jobs = None
    if M > 1:
        starts = torch.arange(0, M, size, dtype=torch.int32, device=device)
        jobs = Jobs(starts, (M - starts).clamp(max=size).to(torch.int32), size)
    tables = (tokens, proj, ones, jobs)
    if M <= SMALL_JOB_ROWS and not _capturing(device):
        _SMALL_TABLES[key] = tables
    return tables


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()
