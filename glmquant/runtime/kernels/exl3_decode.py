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
def _word(tile_ptr, i, K: tl.constexpr):
    """uint32 stream word i (mod 8 K) of a tile, stream bits [32 i, 32 i + 32) MSB first: the tile's int16 words
    viewed as int32 (chunk 2 i, int16 word 2 i + 1, is the high half)."""
    return tl.load(tile_ptr + (i + 8 * K) % (8 * K)).to(tl.uint32, bitcast=True)


@triton.jit
def block_window(tile_ptr, blk, K: tl.constexpr, B: tl.constexpr):
    """uint32 holding stream bits [(blk+1) B K - 32, (blk+1) B K): the states of ring positions blk*B .. blk*B+B-1.

    tile_ptr points at the tile's 8 K int32 words (any shape, broadcast with blk); wraps around the ring. Two
    aligned 32-bit loads per block (the window's 16 + (B - 1) K <= 32 bits span at most two words), funnel-shifted.
    """
    end = (blk + 1) * (B * K)
    w = (end - 1) // 32  # word holding the last bit
    after = (32 * (w + 1) - end).to(tl.uint64)  # bits of word w after the window
    pair = (_word(tile_ptr, w - 1, K).to(tl.uint64) << 32) | _word(tile_ptr, w, K).to(tl.uint64)
    return (pair >> after).to(tl.uint32)


@triton.jit
def block_state(win, pos, K: tl.constexpr, B: tl.constexpr):
    """16-bit state of position `pos` (0..B-1) inside the block whose window is `win`."""
    return (win >> ((B - 1 - pos) * K).to(tl.uint32)) & 0xFFFF


@triton.jit
def codebook_pairs(state, CB: tl.constexpr, mask, flip):
    """uint32 pairs of fp16 halves whose sum is the weight of uint32 states, 3INST (CB 0) or MCG (CB 1): the hash
    before its halves are added, which fp16x2 products take as it is (MUL1 has no such form)."""
    x = state * 89226354 + 64248484 if CB == 0 else state * 0xCBAC1FED
    return (x & mask.to(tl.uint32, bitcast=True)) ^ flip.to(tl.uint32, bitcast=True)


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
    y = codebook_pairs(state, CB, mask, flip)
    lo = (y & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (y >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo + hi  # exact in fp32 for these exponents, so one fp16 rounding as in the codec


@triton.jit
def ring_fields(TI: tl.constexpr, TJ: tl.constexpr):
    """Index vectors of a [TI, TJ, e1, e0, e2, g, l4] block of tiles (tile row, tile column, then the ring fields
    of a position: row 2 l4 + e0 + 8 e1, column g + 8 e2 of its tile), each along its own dim: the layout the
    tensor-core and small-job cores decode in."""
    ti = tl.arange(0, TI)[:, None, None, None, None, None, None]
    tj = tl.arange(0, TJ)[None, :, None, None, None, None, None]
    e1 = tl.arange(0, 2)[None, None, :, None, None, None, None]
    e0 = tl.arange(0, 2)[None, None, None, :, None, None, None]
    e2 = tl.arange(0, 2)[None, None, None, None, :, None, None]
    g = tl.arange(0, 8)[None, None, None, None, None, :, None]
    l4 = tl.arange(0, 4)[None, None, None, None, None, None, :]
    return ti, tj, e1, e0, e2, g, l4


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
def window_states(win, e2, e01, K: tl.constexpr):
    """16-bit states at the low ring fields (e2, e01) of the blocks whose windows are `win` (`load_window`)."""
    B: tl.constexpr = 8 if K <= 2 else 4 if K <= 5 else 2
    if B == 8:
        pos = 4 * e2 + e01
    elif B == 4:
        pos = e01
    else:
        pos = e01 % 2
    return block_state(win, pos, K, B)


@triton.jit
def window_values(win, e2, e01, K: tl.constexpr, CB: tl.constexpr, mask, flip):
    """fp16 weights at the low ring fields (e2, e01) of the blocks whose windows are `win`."""
    return codebook_value(window_states(win, e2, e01, K), CB, mask, flip)


@triton.jit
def window_pairs(win, e2, e01, K: tl.constexpr, CB: tl.constexpr, mask, flip):
    """The weights at those fields as `codebook_pairs` (3INST, MCG): fp16 halves whose sum is the weight."""
    return codebook_pairs(window_states(win, e2, e01, K), CB, mask, flip)


@triton.constexpr_function
def window_hash_ptx(K: int, CB: int) -> str:
    """PTX for `window_hashes`: the B = 16 / K states of a window (K2: shifts 14, 12, .., 0; K4: 12, 8, 4, 0) as
    byte pairs of the window shifted by under 8 bits, hashed by codebook CB (0 = 3INST, 1 = MCG).

    State p is bits [s, s + 16) of the window, s = (B - 1 - p) K: bytes 1-2 (s >= 8) or 0-1 (s < 8) of the window
    shifted by s mod 8 bits (K2: 6, 4, 2 or 0; K4: 4 or 0), so one byte permute (with zeros) per state replaces a
    shift and a mask.
    """
    if K not in (2, 4):
        raise ValueError(f"window hashes are for K2 and K4 (blocks of 16 stream bits), not K{K}")
    B = 16 // K
    starts = [(B - 1 - p) * K for p in range(B)]
    shifts = sorted({s % 8 for s in starts} - {0})
    win, mask, flip = f"${B}", f"${B + 1}", f"${B + 2}"
    source = {0: win, **{k: f"t{k}" for k in shifts}}
    lines = [f".reg .b32 {''.join(f't{k}, ' for k in shifts)}z;", "mov.b32 z, 0;"]
    lines += [f"shr.b32 t{k}, {win}, {k};" for k in shifts]
    lines += [f"prmt.b32 ${p}, {source[s % 8]}, z, {'0x4421' if s >= 8 else '0x4410'};" for p, s in enumerate(starts)]
    hash_op = "mad.lo.u32 ${p}, ${p}, 89226354, 64248484;" if CB == 0 else "mul.lo.u32 ${p}, ${p}, 0xCBAC1FED;"
    lines += [hash_op.format(p=p) for p in range(B)]
    lines += [f"lop3.b32 ${p}, ${p}, {mask}, {flip}, 0x6A;" for p in range(B)]  # (x & mask) ^ flip
    return "{\n" + "\n".join(lines) + "\n}"


@triton.constexpr_function
def _window_hash_constraints(K: int) -> str:
    """Inline-asm constraints of `window_hash_ptx`: B = 16 / K outputs, then the window, mask and flip."""
    return "=r," * (16 // K) + "r,r,r"


@triton.jit
def window_hashes(win, K: tl.constexpr, CB: tl.constexpr, mask, flip):
    """The B = 16 / K weights of a block window (positions 0..B-1) at K2 or K4 as uint32 pairs of fp16 halves whose
    sum is the weight.

    K2 and K4 only, where `load_window`'s block of B positions advances the stream by 16 bits (B K = 16). 3INST (CB 0)
    and MCG (CB 1) only, GPU only (inline PTX): a byte permute, multiply and 3-input logic op per weight. MUL1 has
    no packed-halves form.
    """
    B: tl.constexpr = 16 // K
    return tl.inline_asm_elementwise(
        window_hash_ptx(K, CB),
        _window_hash_constraints(K),
        [win, mask, flip],
        dtype=(tl.uint32,) * B,
        is_pure=True,
        pack=1,
    )
