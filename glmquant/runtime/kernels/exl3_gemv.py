"""The GEMV core: EXL3 products for jobs of one or two rows at K2 and K4, on CUDA cores (fp16x2 FMAs).

Decode batches rarely put two routes on one expert, and a batch-1 linear (the speed tier's K4 retained linears) is
one row, so a job is one row (or two, reusing the decoded weights for one more FMA each). With so few rows a
tensor-core tile would be mostly empty: this core multiplies on the CUDA cores, keeps every decoded weight in
registers (nothing through shared memory) and takes fp16 activations twice per int32 (`fp16_pairs`, or
`exl3_gemm.rotate_in`), at the cost of fp16 products summed in fp16 per step (`GEMV_ERROR_BOUND`).
`exl3_gemm.exl3_rows` runs it when `uses_gemv` says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from glmquant.runtime.kernels.availability import interpreted
from glmquant.runtime.kernels.exl3_decode import codebook_id, window_hashes, window_values
from glmquant.runtime.kernels.exl3_jobs import WeightStack, job_program

GEMV_BITS = (2, 4)  # K of the GEMV core: a block window (8 positions at K2, 4 at K4) ends on a 16-bit boundary
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
    """part[s, p, job rows, cols] = x[p, job rows, k-split s] @ Q[p, expert] at K = 2 or 4 for jobs of 1 or 2 rows.

    Without a tensor core or shared memory: every tensor is [8 g, K w, TI, TJ], one element per uint32 trellis word
    (8 K per tile; word K g + w is stream bits [32 (K g + w), +32)). Its two windows, j = 0 (the funnel of the
    previous word of the tile and this one) and j = 1 (this word), are two blocks of ring positions (`exl3_decode`):
    at K2 blocks 4 g + 2 w + j of 8 positions, rows 4 w + 2 j + e0 + 8 e1, columns g + 8 e2; at K4 blocks
    8 g + 2 w + j of 4 positions, rows 2 w + e0 + 8 e1 (the same for both windows), column g + 8 j. Each element
    decodes its 16 (K2) or 8 (K4) weights once, multiplies them by the activations of each row of the job and keeps
    two column sums per row; tile rows and the words of a column are summed once at the end.
    Activations are fp16, twice per uint32 (`activation_buffer`). PACKED (GPU, 3INST/MCG): a weight stays the
    pair of fp16 halves its hash makes, one fp16x2 FMA multiplies both by the activation pair, and each step's
    8 (K2) or 4 (K4) products per column and word are summed in fp16, halves added in fp16, then added to fp32
    (unit-vector activations thus return the codec's weights bit for bit; those fp16 sums, at most 32 |x| at K2 and
    16 |x| at K4, overflow once |activation| passes ~2,000 and ~4,000); otherwise (the interpreter, MUL1) weights
    are decoded to fp16 and multiplied in fp32.
    Word indices are scrambled so that no load is vectorized and every load shares one layout (no conversions in
    the loop): Triton then puts a tile's words on lanes and the TJ tiles in registers. JOB_ROWS_MAX = 1 without
    job tables: program i is row i.
    """
    tl.static_assert(K == 2 or K == 4, "the GEMV core takes K2 and K4 (GEMV_BITS)")
    row0, rows, p, n_proj, nb, split = job_program(job_start_ptr, job_rows_ptr, NT, TJ, JOB_ROWS_MAX == 1)
    if rows > 0:
        TILE: tl.constexpr = 8 * K  # uint32 words per tile (16 K int16 words)
        G8: tl.constexpr = 4 if K == 2 else 0  # window position of column g + 8's weight e01: e2 = 1 (K2), e01 (K4)
        g = (3 * tl.arange(0, 8)[:, None, None, None]) % 8
        w = K - 1 - tl.arange(0, K)[None, :, None, None]
        ti = tl.arange(0, TI)[None, None, :, None]
        tj = tl.arange(0, TJ)[None, None, None, :]
        word = K * g + w
        prev_word = (word + TILE - 1) % TILE  # the tile's previous word (wrapping: the stream is a ring)
        expert = tl.load(expert_ptr + row0).to(tl.int64)
        tiles = words_ptr + (p * V + expert) * (KT * NT * TILE) + (nb * TJ + tj) * TILE
        row_words = NT * TILE
        # the word's first activation row in a tile: 4 w (K2), 2 w (K4)
        xrow = x_ptr + (p * R + row0).to(tl.int64) * (KT * 16) + (8 // K) * w + 0 * tj + 0 * g
        second = (
            rows > 1
        )  # the job has a second row (JOB_ROWS_MAX = 2); without one, row0's sums are recomputed, unstored
        xrow1 = xrow + second.to(tl.int64) * (KT * 16)
        first = split * STEP_TILES
        row0_g = tl.zeros([8, K, TI, TJ], dtype=tl.float32)  # fp32 sums of row 0 (row 1) at columns g, g + 8
        row0_g8 = tl.zeros([8, K, TI, TJ], dtype=tl.float32)
        row1_g = tl.zeros([8, K, TI, TJ], dtype=tl.float32)
        row1_g8 = tl.zeros([8, K, TI, TJ], dtype=tl.float32)
        if JOB_ROWS_MAX == 1:
            step_words = tiles + (first + ti) * row_words
            next_cur = tl.load(step_words + word)
            next_prev = tl.load(step_words + prev_word)
        for step in range(0, STEP_TILES, TI):  # constexpr trip count: one K split
            tile_row = first + step + ti
            if JOB_ROWS_MAX == 1:
                # the next step's words load while this step computes (the last step reloads the first: in cache,
                # unused); two-row jobs load in step instead, leaving registers for their extra row (docs/kernels.md)
                cur = next_cur.to(tl.uint32, bitcast=True)
                prev = next_prev.to(tl.uint32, bitcast=True)
                step_words = tiles + (first + (step + TI) % STEP_TILES + ti) * row_words
                next_cur = tl.load(step_words + word)
                next_prev = tl.load(step_words + prev_word)
            else:
                cur = tl.load(tiles + tile_row * row_words + word).to(tl.uint32, bitcast=True)
                prev = tl.load(tiles + tile_row * row_words + prev_word).to(tl.uint32, bitcast=True)
            xs = xrow + 16 * tile_row
            if JOB_ROWS_MAX == 2:
                xs1 = xrow1 + 16 * tile_row
            if PACKED:  # this step's sums as fp16 pairs
                step0_g = tl.zeros([8, K, TI, TJ], dtype=tl.uint32)
                step0_g8 = tl.zeros([8, K, TI, TJ], dtype=tl.uint32)
                if JOB_ROWS_MAX == 2:
                    step1_g = tl.zeros([8, K, TI, TJ], dtype=tl.uint32)
                    step1_g8 = tl.zeros([8, K, TI, TJ], dtype=tl.uint32)
            # K2: two passes, window j holding both columns of rows 4 w + 2 j + e0 + 8 e1; K4: one pass, window 0
            # holding column g and window 1 column g + 8 of rows 2 w + e0 + 8 e1
            for j in tl.static_range(4 // K):
                win_g = ((prev << 16) | (cur >> 16)) if j == 0 else cur
                win_g8 = win_g if K == 2 else cur
                if PACKED:
                    pairs_g = window_hashes(win_g, K, CB, hash_mask, hash_flip)
                    pairs_g8 = pairs_g if K == 2 else window_hashes(win_g8, K, CB, hash_mask, hash_flip)
                for e01 in tl.static_range(4):  # e01 = 2 e1 + e0
                    e1, e0 = e01 // 2, e01 % 2
                    xv = tl.load(xs + 2 * j + e0 + 8 * e1).to(tl.uint32, bitcast=True)
                    if JOB_ROWS_MAX == 2:
                        xv1 = tl.load(xs1 + 2 * j + e0 + 8 * e1).to(tl.uint32, bitcast=True)
                    if PACKED:
                        step0_g = half2_fma(pairs_g[e01], xv, step0_g)
                        step0_g8 = half2_fma(pairs_g8[G8 + e01], xv, step0_g8)
                        if JOB_ROWS_MAX == 2:
                            step1_g = half2_fma(pairs_g[e01], xv1, step1_g)
                            step1_g8 = half2_fma(pairs_g8[G8 + e01], xv1, step1_g8)
                    else:  # the weights at ring fields (e2, e01) = (0, e01), (1, e01)
                        w_g = window_values(win_g, 0, e01, K, CB, hash_mask, hash_flip).to(tl.float32)
                        w_g8 = window_values(win_g8, 1, e01, K, CB, hash_mask, hash_flip).to(tl.float32)
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


def uses_gemv(stack: WeightStack, max_rows: int) -> bool:
    """Whether `exl3_rows` runs the GEMV core (K in GEMV_BITS, jobs of <= GEMV_JOB_ROWS rows); otherwise the
    small-job or tensor-core core."""
    return stack.bits in GEMV_BITS and takes_fp16_pairs(max_rows)


def takes_fp16_pairs(max_rows: int) -> bool:
    """Whether jobs of <= max_rows rows take fp16 activations twice per int32 (`activation_buffer`), at any K: jobs
    of one or two rows (the GEMV core at K2 and K4, the small-job core's fp16x2 products at other K); larger jobs take
    fp16 hi/lo planes. Results then carry `GEMV_ERROR_BOUND`."""
    return max_rows <= GEMV_JOB_ROWS


def packed_gemv(xr: torch.Tensor, stack: WeightStack) -> bool:
    """Whether the GEMV core multiplies fp16 pairs in inline PTX: compiled for an NVIDIA GPU, 3INST or MCG."""
    return xr.is_cuda and torch.version.hip is None and not interpreted() and stack.codebook in PACKED_CODEBOOKS


def fp16_pairs(x: torch.Tensor) -> torch.Tensor:
    """The GEMV core's activation format from a float tensor: int32 holding fp16(x) in both halves."""
    half = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return half | (half << 16)
