"""The small-job core at any K: EXL3 products for jobs of 1 to 4 activation rows on CUDA cores, decoding in
registers.

A batch-1 product at a K the GEMV core does not take (K3 expert tiers, retained linears at K3 or K5 and up) and the
2-4 rows of an MTP verify step (3-4 at K2 and K4, whose 1-2 rows take the GEMV core) would otherwise take the
tensor-core core, whose 16-row tile is mostly empty for so few rows and which
permutes every decoded block through shared memory into (k, n) order for `tl.dot`. Here each decoded weight is
multiplied where it is decoded by the activation of each row of the job: products accumulate in registers in
the decode layout across the K split (one accumulator per row), and the rows of the split are summed once at
the end. Jobs of one or two rows take fp16 activations twice per int32 (`takes_fp16_pairs`) and, on a GPU at
3INST/MCG, the GEMV core's arithmetic: the hash's two fp16 halves times the activation pair in one fp16x2 FMA,
`FLUSH` steps summed in fp16, then fp32 (`GEMV_ERROR_BOUND`); no add of the halves, no fp16 -> fp32 conversion per
weight. Those fp16 sums reach 16 |x| (8 products of halves under 2), so they overflow once |activation| passes
~4,000, as the GEMV core's at K4 do (fp32 planes overflowed only near fp16's 65,504). Jobs of 3-4 rows take the
tensor-core core's fp16 hi/lo planes, added in fp32: fp32-level results. A verify's rows (two rows, or 3-4) thus
sum in other orders and precisions than a one-row decode's at K3/K5/K6: equal within `GEMV_ERROR_BOUND`, not bit
for bit (K4's are, `linear_config`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glmquant.runtime.kernels.exl3_decode import load_window, ring_fields, window_pairs, window_values
from glmquant.runtime.kernels.exl3_gemv import half2_fma, half2_sum, low_half
from glmquant.runtime.kernels.exl3_jobs import GemmConfig, job_program

# Steps per job size. One and two rows (fp16 pairs, fp16x2 products): 1 x 1 tiles at 1 warp and 2 x 4 at 2 warps,
# the fastest by time summed over the five retained linear shapes of GLM-5.3-Flash (lm_head among them) of the 12
# swept at K3 on an H100 (ti 1-2, tj 1-4, 1-2 warps): one row 346.7 us against 462.0 for the fp32 path at its
# 1 x 4 steps (1.33x; lm_head 1.43x, KDA's in_proj 1.29x, shared MLPs' gate/up 0.78x), two rows 481.7 against 536.3
# (1.11x) (bench/results/exl3_linear_sweep_k3_pairs_h100_67ff275.json, exl3_linear_k3_planes_h100_67ff275.json,
# scripts/bench_exl3_linear.py). K5 and K6 take the same steps, unswept. Three and four rows (hi/lo planes, fp32):
# 2 x 1 at 1 warp, of the 18 shapes swept at K3 and K5 before (exl3_linear_sweep_k{3,5}_h100_3860c9b.json).
# The fused MoE's one-token K3 tiers take ONE_ROW_KBIT too, untimed at their own shapes.
ONE_ROW_KBIT = GemmConfig(ti=1, tj=1, num_warps=1)
TWO_ROW_KBIT = GemmConfig(ti=2, tj=4, num_warps=2)
SMALL_JOB_KBIT = GemmConfig(ti=2, tj=1, num_warps=1)
SMALL_JOB_ROWS = 4  # the most rows of a job this core takes (an MTP verify of 3 drafts + 1)
# packed steps summed in fp16 before fp32: at most 8 products per sum (two halves), as in the GEMV core at K4
FLUSH = tl.constexpr(4)


@triton.jit
def _row_activation(xs, live, KT, PAIRS: tl.constexpr):
    """One row's activations at `xs` in fp32, 0 where the row is past its job's end: the fp16 of a pair (PAIRS), or
    the hi + lo planes."""
    if PAIRS:
        return low_half(tl.load(xs, mask=live, other=0).to(tl.uint32, bitcast=True))
    return tl.load(xs, mask=live, other=0.0).to(tl.float32) + tl.load(xs + KT * 16, mask=live, other=0.0).to(tl.float32)


@triton.jit
def _store_row(dst, acc, cols, live):
    """Sum one row's accumulator over the split's rows (ti, e1, e0, l4 -> [TJ, e2, g]) and store it."""
    tl.store(dst + cols, tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=6), axis=3), axis=2), axis=0), mask=live)


@triton.jit
def _exl3_row_kernel(
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
    ROWS: tl.constexpr,
    PAIRS: tl.constexpr,
    PACKED: tl.constexpr,
):
    """part[s, p, row, cols] = x[p, row, k-split s] @ Q[p, expert[row]] for one 16*TJ-column block and the rows of
    one job (ROWS = 1: program i is row i, no job tables; else up to ROWS <= 4 rows from the tables).

    Weights are decoded as the tensor-core core decodes them, dims [ti, tj, e1, e0, e2, g, l4] (tile row, tile
    column, ring fields: row 2 l4 + e0 + 8 e1, column g + 8 e2 of the tile), windows loaded one step ahead. Each
    row has its own accumulator in that same layout (a leading row dim would make Triton move every decoded block
    between layouts); the unused ones compile away. Activations: fp16 hi/lo planes, or (PAIRS, ROWS <= 2) fp16
    twice per int32, which PACKED (GPU, 3INST/MCG) multiplies by the hash's fp16 halves in fp16x2 FMAs, summing
    `FLUSH` steps in fp16 before fp32 (the GEMV core's arithmetic at any K); unpacked, decoded weights times fp16
    activations in fp32.
    """
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, ROWS == 1)
    if rows > 0:  # a job of no rows: its first row is another job's, which alone writes it
        ti_, tj_, e1, e0, e2, g, l4 = ring_fields(TI, TJ)
        e01 = 2 * e1 + e0
        expert = tl.load(expert_ptr + row0).to(tl.int64)
        tiles = trellis_ptr + (p * V + expert) * (KT * NT * 8 * K) + (nb * TJ + tj_) * (8 * K)
        rows_step = NT * 8 * K  # int32 words per row of tiles
        # the activation of each decoded weight's row: the job's first row of projection p (both planes' first)
        x_row_step = (1 if PAIRS else 2) * KT * 16
        xrow = x_ptr + (p * R + row0).to(tl.int64) * x_row_step + 16 * ti_ + 2 * l4 + e0 + 8 * e1
        lanes = l4 * 0  # a row's liveness in the activations' shape (the interpreter rejects scalar masks)
        first = split * STEP_TILES
        acc0 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.float32)
        acc1 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.float32)
        acc2 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.float32)
        acc3 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.float32)
        win = load_window(tiles + (first + ti_) * rows_step, g, l4, e2, e01, K)
        if PACKED:
            tl.static_assert(PAIRS and ROWS <= 2, "fp16x2 products take fp16-pair activations, one or two rows")
            # steps per fp16 sum: FLUSH, or fewer where a K split is not a whole number of FLUSH steps
            GROUP: tl.constexpr = FLUSH if (STEP_TILES // TI) % FLUSH == 0 else 2 if (STEP_TILES // TI) % 2 == 0 else 1
            for group in range(0, STEP_TILES, GROUP * TI):  # constexpr trip count: one K split
                sum0 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.uint32)  # fp16 pairs: GROUP steps' products
                sum1 = tl.zeros([TI, TJ, 2, 2, 2, 8, 4], dtype=tl.uint32)
                for sub in tl.static_range(GROUP):
                    step = group + sub * TI
                    # the next step's windows load while this step decodes (the last step reloads the first: unused)
                    nxt = load_window(tiles + (first + (step + TI) % STEP_TILES + ti_) * rows_step, g, l4, e2, e01, K)
                    pairs = window_pairs(win, e2, e01, K, CB, hash_mask, hash_flip)
                    xs = xrow + 16 * (first + step)
                    sum0 = half2_fma(pairs, tl.load(xs).to(tl.uint32, bitcast=True), sum0)
                    if ROWS > 1:
                        x1 = tl.load(xs + x_row_step, mask=lanes + 1 < rows, other=0).to(tl.uint32, bitcast=True)
                        sum1 = half2_fma(pairs, x1, sum1)
                    win = nxt
                acc0 += half2_sum(sum0)
                if ROWS > 1:
                    acc1 += half2_sum(sum1)
        else:
            for step in range(0, STEP_TILES, TI):  # constexpr trip count: one K split
                nxt = load_window(tiles + (first + (step + TI) % STEP_TILES + ti_) * rows_step, g, l4, e2, e01, K)
                q = window_values(win, e2, e01, K, CB, hash_mask, hash_flip).to(tl.float32)
                xs = xrow + 16 * (first + step)
                acc0 += q * _row_activation(xs, lanes == 0, KT, PAIRS)
                if ROWS > 1:
                    acc1 += q * _row_activation(xs + x_row_step, lanes + 1 < rows, KT, PAIRS)
                if ROWS > 2:
                    acc2 += q * _row_activation(xs + 2 * x_row_step, lanes + 2 < rows, KT, PAIRS)
                    acc3 += q * _row_activation(xs + 3 * x_row_step, lanes + 3 < rows, KT, PAIRS)
                win = nxt
        cols = nb * TJ * 16 + tl.arange(0, TJ)[:, None, None] * 16 + tl.arange(0, 2)[None, :, None] * 8
        cols += tl.arange(0, 8)[None, None, :]
        dst = part_ptr + ((split * n_proj + p) * R + row0).to(tl.int64) * (NT * 16)
        out_lanes = cols * 0
        _store_row(dst, acc0, cols, out_lanes == 0)
        if ROWS > 1:
            _store_row(dst + NT * 16, acc1, cols, out_lanes + 1 < rows)
        if ROWS > 2:
            _store_row(dst + 2 * NT * 16, acc2, cols, out_lanes + 2 < rows)
            _store_row(dst + 3 * NT * 16, acc3, cols, out_lanes + 3 < rows)
