"""EXL3 matrix-vector products that decode trellis codes in registers (no dequantized weight in memory).

`y = (((x ∘ suh) P) Q) P ∘ svh` runs as three launches: `rotate_in` (activations only: scale by suh, 128-block
Hadamard), `exl3_rows` (the decode-and-multiply core over the packed trellis, split along K into fp32
partial sums) and `rotate_out` (sum the partials, Hadamard, svh, optional router weights). The core works on
*jobs*: a run of rows that share one weight (one expert), so each weight is decoded once per job however
many rows use it. Jobs of one or two rows at K2 take the GEMV core (fp16 activations, fp16x2 CUDA-core
products, nothing through shared memory); other jobs the tensor-core core (fp16 hi/lo activation planes, mma.sync).
Weight stacks are [P, V, in/16, out/16, 16K]: P projections (gate and up side by side) of
V experts; a single linear is P = V = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from glmquant.exl3 import EXL3Tensor
from glmquant.runtime.kernels import interpreted
from glmquant.runtime.kernels.exl3_decode import (
    HASH_FLIP,
    HASH_MASK,
    codebook_id,
    k2_window_hashes,
    load_window,
    window_values,
)

JOB_ROWS = tl.constexpr(16)  # rows of one tensor-core tile: the most rows a job can hold


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of the core: tile rows (ti) and 16-column tiles (tj) per step, tile rows per K split, warps.

    ti = 4, tj = 8 decodes a 64 x 128 weight block per step (64 codes per thread at 4 warps) into a
    16 x 128 fp32 accumulator in the tensor-core core: 118-119 registers (sm_90, sm_121) and 20 KB shared memory
    (decoded block + pipelined activations), so 4 programs fit per SM on a GB10 (64K registers, ~100 KB shared
    memory). The GEMV core takes the same blocks with 64 registers (MCG, sm_90; bench/results/kernels_compile.json)
    and no shared memory in its loop; one-row GEMV jobs run ti = 8, tj = 4 (`fused_moe.ONE_ROW_GEMV`).
    K is cut into splits of gcd(k_tiles, split_tiles) tile rows: the same on every GPU (deterministic
    sums), and at most a few trip counts to compile. 1024 rows per split gives a 4096 x 2048 expert
    64 programs per route at tj = 8, 128 at tj = 4.
    """

    ti: int = 4
    tj: int = 8
    split_tiles: int = 64
    num_warps: int = 4

    def tiles_per_split(self, k_tiles: int) -> int:
        """16-row tiles per K split; every split is the same whole number of ti-row steps."""
        tiles = math.gcd(k_tiles, self.split_tiles)
        if tiles % self.ti:
            raise ValueError(
                f"{k_tiles} tile rows do not split into steps of {self.ti} (split_tiles {self.split_tiles})"
            )
        return tiles

    def splits(self, k_tiles: int) -> int:
        return k_tiles // self.tiles_per_split(k_tiles)


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
def store_activations(out_ptr, row, cols, Kp, v, live, GEMV: tl.constexpr):
    """Store rotated activations v [ROWS, 128] (row: [ROWS, 1] int64) in a core's input format.

    GEMV: fp16 twice per int32 [R, Kp] (an fp16x2 operand); else fp16 hi/lo planes [R, 2, Kp] for the tensor-core core.
    """
    if GEMV:
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
    GEMV: tl.constexpr,
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
    store_activations(out_ptr, p * R + rows.to(tl.int64), cols, Kp, had128_rows(x * su), live, GEMV)


@triton.jit
def job_program(job_start_ptr, job_rows_ptr, NT, TJ: tl.constexpr, ONE_ROW: tl.constexpr):
    """What a core program works on: its job's first row and row count (program i is row i for one-row jobs
    without tables), projection p of n_proj, 16*TJ-column block nb and K split."""
    if ONE_ROW:
        row0 = tl.program_id(0)
        rows = 1
    else:
        row0 = tl.load(job_start_ptr + tl.program_id(0))
        rows = tl.load(job_rows_ptr + tl.program_id(0))
    n_blocks = NT // TJ
    p = tl.program_id(1) // n_blocks
    return row0, rows, p, tl.num_programs(1) // n_blocks, tl.program_id(1) % n_blocks, tl.program_id(2)


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
    ONE_ROW_JOBS: tl.constexpr,
    TI: tl.constexpr,
    TJ: tl.constexpr,
):
    """part[s, p, job rows, cols] = x[p, job rows, k-split s] @ Q[p, expert] for one 16*TJ-column block.

    Each step decodes a [TI*16, TJ*16] weight block in registers as dims [ti, tj, e1, e0, e2, g, l4]: the
    stream window depends on (ti, tj, g, l4) only, so it is built once per block of positions (and loaded two
    steps ahead, hiding the memory latency of these 2-byte gathers that cp.async pipelining cannot take); the
    block is then permuted to (k, n) order and fed to two fp16 tensor-core products (activation hi and lo).
    """
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, ONE_ROW_JOBS)
    if rows > 0:
        ti_ = tl.arange(0, TI)[:, None, None, None, None, None, None]
        tj_ = tl.arange(0, TJ)[None, :, None, None, None, None, None]
        e1 = tl.arange(0, 2)[None, None, :, None, None, None, None]
        e0 = tl.arange(0, 2)[None, None, None, :, None, None, None]
        e2 = tl.arange(0, 2)[None, None, None, None, :, None, None]
        g = tl.arange(0, 8)[None, None, None, None, None, :, None]
        l4 = tl.arange(0, 4)[None, None, None, None, None, None, :]
        expert = tl.load(expert_ptr + row0).to(tl.int64)
        tiles = trellis_ptr + (p * V + expert) * (KT * NT * 16 * K) + (nb * TJ + tj_) * (16 * K)
        m = tl.arange(0, JOB_ROWS)[:, None]
        xrow = x_ptr + (p * R + row0 + m).to(tl.int64) * (2 * KT * 16) + tl.arange(0, TI * 16)[None, :]
        acc = tl.zeros([JOB_ROWS, TJ * 16], dtype=tl.float32)
        first = split * STEP_TILES
        rows_step = NT * 16 * K  # int16 words per row of tiles
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


GEMV_BITS = (2,)  # K of the GEMV core: block windows of 8 positions end on 16-bit boundaries of the words
GEMV_JOB_ROWS = 2  # the most rows of a job the GEMV core takes (one decode, an FMA per row)
GEMV_ERROR_BOUND = 2e-3  # relative error of GEMV-core results: fp16 activations, each step's products summed in fp16
PACKED_CODEBOOKS = (
    codebook_id("3inst"),
    codebook_id("mcg"),
)  # whose hash halves the GEMV core multiplies as fp16 pairs


@triton.jit
def half2_fma(a, b, c):
    """a * b + c on uint32 pairs of fp16 halves (fma.rn.f16x2): two products in one instruction."""
    return tl.inline_asm_elementwise(
        "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def half2_sum(a):
    """fp32 of the fp16 sum of a uint32 pair's halves.

    For one product by 1.0 this is the codec's rounding of lo + hi.
    """
    return tl.inline_asm_elementwise(
        "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $1;\nadd.rn.f16 l, l, h;\ncvt.f32.f16 $0, l;\n}",
        "=f,r",
        [a],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def low_half(x):
    """fp32 of the fp16 in the low half of uint32 x."""
    return (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _exl3_gemv_kernel(
    x_ptr,
    words_ptr,
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
    JOB_ROWS_MAX: tl.constexpr,
    TI: tl.constexpr,
    TJ: tl.constexpr,
    PACKED: tl.constexpr,
):
    """part[s, p, job rows, cols] = x[p, job rows, k-split s] @ Q[p, expert] at K = 2 for jobs of 1 or 2 rows.

    Without a tensor core or shared memory: every tensor is [8 g, 2 h, TI, TJ], one element per uint32 trellis
    word (16 per tile; word 2 g + h holds blocks 4 g + 2 h + j, j = 0, 1, of 8 positions = rows 4 h + 2 j + e0 + 8 e1,
    columns g + 8 e2). Each element decodes its 16 weights once, multiplies them by the activations of each row of
    the job and keeps two column sums per row; tile rows and the two words of a column are summed once at the end.
    Activations are fp16, twice per uint32 (`activation_buffer`). PACKED (GPU, 3INST/MCG): a weight stays the
    pair of fp16 halves its hash makes, one fp16x2 FMA multiplies both by the activation pair, and each step's
    8 products per column are summed in fp16, halves added in fp16, then added to fp32 (unit-vector activations
    thus return the codec's weights bit for bit; those fp16 sums, at most 32 |x|, overflow once |activation|
    passes ~2,000); otherwise (the interpreter, MUL1) weights are decoded to fp16 and multiplied
    in fp32.
    Word indices are scrambled so that no load is vectorized and every load shares one layout (no conversions in
    the loop): Triton then puts a tile's words on lanes and the TJ tiles in registers, so a thread loads 8
    activations per row and 8 words per step. JOB_ROWS_MAX = 1 without job tables: program i is row i.
    """
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, JOB_ROWS_MAX == 1)
    if rows > 0:
        g = (3 * tl.arange(0, 8)[:, None, None, None]) % 8
        h = 1 - tl.arange(0, 2)[None, :, None, None]
        ti = tl.arange(0, TI)[None, None, :, None]
        tj = tl.arange(0, TJ)[None, None, None, :]
        word = 2 * g + h
        expert = tl.load(expert_ptr + row0).to(tl.int64)
        tiles = words_ptr + (p * V + expert) * (KT * NT * 16) + (nb * TJ + tj) * 16
        row_words = NT * 16
        xrow = x_ptr + (p * R + row0).to(tl.int64) * (KT * 16) + 4 * h + 0 * tj + 0 * g
        second = (
            rows > 1
        )  # the job has a second row (JOB_ROWS_MAX = 2); without one, row0's sums are recomputed, unstored
        xrow1 = xrow + second.to(tl.int64) * (KT * 16)
        first = split * STEP_TILES
        row0_g = tl.zeros([8, 2, TI, TJ], dtype=tl.float32)  # fp32 sums of row 0 (row 1) at columns g, g + 8
        row0_g8 = tl.zeros([8, 2, TI, TJ], dtype=tl.float32)
        row1_g = tl.zeros([8, 2, TI, TJ], dtype=tl.float32)
        row1_g8 = tl.zeros([8, 2, TI, TJ], dtype=tl.float32)
        if JOB_ROWS_MAX == 1:
            step_words = tiles + (first + ti) * row_words
            next_cur = tl.load(step_words + word)
            next_prev = tl.load(step_words + (word + 15) % 16)
        for step in range(0, STEP_TILES, TI):  # constexpr trip count: one K split
            tile_row = first + step + ti
            if JOB_ROWS_MAX == 1:
                # the next step's words load while this step computes (the last step reloads the first: in cache,
                # unused); two-row jobs load in step instead: 15 registers fewer for their extra row
                cur = next_cur.to(tl.uint32, bitcast=True)
                prev = next_prev.to(tl.uint32, bitcast=True)
                step_words = tiles + (first + (step + TI) % STEP_TILES + ti) * row_words
                next_cur = tl.load(step_words + word)
                next_prev = tl.load(step_words + (word + 15) % 16)
            else:
                cur = tl.load(tiles + tile_row * row_words + word).to(tl.uint32, bitcast=True)
                prev = tl.load(tiles + tile_row * row_words + (word + 15) % 16).to(tl.uint32, bitcast=True)
            xs = xrow + 16 * tile_row
            if JOB_ROWS_MAX == 2:
                xs1 = xrow1 + 16 * tile_row
            if PACKED:  # this step's sums as fp16 pairs
                step0_g = tl.zeros([8, 2, TI, TJ], dtype=tl.uint32)
                step0_g8 = tl.zeros([8, 2, TI, TJ], dtype=tl.uint32)
                if JOB_ROWS_MAX == 2:
                    step1_g = tl.zeros([8, 2, TI, TJ], dtype=tl.uint32)
                    step1_g8 = tl.zeros([8, 2, TI, TJ], dtype=tl.uint32)
            for j in tl.static_range(2):
                win = ((prev << 16) | (cur >> 16)) if j == 0 else cur
                if PACKED:
                    pairs = k2_window_hashes(win, CB, hash_mask, hash_flip)  # positions e01 (column g), 4 + e01 (g + 8)
                for e01 in tl.static_range(4):  # rows 4 h + 2 j + e0 + 8 e1 of the tile, e01 = 2 e1 + e0
                    e1, e0 = e01 // 2, e01 % 2
                    xv = tl.load(xs + 2 * j + e0 + 8 * e1).to(tl.uint32, bitcast=True)
                    if JOB_ROWS_MAX == 2:
                        xv1 = tl.load(xs1 + 2 * j + e0 + 8 * e1).to(tl.uint32, bitcast=True)
                    if PACKED:
                        step0_g = half2_fma(pairs[e01], xv, step0_g)
                        step0_g8 = half2_fma(pairs[4 + e01], xv, step0_g8)
                        if JOB_ROWS_MAX == 2:
                            step1_g = half2_fma(pairs[e01], xv1, step1_g)
                            step1_g8 = half2_fma(pairs[4 + e01], xv1, step1_g8)
                    else:
                        w_g = window_values(win, 0, e01, K, CB, hash_mask, hash_flip).to(tl.float32)  # position e01
                        w_g8 = window_values(win, 1, e01, K, CB, hash_mask, hash_flip).to(tl.float32)  # 4 + e01
                        row0_g += w_g * low_half(xv)
                        row0_g8 += w_g8 * low_half(xv)
                        if JOB_ROWS_MAX == 2:
                            row1_g += w_g * low_half(xv1)
                            row1_g8 += w_g8 * low_half(xv1)
            if PACKED:
                row0_g += half2_sum(step0_g)
                row0_g8 += half2_sum(step0_g8)
                if JOB_ROWS_MAX == 2:
                    row1_g += half2_sum(step1_g)
                    row1_g8 += half2_sum(step1_g8)
        cols = nb * TJ * 16 + tl.arange(0, TJ)[None, :] * 16 + (3 * tl.arange(0, 8)[:, None]) % 8
        dst = part_ptr + ((split * n_proj + p) * R + row0).to(tl.int64) * (NT * 16) + cols
        tl.store(dst, tl.sum(tl.sum(row0_g, axis=2), axis=1))
        tl.store(dst + 8, tl.sum(tl.sum(row0_g8, axis=2), axis=1))
        if JOB_ROWS_MAX == 2:
            keep = cols * 0 + rows > 1  # `second` in the stored shape, built by a comparison (Triton 3.9's interpreter
            # rejects scalar masks and turns a broadcast bool & into int32)
            tl.store(dst + NT * 16, tl.sum(tl.sum(row1_g, axis=2), axis=1), mask=keep)
            tl.store(dst + NT * 16 + 8, tl.sum(tl.sum(row1_g8, axis=2), axis=1), mask=keep)


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
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out[t, blk] = sum_j w[t, j] * had(sum_s part[s, pos[t, j], blk]) ∘ svh[expert[pos[t, j]], blk]."""
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
    tl.store(out_ptr + t * out_stride + out_cols, y, mask=out_cols < n_cols)


@dataclass(frozen=True)
class WeightStack:
    """EXL3 weights of P projections x V experts with one shape, bit width and codebook, on one device."""

    trellis: torch.Tensor  # int16 [P, V, in_pad/16, out_pad/16, 16K]
    suh: torch.Tensor  # float16 [P, V, in_pad]
    svh: torch.Tensor  # float16 [P, V, out_pad]
    codebook: int  # kernel codebook id
    in_features: int
    out_features: int

    @property
    def bits(self) -> int:
        return self.trellis.shape[-1] // 16

    @classmethod
    def from_tensors(cls, groups: list[list[EXL3Tensor]], device: torch.device | str) -> WeightStack:
        """Stack groups[p][v]; every tensor must share shape, bits and codebook (ValueError naming the first misfit)."""
        first = groups[0][0]
        for p, group in enumerate(groups):
            for v, t in enumerate(group):
                if (t.trellis.shape, t.codebook, t.in_features, t.out_features) != (
                    first.trellis.shape,
                    first.codebook,
                    first.in_features,
                    first.out_features,
                ):
                    raise ValueError(
                        f"projection {p} expert {v}: {t.codebook.value} {tuple(t.trellis.shape)} does not "
                        f"match {first.codebook.value} {tuple(first.trellis.shape)}"
                    )
        trellis, suh, svh = (
            torch.stack([getattr(t, name) for g in groups for t in g]).to(device) for name in ("trellis", "suh", "svh")
        )
        p, v = len(groups), len(groups[0])
        return cls(
            trellis.view(p, v, *trellis.shape[1:]),
            suh.view(p, v, *suh.shape[1:]),
            svh.view(p, v, *svh.shape[1:]),
            codebook_id(first.codebook),
            first.in_features,
            first.out_features,
        )


@dataclass(frozen=True)
class Jobs:
    """Rows grouped by the weight they share: (first row, row count) per job, every count <= max_rows."""

    starts: torch.Tensor  # int32 [J]
    counts: torch.Tensor  # int32 [J]; 0 for unused entries
    max_rows: int

    def __post_init__(self) -> None:
        if not 2 <= self.max_rows <= JOB_ROWS.value:
            raise ValueError(f"jobs hold 2 to {JOB_ROWS.value} rows (None is one row per job), not {self.max_rows}")


def job_rows(jobs: Jobs | None) -> int:
    """The most rows a job holds (None: one row per job)."""
    return 1 if jobs is None else jobs.max_rows


def uses_gemv(stack: WeightStack, max_rows: int) -> bool:
    """Whether `exl3_rows` runs the GEMV core (K in GEMV_BITS, jobs of <= GEMV_JOB_ROWS rows), which takes fp16
    activations; otherwise the tensor-core core (jobs of <= JOB_ROWS rows)."""
    return stack.bits in GEMV_BITS and max_rows <= GEMV_JOB_ROWS


def packed_gemv(xr: torch.Tensor, stack: WeightStack) -> bool:
    """Whether the GEMV core multiplies fp16 pairs in inline PTX: compiled for an NVIDIA GPU, 3INST or MCG."""
    return xr.is_cuda and torch.version.hip is None and not interpreted() and stack.codebook in PACKED_CODEBOOKS


def activation_buffer(P: int, R: int, kp: int, gemv: bool, device: torch.device) -> torch.Tensor:
    """Uninitialized core input: int32 [P, R, kp] holding each fp16 activation twice for the GEMV core, fp16
    hi/lo planes [P, R, 2, kp] otherwise."""
    if gemv:
        return torch.empty((P, R, kp), dtype=torch.int32, device=device)
    return torch.empty((P, R, 2, kp), dtype=torch.float16, device=device)


def fp16_pairs(x: torch.Tensor) -> torch.Tensor:
    """The GEMV core's activation format from a float tensor: int32 holding fp16(x) in both halves."""
    half = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return half | (half << 16)


def rotate_in(
    x: torch.Tensor, src: torch.Tensor, stack: WeightStack, scale_row: torch.Tensor, gemv: bool
) -> torch.Tensor:
    """had(x[src[i]] ∘ suh[p, scale_row[i]]) for every projection p, as `activation_buffer` lays it out."""
    P, V, kp = stack.suh.shape
    R = src.numel()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = activation_buffer(P, R, kp, gemv, x.device)
    _rotate_in_kernel[(triton.cdiv(R, 16), P, kp // 128)](
        x, src, stack.suh, scale_row, out, R, V, x.shape[1], x.stride(0), kp, ROWS=16, GEMV=gemv
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
    if (xr.dtype, xr.dim()) != ((torch.int32, 3) if gemv else (torch.float16, 4)):
        raise ValueError(
            f"activations {xr.dtype} {tuple(xr.shape)} are not the {'GEMV' if gemv else 'tensor-core'} "
            f"core's format (activation_buffer)"
        )
    if nt % cfg.tj:
        raise ValueError(f"{nt} column tiles do not split into blocks of tj = {cfg.tj}")
    part = torch.empty((cfg.splits(kt), P, R, nt * 16), dtype=torch.float32, device=xr.device)
    starts, counts = (jobs.starts, jobs.counts) if jobs is not None else (experts, experts)  # unread for one-row jobs
    grid = (R if jobs is None else starts.numel(), P * (nt // cfg.tj), cfg.splits(kt))
    if gemv:
        _exl3_gemv_kernel[grid](
            xr,
            stack.trellis.view(torch.int32),
            experts,
            starts,
            counts,
            part,
            R,
            V,
            kt,
            nt,
            HASH_MASK,
            HASH_FLIP,
            STEP_TILES=cfg.tiles_per_split(kt),
            K=stack.bits,
            CB=stack.codebook,
            JOB_ROWS_MAX=job_rows(jobs),
            TI=cfg.ti,
            TJ=cfg.tj,
            PACKED=packed_gemv(xr, stack),
            num_warps=cfg.num_warps,
        )
        return part
    _exl3_rows_kernel[grid](
        xr,
        stack.trellis,
        experts,
        starts,
        counts,
        part,
        R,
        V,
        kt,
        nt,
        HASH_MASK,
        HASH_FLIP,
        STEP_TILES=cfg.tiles_per_split(kt),
        K=stack.bits,
        CB=stack.codebook,
        ONE_ROW_JOBS=jobs is None,
        TI=cfg.ti,
        TJ=cfg.tj,
        num_warps=cfg.num_warps,
    )
    return part


def rotate_out(
    part: torch.Tensor,
    pos: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    stack: WeightStack,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill out [T, out_features] with sum_j weights[t, j] * (had(sum_s part[s, 0, pos[t, j]]) ∘ svh[expert])."""
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
        SPLITS=splits,
        ROWS=max(16, triton.next_power_of_2(n)),
    )
    return out


def exl3_linear(
    x: torch.Tensor, tensor: EXL3Tensor | WeightStack, cfg: GemmConfig | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ W.T for one EXL3 linear.

    x is [M, in_features] of any float dtype; y is [M, out_features] in x's dtype, or out's when given.
    """
    stack = tensor if isinstance(tensor, WeightStack) else WeightStack.from_tensors([[tensor]], x.device)
    M = x.shape[0]
    cfg = cfg or GemmConfig()
    rows = torch.arange(M, dtype=torch.int32, device=x.device)
    zero = torch.zeros(M, dtype=torch.int32, device=x.device)
    starts = torch.arange(0, M, JOB_ROWS.value, dtype=torch.int32, device=x.device)
    jobs = Jobs(starts, (M - starts).clamp(max=JOB_ROWS.value).to(torch.int32), JOB_ROWS.value) if M > 1 else None
    xr = rotate_in(x, rows, stack, zero, uses_gemv(stack, job_rows(jobs)))
    part = exl3_rows(xr, stack, zero, jobs, cfg)
    ones = torch.ones((M, 1), dtype=torch.float32, device=x.device)
    out = torch.empty((M, stack.out_features), dtype=x.dtype, device=x.device) if out is None else out
    return rotate_out(part, rows, ones, zero, stack, out)
