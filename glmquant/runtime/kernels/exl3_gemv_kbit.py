"""The small-job core at any K: EXL3 products for jobs of 1 to 4 activation rows on CUDA cores, decoding in
registers.

A batch-1 product at K != 2 (the speed tier's K4 retained linears, K3/K4 expert tiers) and the 2-4 rows of an MTP
verify step would otherwise take the tensor-core core, whose 16-row tile is mostly empty for so few rows and which
permutes every decoded block through shared memory into (k, n) order for `tl.dot`. Here each decoded weight is
multiplied where it is decoded by the activation of each row of the job: products accumulate in fp32 registers in
the decode layout across the K split (one accumulator block per row), and the rows of the split are summed once at
the end. Activations are the tensor-core core's fp16 hi/lo planes (`activation_buffer`), added in fp32:
fp32-level results, like that core's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glmquant.runtime.kernels.exl3_decode import load_window, window_values
from glmquant.runtime.kernels.exl3_jobs import GemmConfig, job_program

# 4 x 4 tiles per step: a 4,096-weight block, 32 fp32 accumulators per thread and row at 4 warps (the default
# 4 x 8 would double them); not yet tuned on a GPU
ONE_ROW_KBIT = GemmConfig(ti=4, tj=4)
SMALL_JOB_ROWS = 4  # the most rows of a job this core takes (an MTP verify of 3 drafts + 1); 128 accumulators


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
):
    """part[s, p, row, cols] = x[p, row, k-split s] @ Q[p, expert[row]] for one 16*TJ-column block and the rows of
    one job (ROWS = 1: program i is row i, no job tables; else up to ROWS rows from the tables).

    Weights are decoded as the tensor-core core decodes them, dims [ti, tj, e1, e0, e2, g, l4] (tile row, tile
    column, ring fields: row 2 l4 + e0 + 8 e1, column g + 8 e2 of the tile), windows loaded one step ahead; the
    accumulator has the job's rows in front.
    """
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, ROWS == 1)
    r_ = tl.arange(0, ROWS)[:, None, None, None, None, None, None, None]
    ti_ = tl.arange(0, TI)[None, :, None, None, None, None, None, None]
    tj_ = tl.arange(0, TJ)[None, None, :, None, None, None, None, None]
    e1 = tl.arange(0, 2)[None, None, None, :, None, None, None, None]
    e0 = tl.arange(0, 2)[None, None, None, None, :, None, None, None]
    e2 = tl.arange(0, 2)[None, None, None, None, None, :, None, None]
    g = tl.arange(0, 8)[None, None, None, None, None, None, :, None]
    l4 = tl.arange(0, 4)[None, None, None, None, None, None, None, :]
    live = r_ < rows
    expert = tl.load(expert_ptr + row0).to(tl.int64)
    tiles = trellis_ptr + (p * V + expert) * (KT * NT * 16 * K) + (nb * TJ + tj_) * (16 * K)
    rows_step = NT * 16 * K  # int16 words per row of tiles
    # the activation of each decoded weight's row: hi and lo planes of the job's rows of projection p
    xrow = x_ptr + (p * R + row0 + r_).to(tl.int64) * (2 * KT * 16) + 16 * ti_ + 2 * l4 + e0 + 8 * e1
    first = split * STEP_TILES
    acc = tl.zeros([ROWS, TI, TJ, 2, 2, 2, 8, 4], dtype=tl.float32)
    win = load_window(tiles + (first + ti_) * rows_step, g, l4, e2, 2 * e1 + e0, K)
    for step in range(0, STEP_TILES, TI):  # constexpr trip count: one K split
        # the next step's windows load while this step decodes (the last step reloads the first: unused)
        nxt = load_window(tiles + (first + (step + TI) % STEP_TILES + ti_) * rows_step, g, l4, e2, 2 * e1 + e0, K)
        q = window_values(win, e2, 2 * e1 + e0, K, CB, hash_mask, hash_flip).to(tl.float32)
        xs = xrow + 16 * (first + step)
        x = tl.load(xs, mask=live, other=0.0).to(tl.float32) + tl.load(xs + KT * 16, mask=live, other=0.0).to(
            tl.float32
        )
        acc += q * x
        win = nxt
    # sum the rows of the split: ti, e1, e0, l4 -> [rows, TJ, e2, g]
    col = tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=7), axis=4), axis=3), axis=1)
    cols = nb * TJ * 16 + tl.arange(0, TJ)[None, :, None, None] * 16 + tl.arange(0, 2)[None, None, :, None] * 8
    cols += tl.arange(0, 8)[None, None, None, :]
    r_out = tl.arange(0, ROWS)[:, None, None, None]
    dst = part_ptr + ((split * n_proj + p) * R + row0 + r_out).to(tl.int64) * (NT * 16)
    tl.store(dst + cols, col, mask=r_out < rows)
