"""Triton helpers that decode EXL3 trellis codes in registers, bit-exact with `glmquant.exl3.decode_inner`.

A 16x16 tile is a ring of 256 positions t = 32 g + 8 l4 + 4 e2 + 2 e1 + e0 (five bit fields). Position t
holds row r = 2 l4 + e0 + 8 e1 and column c = g + 8 e2 of the tile, and its 16-bit state is the window of
stream bits [(t+1)K - 16, (t+1)K). Kernels index weights by these fields instead of (r, c): then the
positions that share one 32-bit window of the stream (a *block* of B consecutive positions, the largest of
8, 4, 2 with 16 + (B - 1) K <= 32) differ only in the low fields, so the window is loaded and assembled
once per block and each weight costs one shift and one mask before the codebook hash.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glmquant.exl3 import Codebook

CODEBOOK_IDS = {Codebook.THREE_INST: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
MUL1_SCALE = tl.constexpr(0.0067672729492187500)  # fp16 bit pattern 0x1EEE
MUL1_BIAS = tl.constexpr(-10.3828125)  # fp16 bit pattern 0xC931
HASH_MASK = -1879076865  # 0x8FFF8FFF as int32: keeps sign, 2 exponent and 10 mantissa bits of each half
HASH_FLIP = 996162400  # 0x3B603B60: sets the exponent so each half lies in +-[0.125, 2)


def codebook_id(codebook: Codebook | str) -> int:
    """The constexpr a kernel takes for a codebook."""
    return CODEBOOK_IDS[Codebook(codebook)]


@triton.jit
def _chunk(tile_ptr, j, K: tl.constexpr):
    """16-bit stream chunk j (mod 16 K) of a tile: chunk j is int16 word j ^ 1 (uint32 words, MSB first)."""
    word = ((j + 16 * K) % (16 * K)) ^ 1
    return tl.load(tile_ptr + word).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def block_window(tile_ptr, blk, K: tl.constexpr, B: tl.constexpr):
    """uint32 holding stream bits [(blk+1) B K - 32, (blk+1) B K): the states of ring positions blk*B .. blk*B+B-1.

    tile_ptr points at the tile's 16 K int16 words (any shape, broadcast with blk); wraps around the ring.
    """
    end = (blk + 1) * (B * K)
    q = (end - 1) // 16  # chunk holding the last bit
    sh = (16 * (q + 1) - end).to(tl.uint32)  # bits of chunk q after the window
    win = (_chunk(tile_ptr, q - 1, K) << (16 - sh)) | (_chunk(tile_ptr, q, K) >> sh)
    if (B * K) % 16 != 0:  # the window starts inside chunk q - 2
        win = win | ((_chunk(tile_ptr, q - 2, K) << 16) << (16 - sh))
    return win


@triton.jit
def block_state(win, pos, K: tl.constexpr, B: tl.constexpr):
    """16-bit state of position `pos` (0..B-1) inside the block whose window is `win`."""
    return (win >> ((B - 1 - pos) * K).to(tl.uint32)) & 0xFFFF


@triton.jit
def codebook_value(state, CB: tl.constexpr, mask, flip):
    """fp16 value of uint32 states (0..65535): 0 = 3INST, 1 = MCG, 2 = MUL1 (exllamav3's hashes).

    `mask`, `flip` are HASH_MASK, HASH_FLIP passed as run-time kernel arguments: as registers they let the
    compiler fuse `(x & mask) ^ flip` into one 3-input logic op instead of two immediate ones.
    """
    if CB == 2:
        x = state * 0x83DCD12D
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        return ((b.to(tl.float32) + 1024.0) * MUL1_SCALE + MUL1_BIAS).to(tl.float16)
    x = state * 89226354 + 64248484 if CB == 0 else state * 0xCBAC1FED
    y = (x & mask.to(tl.uint32, bitcast=True)) ^ flip.to(tl.uint32, bitcast=True)
    lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo + hi  # exact in fp32 for these exponents, so one fp16 rounding as in the codec


@triton.jit
def load_window(tile_ptr, g, l4, e2, e01, K: tl.constexpr):
    """Stream window of the block holding ring fields (g, l4, e2, e01 = 2 e1 + e0) of the tiles at tile_ptr.

    Uses only the high fields (which ones is fixed by B), so with the low fields as separate tensor dims it
    is loaded and assembled once per block of B weights. Separate from `window_values` so a kernel can
    issue the next step's loads before decoding the current one.
    """
    B: tl.constexpr = 8 if K <= 2 else 4 if K <= 5 else 2
    if B == 8:
        blk = 4 * g + l4
    elif B == 4:
        blk = 8 * g + 2 * l4 + e2
    else:
        blk = 16 * g + 4 * l4 + 2 * e2 + e01 // 2
    return block_window(tile_ptr, blk, K, B)


@triton.jit
def window_values(win, e2, e01, K: tl.constexpr, CB: tl.constexpr, mask, flip):
    """fp16 weights at the low ring fields (e2, e01) of the blocks whose windows are `win`."""
    B: tl.constexpr = 8 if K <= 2 else 4 if K <= 5 else 2
    if B == 8:
        pos = 4 * e2 + e01
    elif B == 4:
        pos = e01
    else:
        pos = e01 % 2
    return codebook_value(block_state(win, pos, K, B), CB, mask, flip)


def _k2_window_hash_ptx(hash_op: str) -> str:
    """PTX for `k2_window_hashes`: the 8 states of a K2 window (shifts 14, 12, .., 0) as 2 shifts' byte pairs.

    State p is bits [14 - 2p, 30 - 2p) of the window: bytes 1-2 (p < 4) or 0-1 (p >= 4) of the window shifted by
    6, 4, 2 or 0 bits, so one byte permute (with zeros) per state replaces a shift and a mask.
    """
    shifted = ["t6", "t4", "t2", "$8"] * 2
    lines = [
        ".reg .b32 t2, t4, t6, z;",
        "mov.b32 z, 0;",
        "shr.b32 t2, $8, 2;",
        "shr.b32 t4, $8, 4;",
        "shr.b32 t6, $8, 6;",
    ]
    lines += [f"prmt.b32 ${p}, {shifted[p]}, z, {'0x4421' if p < 4 else '0x4410'};" for p in range(8)]
    lines += [hash_op.format(p=p) for p in range(8)]
    lines += [f"lop3.b32 ${p}, ${p}, $9, $10, 0x6A;" for p in range(8)]  # (x & mask) ^ flip
    return "{\n" + "\n".join(lines) + "\n}"


K2_HASH_3INST_PTX = tl.constexpr(_k2_window_hash_ptx("mad.lo.u32 ${p}, ${p}, 89226354, 64248484;"))
K2_HASH_MCG_PTX = tl.constexpr(_k2_window_hash_ptx("mul.lo.u32 ${p}, ${p}, 0xCBAC1FED;"))


@triton.jit
def k2_window_hashes(win, CB: tl.constexpr, mask, flip):
    """The 8 weights of a K2 block window (positions 0..7) as uint32 pairs of fp16 halves whose sum is the weight.

    3INST (CB 0) and MCG (CB 1) only, GPU only (inline PTX): a byte permute, multiply and 3-input logic op per
    weight. MUL1 has no packed-halves form.
    """
    return tl.inline_asm_elementwise(
        K2_HASH_3INST_PTX if CB == 0 else K2_HASH_MCG_PTX,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        [win, mask, flip],
        dtype=(tl.uint32,) * 8,
        is_pure=True,
        pack=1,
    )
