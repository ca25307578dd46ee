"""The EXL3 cores against an exact float64 reference.

Both decode in registers: the GEMV core on fp16 activations, the tensor-core GEMM on fp16 hi/lo planes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_helpers import exact_weight, kernel_device, random_exl3, rel_err

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from glmquant.exl3 import decode_inner
from glmquant.runtime.kernels import exl3_gemm
from glmquant.runtime.kernels.exl3_gemm import exl3_linear, exl3_rows, linear_config, linear_job_rows, linear_tables
from glmquant.runtime.kernels.exl3_gemv import GEMV_ERROR_BOUND, fp16_pairs, packed_gemv, takes_fp16_pairs, uses_gemv
from glmquant.runtime.kernels.exl3_gemv_kbit import ONE_ROW_KBIT, SMALL_JOB_KBIT, SMALL_JOB_ROWS, TWO_ROW_KBIT
from glmquant.runtime.kernels.exl3_jobs import LARGE_JOBS, ONE_ROW_GEMV, GemmConfig, Jobs, WeightStack, one_row_gemv

BOUND = 2e-5  # the tensor-core core, fp32-level: activations as fp16 hi + lo planes, Hadamards as fp32 butterflies


@pytest.mark.parametrize(
    ("codebook", "bits", "rows", "cfg"),
    [
        ("mcg", 2, 1, GemmConfig(ti=2, tj=4, split_tiles=8)),  # GEMV core, 2 K splits
        (
            "mcg",
            2,
            1,
            GemmConfig(ti=8, tj=4),
        ),  # GEMV core at the one-row-job steps (ONE_ROW_GEMV), one K split
        ("3inst", 2, 1, GemmConfig()),  # GEMV core, one K split
        ("mul1", 2, 1, GemmConfig(ti=1, tj=16, split_tiles=4)),  # GEMV core, 4 K splits
        ("3inst", 3, 19, GemmConfig(ti=1, tj=8, split_tiles=4)),  # 4 K splits, two jobs (16 + 3 rows), B = 4 windows
        ("mul1", 7, 5, GemmConfig(ti=4, tj=8)),  # one K split, B = 2 windows
        ("3inst", 4, 1, GemmConfig(ti=2, tj=4, split_tiles=4)),  # GEMV core at K4 (B = 4 windows), 4 K splits
        ("mcg", 4, 1, None),  # GEMV core at K4's one-row steps (`one_row_gemv`), one K split
        ("mul1", 4, 1, GemmConfig(ti=1, tj=8, split_tiles=4)),  # GEMV core at K4, MUL1, 4 K splits
        ("mcg", 4, 2, None),  # K4 at 2 rows (an MTP verify of one draft): one two-row GEMV job
        ("mcg", 3, 1, ONE_ROW_KBIT),  # the one-row core (K3), one K split, B = 4 windows across chunks
        ("mul1", 6, 1, None),  # the one-row core at `linear_config`'s launch, B = 2 windows
        ("mcg", 5, 2, None),  # the small-job core: one job of 2 rows at K5
        ("3inst", 4, 4, None),  # K4 at 4 rows (a verify of 3 drafts): two two-row GEMV jobs
        ("mcg", 4, 3, None),  # K4 at 3 rows: GEMV jobs of 2 and 1 rows
        ("mcg", 5, 4, None),  # K5 at 4 rows: the small-job core, one job of 4 rows
        ("3inst", 3, 3, SMALL_JOB_KBIT),  # a job of 3 rows in a 4-row accumulator (the 4th masked)
        ("mul1", 2, 4, GemmConfig(ti=2, tj=4, split_tiles=4)),  # K2 at 4 rows: two GEMV jobs, 4 K splits
        ("mcg", 2, 2, None),  # K2 at 2 rows: one two-row GEMV job
        ("mcg", 2, 70, None),  # 64-row jobs (64 + 6 rows) at `linear_config`'s launch
        ("3inst", 4, 64, GemmConfig(ti=2, tj=4, split_tiles=4)),  # one full 64-row job, 4 K splits
    ],
)
def test_linear_matches_exact_weight(codebook, bits, rows, cfg):
    device = kernel_device()
    gen = torch.Generator().manual_seed(bits)
    t = random_exl3(gen, 200, 136, bits, codebook, scale=0.1)  # both dims padded (256 x 256)
    x = torch.randn(rows, 200, generator=gen)
    want = x.double() @ exact_weight(t).T
    stack = WeightStack.from_tensors([[t]], device)
    got = exl3_linear(x.to(device), stack, cfg)
    assert got.shape == (rows, 136) and got.dtype == torch.float32
    assert rel_err(got, want) < (GEMV_ERROR_BOUND if takes_fp16_pairs(linear_job_rows(rows, stack)) else BOUND)


def test_output_keeps_input_dtype_and_default_config():
    device = kernel_device()
    t = random_exl3(torch.Generator().manual_seed(1), 128, 128, 2, "mcg", scale=0.1)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
    got = exl3_linear(x.to(device, torch.bfloat16), t)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, x.bfloat16().double() @ exact_weight(t).T) < 1e-2  # bf16 output rounding


def test_small_linears_share_their_job_tables():
    """Decode and verify steps' linears (up to SMALL_JOB_ROWS rows) reuse one set of job tables per row count;
    larger products build theirs per call."""
    device = torch.device(kernel_device())
    assert linear_tables(2, 1, 2, device) is linear_tables(2, 1, 2, device)
    tokens, proj, ones, jobs = linear_tables(3, 1, 2, device)
    assert (tokens.tolist(), proj.tolist(), ones.flatten().tolist()) == ([0, 1, 2], [0, 0, 0], [1.0, 1.0, 1.0])
    assert jobs is not None and (jobs.starts.tolist(), jobs.counts.tolist(), jobs.max_rows) == ([0, 2], [2, 1], 2)
    assert linear_tables(1, 1, 1, device)[3] is None  # one row: a one-row job, no job table
    # two stacked linears at 2 rows: tokens 0-1 are projection 0's rows, 2-3 projection 1's
    tokens, proj, ones, _ = linear_tables(2, 2, 2, device)
    assert (tokens.tolist(), proj.tolist(), ones.shape) == ([0, 1, 2, 3], [0, 0, 1, 1], (4, 1))
    big = SMALL_JOB_ROWS + 1
    assert linear_tables(big, 1, 16, device) is not linear_tables(big, 1, 16, device)


@pytest.mark.parametrize(
    ("codebook", "bits", "rows"),
    [
        ("mcg", 4, 1),  # the GEMV core, one row (the speed tier's decode step)
        ("3inst", 4, 3),  # GEMV jobs of 2 and 1 rows (an MTP verify)
        ("mcg", 5, 2),  # the small-job core
        ("mul1", 3, 20),  # a prefill's rows: one projection after another, the tensor-core core's two jobs
    ],
)
def test_stacked_linears_equal_their_concatenated_weights(codebook, bits, rows):
    """Linears of one shape that share their input run as one stack (one set of launches up to SMALL_JOB_ROWS
    rows): y = x @ [W0; W1; W2].T, each projection's columns in order, at every core; an `out` of another shape is
    refused."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(10 + bits)
    linears = [random_exl3(gen, 200, 136, bits, codebook, scale=0.1) for _ in range(3)]
    x = torch.randn(rows, 200, generator=gen)
    want = x.double() @ torch.cat([exact_weight(t) for t in linears]).T
    stack = WeightStack.from_tensors([[t] for t in linears], device)
    got = exl3_linear(x.to(device), stack)
    assert got.shape == (rows, 3 * 136)
    bound = GEMV_ERROR_BOUND if takes_fp16_pairs(linear_job_rows(rows, stack)) else BOUND
    for p in range(3):  # each projection alone, so that a swapped or shifted block cannot hide in the whole's error
        cols = slice(136 * p, 136 * (p + 1))
        assert rel_err(got[:, cols], want[:, cols]) < bound
    with pytest.raises(ValueError, match=rf"is not \[{rows}, 408\]"):
        exl3_linear(x.to(device), stack, out=torch.empty(rows, 136, device=device))
    with pytest.raises(ValueError, match="not a stack of 2 experts"):
        exl3_linear(x.to(device), WeightStack.from_tensors([linears[:2]], device))


def test_config_splits_k_into_whole_steps():
    cfg = GemmConfig()  # 64 tile rows (1024 weight rows) per split
    assert (cfg.splits(256), cfg.splits(128), cfg.splits(32), cfg.tiles_per_split(200)) == (4, 2, 1, 8)
    with pytest.raises(ValueError, match="do not split"):
        GemmConfig(ti=8, split_tiles=4).tiles_per_split(32)


def _stack(in_features: int, out_features: int, bits: int, n_proj: int = 1) -> WeightStack:
    """n_proj linears of the given shape whose codes are never read (launch shapes only)."""
    kt, nt = in_features // 16, out_features // 16
    trellis = torch.zeros((n_proj, 1, kt, nt, 16 * bits), dtype=torch.int16)
    suh, svh = torch.ones((n_proj, 1, in_features)), torch.ones((n_proj, 1, out_features))
    return WeightStack(trellis, suh.half(), svh.half(), 1, in_features, out_features)


@pytest.mark.parametrize(
    ("shape", "bits", "rows", "want"),
    [
        # batch 1, K4, 4096 x 4096 (the GEMV core's K4 one-row steps, 8 x 2 tiles): 128 column blocks x 8 K splits
        # = 1,024 programs; the expert-sized default made 128
        ((4096, 4096), 4, 1, replace(one_row_gemv(4), split_tiles=32)),
        # batch 1, K4, 4096 -> 16,384: 512 blocks x 4 splits pass 1,024 at the coarsest split
        ((4096, 16384), 4, 1, replace(one_row_gemv(4), split_tiles=64)),
        ((4096, 4096), 3, 1, replace(ONE_ROW_KBIT, split_tiles=64)),  # K3: the one-row core, 256 blocks x 4 splits
        ((4096, 4096), 3, 2, replace(TWO_ROW_KBIT, split_tiles=16)),  # K3, 2 rows: one job, 64 blocks x 16 splits
        # batch 1 at K2 takes the GEMV core's one-row steps (8 x 4 tiles); 16 blocks x 32 splits = 512 programs
        # short of 1,024: the finest split
        ((4096, 1024), 2, 1, replace(ONE_ROW_GEMV, split_tiles=8)),
        ((4096, 4096), 2, 1, replace(ONE_ROW_GEMV, split_tiles=16)),  # 64 blocks x 16 splits
        # a prefill chunk of 4,096 rows is 64 jobs of 64 rows: the large jobs' steps already fill the GPU
        ((4096, 4096), 4, 4096, LARGE_JOBS),
        ((4096, 4096), 4, 32, GemmConfig(split_tiles=16)),  # 32 rows: 2 jobs of 16 x 32 blocks x 16 splits
        # an MTP verify's 2-4 rows at K4: GEMV jobs of two rows at the one-row steps and splits
        ((4096, 4096), 4, 3, replace(one_row_gemv(4), split_tiles=32)),
        ((4096, 4096), 4, 4, replace(one_row_gemv(4), split_tiles=32)),
        # at K5 one job of the small-job core, at its own steps: 256 blocks x 4 splits
        ((4096, 4096), 5, 3, replace(SMALL_JOB_KBIT, split_tiles=64)),
        ((4096, 4096), 2, 2, GemmConfig(split_tiles=8)),  # K2, 2 rows: one GEMV job, 32 blocks x 32 splits
        ((4096, 4096), 2, 4, GemmConfig(split_tiles=8)),  # K2, 4 rows: two GEMV jobs, split as for one
        # K4, 2 rows: one GEMV job at the one-row steps (the same splits: its first row is a one-row job's)
        ((4096, 4096), 4, 2, replace(one_row_gemv(4), split_tiles=32)),
        # a small linear stops at the finest split that is whole steps
        ((256, 128), 5, 1, replace(ONE_ROW_KBIT, split_tiles=8)),
    ],
)
def test_linear_config_fills_the_gpu_with_fixed_splits(shape, bits, rows, want):
    stack = _stack(*shape, bits)
    cfg = linear_config(rows, stack)
    assert cfg == want
    kt = shape[0] // 16
    assert cfg.tiles_per_split(kt) % cfg.ti == 0  # whole steps


def test_stacked_linears_count_every_projection_s_programs():
    """Three stacked 4096 x 4096 K4 linears (KDA's q, k, v) at batch 1: 3 x 128 column blocks pass 1,024 programs
    at 4 K splits, where one linear alone needs 8."""
    assert linear_config(1, _stack(4096, 4096, 4)) == replace(one_row_gemv(4), split_tiles=32)
    assert linear_config(1, _stack(4096, 4096, 4, n_proj=3)) == replace(one_row_gemv(4), split_tiles=64)


# the job steps do not depend on the codebook: one (seconds of Triton's CPU interpreter a row count) where no GPU runs
@pytest.mark.parametrize("codebook", ["3inst", "mcg"] if torch.cuda.is_available() else ["mcg"])
def test_k4_linear_rows_do_not_depend_on_the_row_count(codebook):
    """A K4 linear's rows are the same bits in products of one to four rows (a verify's rows equal plain steps'):
    all are GEMV jobs of one or two rows at the one-row steps with the same K splits."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(4)
    stack = WeightStack.from_tensors([[random_exl3(gen, 512, 256, 4, codebook, scale=0.1)]], device)
    x = torch.randn(4, 512, generator=gen).to(device)
    alone = torch.cat([exl3_linear(x[i : i + 1], stack) for i in range(4)])
    for rows in (2, 3, 4):
        assert linear_config(rows, stack) == linear_config(1, stack)
        assert torch.equal(exl3_linear(x[:rows], stack), alone[:rows]), rows
    assert not torch.equal(alone[0], alone[1])  # each row is its own product


# On a GPU every K, codebook and job size; in Triton's CPU interpreter (seconds a case) each K with every codebook,
# the job sizes alternating: every pair of the three still met (K and codebook, K and job size, codebook and job size)
_PAIR_CASES = [
    (bits, codebook, job_rows)
    for bits in (2, 3, 4, 5, 6)
    for i, codebook in enumerate(("3inst", "mcg", "mul1"))
    for job_rows in (1, 2)
    if torch.cuda.is_available() or job_rows == 1 + (bits + i) % 2
]


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "codebook", "job_rows"), _PAIR_CASES)
def test_fp16_pair_cores_return_the_inner_weight_bit_for_bit(bits, codebook, job_rows):
    """Unit-vector fp16-pair activations through one- or two-row jobs: the GEMV core at K2 and K4, the small-job
    core at K3, K5 (B = 4 windows) and K6 (B = 2).

    Each output row is a row of Q exactly: on CUDA (3INST, MCG) through the packed fp16x2 products, whose fp16 sums
    then add one product to zeros.
    """
    device = kernel_device()
    t = random_exl3(torch.Generator().manual_seed(3), 128, 128, bits, codebook, scale=1.0)
    stack = WeightStack.from_tensors([[t]], device)
    assert takes_fp16_pairs(1) and takes_fp16_pairs(2) and not takes_fp16_pairs(3)
    assert uses_gemv(stack, 1) == uses_gemv(stack, 2) == (bits in (2, 4)) and not uses_gemv(stack, 3)
    picks = torch.tensor(
        [16 * tile + r for tile in range(8) for r in (tile, 15 - tile)]
    )  # every tile row and row offset
    eye = fp16_pairs(torch.eye(128)[picks][None]).to(device)  # [P, R, in]: row i activates input picks[i]
    starts = torch.arange(0, 16, 2, dtype=torch.int32, device=device)
    jobs = None if job_rows == 1 else Jobs(starts, torch.full_like(starts, 2), 2)
    part = exl3_rows(
        eye, stack, torch.zeros(16, dtype=torch.int32, device=device), jobs, GemmConfig(ti=2, tj=8, split_tiles=4)
    )
    assert part.shape == (2, 1, 16, 128)  # 8 tile rows in K splits of 4
    assert torch.equal(part.sum(0)[0].cpu(), decode_inner(t.trellis, t.codebook).float()[picks])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed path is inline PTX: needs a CUDA GPU")
@pytest.mark.parametrize("codebook", ["3inst", "mcg"])
@pytest.mark.parametrize("job_rows", [1, 2])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6])
def test_packed_products_match_their_unpacked_path(codebook, job_rows, bits, monkeypatch):
    """fp16x2 products (the GEMV core's PTX window hashes at K2 and K4, the small-job core's hash halves at other K;
    fp16 step sums) against the same core's fp32 products of decoded weights on the same GPU, random activations at
    the launch shapes the runtime uses."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(5)
    t = random_exl3(gen, 1024, 512, bits, codebook)
    stack = WeightStack.from_tensors([[t]], device)
    x = fp16_pairs(torch.randn(1, 4, 1024, generator=gen)).to(device)  # [P, R, in]
    starts = torch.arange(0, 4, 2, dtype=torch.int32, device=device)
    jobs = None if job_rows == 1 else Jobs(starts, torch.full_like(starts, 2), 2)
    experts = torch.zeros(4, dtype=torch.int32, device=device)
    cfg = linear_config(job_rows, stack)
    assert packed_gemv(x, stack)
    packed = exl3_rows(x, stack, experts, jobs, cfg).sum(0)
    monkeypatch.setattr(exl3_gemm, "packed_gemv", lambda xr, stack: False)
    unpacked = exl3_rows(x, stack, experts, jobs, cfg).sum(0)
    assert unpacked.abs().max() > 1 and rel_err(packed, unpacked) < GEMV_ERROR_BOUND


def test_core_rejects_activations_of_the_other_format_and_one_row_job_tables():
    device = kernel_device()
    t = random_exl3(torch.Generator().manual_seed(4), 128, 128, 2, "mcg", scale=1.0)
    stack = WeightStack.from_tensors([[t]], device)
    planes = torch.zeros((1, 1, 2, 128), dtype=torch.float16, device=device)  # the tensor-core core's format
    with pytest.raises(ValueError, match="not the GEMV core's format"):
        exl3_rows(planes, stack, torch.zeros(1, dtype=torch.int32, device=device), None, GemmConfig())
    with pytest.raises(ValueError, match="None is one row per job"):
        Jobs(torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1)
    k3 = WeightStack.from_tensors([[random_exl3(torch.Generator().manual_seed(4), 128, 128, 3, "mcg")]], device)
    pairs = torch.zeros((1, 3, 128), dtype=torch.int32, device=device)
    start, three = (torch.tensor([n], dtype=torch.int32, device=device) for n in (0, 3))
    jobs = Jobs(start, three, 3)
    with pytest.raises(ValueError, match="not the small-job core's format"):  # 3-row jobs take hi/lo planes
        exl3_rows(pairs, k3, torch.zeros(3, dtype=torch.int32, device=device), jobs, SMALL_JOB_KBIT)


@pytest.mark.parametrize("rows", [1, 2])
def test_small_job_core_takes_either_activation_format_for_one_or_two_rows(rows):
    """At K3 a one- or two-row job multiplies fp16 pairs (what `exl3_linear` gives it) or hi/lo planes alike: the
    planes' fp32-level products against the pairs' fp16 activations, within the GEMV error bound."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(9)
    stack = WeightStack.from_tensors([[random_exl3(gen, 256, 128, 3, "3inst")]], device)
    x = torch.randn(1, rows, 256, generator=gen)
    hi = x.half()
    planes = torch.stack([hi, (x - hi.float()).half()], dim=2).to(device)  # [P, R, 2, in]
    experts = torch.zeros(rows, dtype=torch.int32, device=device)
    start, two = (torch.tensor([n], dtype=torch.int32, device=device) for n in (0, 2))
    jobs = None if rows == 1 else Jobs(start, two, 2)
    cfg = linear_config(rows, stack, programs=1)
    from_planes = exl3_rows(planes, stack, experts, jobs, cfg).sum(0)
    from_pairs = exl3_rows(fp16_pairs(x).to(device), stack, experts, jobs, cfg).sum(0)
    want = x[0].double() @ decode_inner(stack.trellis[0, 0].cpu(), "3inst").double()
    assert rel_err(from_planes, want) < BOUND < rel_err(from_pairs, want) < GEMV_ERROR_BOUND


@pytest.mark.parametrize("bits", [3, 5])
def test_small_job_core_leaves_the_rows_of_empty_jobs_alone(bits, monkeypatch):
    """A job of no rows (`plan_routes` gives one to every route after a job's first) writes nothing: the row it
    starts at belongs to another job, which alone writes it (two programs storing one row would race on a GPU)."""
    device = kernel_device()
    t = random_exl3(torch.Generator().manual_seed(7), 128, 128, bits, "mcg")
    stack = WeightStack.from_tensors([[t]], device)
    x = torch.randn(1, 3, 2, 128, generator=torch.Generator().manual_seed(8)).half().to(device)  # hi/lo planes
    starts, counts = (torch.tensor(v, dtype=torch.int32, device=device) for v in ([0, 2], [2, 0]))
    jobs = Jobs(starts, counts, 2)  # rows 0-1 one job, then an empty one at row 2, which no job holds
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))  # part starts as NaN
    part = exl3_rows(x, stack, torch.zeros(3, dtype=torch.int32, device=device), jobs, SMALL_JOB_KBIT).cpu()
    assert part[:, 0, :2].isfinite().all() and part[:, 0, 2].isnan().all()
