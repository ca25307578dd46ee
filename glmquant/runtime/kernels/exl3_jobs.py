"""What both EXL3 cores take: weight stacks, launch shapes and jobs.

A core works on *jobs*: a run of rows that share one weight (one expert), so each weight is decoded once per job
however many rows use it. Weight stacks are [P, V, in/16, out/16, 16K]: P projections (gate and up side by side)
of V experts; a single linear is P = V = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from glmquant.exl3 import EXL3Tensor
from glmquant.runtime.kernels.exl3_decode import codebook_id

JOB_ROWS = tl.constexpr(16)  # rows of one tensor-core tile: the most rows a decode-batch job holds
LARGE_JOB_ROWS = 64  # the most rows a job holds: four tiles under one decode of its weights (prefill)


@dataclass(frozen=True)
class GemmConfig:
    """Launch shape of the core: tile rows (ti) and 16-column tiles (tj) per step, tile rows per K split, warps.

    ti = 4, tj = 8 decodes a 64 x 128 weight block per step (64 codes per thread at 4 warps) into a
    16 x 128 fp32 accumulator in the tensor-core core, small enough in registers and shared memory (decoded block
    + pipelined activations) for 4 programs per SM on a GB10; the GEMV core takes the same blocks without shared
    memory in its loop, and one-row GEMV jobs run ti = 8, tj = 4 at K2 (`ONE_ROW_GEMV`), tj = 2 at K4
    (`one_row_gemv`). Resources per config: docs/kernels.md.
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


# one-row GEMV jobs: 8 x 4-tile steps take fewer registers than the 4 x 8 default and make twice the programs,
# which a batch-1 launch needs to fill the GPU; the fastest of the swept configs at batches 1, 4 and 16
# (figures: docs/kernels.md, "Per kernel")
ONE_ROW_GEMV = GemmConfig(ti=8, tj=4)


def one_row_gemv(bits: int) -> GemmConfig:
    """One-row GEMV jobs' steps at K = bits (2 or 4): `ONE_ROW_GEMV`'s 8 tile rows and words per thread.

    A tile is 8 K uint32 words, one tensor element each, so K4 takes 2 tile columns where K2 takes 4: at 8 x 4 tiles
    a K4 thread holds twice the elements (127 registers on sm_90, MCG, Triton 3.9; 8 x 2 tiles 64, K2 at 8 x 4 56).
    K4's steps are not yet timed on a GPU.
    """
    return replace(ONE_ROW_GEMV, tj=ONE_ROW_GEMV.tj * 2 // bits)


# 64-row jobs: 4 x 4-tile steps keep the 64 x 64 fp32 accumulator at 32 registers per thread (4 warps), as the
# default's 16 x 128; not yet tuned on a GPU
LARGE_JOBS = GemmConfig(ti=4, tj=4)


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
    def single(cls, t: EXL3Tensor, device: torch.device | str) -> WeightStack:
        """One linear as a stack (P = V = 1): views of its tensors on `device`, copied only to move them there."""
        parts = (t.trellis.to(device)[None, None], t.suh.to(device)[None, None], t.svh.to(device)[None, None])
        return cls(*parts, codebook_id(t.codebook), t.in_features, t.out_features)

    def projection(self, p: int) -> WeightStack:
        """Projection p alone (views)."""
        one = slice(p, p + 1)
        return replace(self, trellis=self.trellis[one], suh=self.suh[one], svh=self.svh[one])

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
        if not 2 <= self.max_rows <= LARGE_JOB_ROWS:
            raise ValueError(f"jobs hold 2 to {LARGE_JOB_ROWS} rows (None is one row per job), not {self.max_rows}")


def tile_rows(max_rows: int) -> int:
    """Rows of the tensor-core core's tile for jobs of at most `max_rows` rows: 16, or 64 for larger jobs."""
    return JOB_ROWS.value if max_rows <= JOB_ROWS.value else LARGE_JOB_ROWS


def job_rows(jobs: Jobs | None) -> int:
    """The most rows a job holds (None: one row per job)."""
    return 1 if jobs is None else jobs.max_rows
