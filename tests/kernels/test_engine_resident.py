"""The runtime's own forward with resident Triton experts (the GPU path: dummy stacks generated in one pass, every
MoE step one `fused_moe`, mHC through its fused kernels) against the same dummy model with the torch expert backend:
the same greedy tokens, logits within the GEMV core's fp16 error (1e-3 relative)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_device

from glmquant.exl3.tensor import EXL3Tensor
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.runtime.dummy import dummy_artifact
from glmquant.runtime.engine import Engine
from glmquant.runtime.engine.linears import Exl3Proj
from glmquant.runtime.engine.profile import class_bytes, exl3_stacks
from glmquant.runtime.engine.weights import KDAWeights
from glmquant.runtime.options import RuntimeOptions

# 12 prompt tokens x top-2 routes over the tiny model's 4 experts: 6 routes per expert, so the prefill's MoE steps
# take 16-row tensor-core jobs (`choose_moe_config`: from 4 per expert) as 20 tokens did, and the decode steps one-row
# GEMV jobs; the prompt is one prefill chunk at either length (PREFILL_CHUNK). An EXL3 linear's rows now fit one
# 16-row job (20 made 16 + 4: test_exl3_gemm covers such splits). Measured on a CPU, 20 -> 12 tokens: the speed tier's
# steps 57 -> 51 s, largest |logit difference| / scale 1.4e-3 -> 1.0e-3 (7.6e-4 -> 7.5e-4 without EXL3 linears)
# (the speed tier's test on the two-layer `one_moe_source`: 1.1e-3, measured on a CPU)
PROMPT_TOKENS = 12


def _assert_same_greedy_steps(triton: Engine, torch_: Engine, device: str) -> None:
    """A prefill of PROMPT_TOKENS and two greedy decode steps: logits within the kernels' fp16 error (relative to the
    largest), the same argmax at each."""
    ids = torch.arange(PROMPT_TOKENS)
    ours, theirs = triton.prefill(0, ids), torch_.prefill(0, ids)
    for position in range(PROMPT_TOKENS, PROMPT_TOKENS + 3):
        scale = theirs.abs().max()
        torch.testing.assert_close(ours / scale, theirs / scale, rtol=0, atol=2e-3)
        assert int(ours.argmax()) == int(theirs.argmax())
        if position < PROMPT_TOKENS + 2:
            token, at = theirs.argmax().view(1), torch.tensor([position], device=device)
            ours, theirs = triton.decode(token, at, position + 1)[0].clone(), torch_.decode(token, at, position + 1)[0]


@pytest.mark.slow
def test_resident_triton_experts_decode_like_the_torch_backend(tiny_source: Path) -> None:
    device = kernel_device()
    artifact = dummy_artifact(tiny_source, device=device)
    triton = Engine.load(artifact, RuntimeOptions(device=device, dtype="float32", backend="triton"), max_len=32)
    torch_ = Engine.load(artifact, RuntimeOptions(device=device, dtype="float32"), max_len=32)
    from glmquant.runtime.kernels import mhc

    for run in (triton.prefill_run, triton.decode_run):  # mHC through its fused kernels (kernels/mhc.py) too
        assert (run.ops.hyper_enter, run.ops.hyper_expand) == (mhc.hyper_enter, mhc.hyper_expand)
    _assert_same_greedy_steps(triton, torch_, device)


@pytest.fixture(scope="module")
def one_moe_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with two layers, a dense KDA layer and an MLA/DSA MoE layer of its four experts: every kind of
    EXL3 retained linear the engine runs, in fewer interpreted kernels than the three-layer tiny source's (whose two
    MoE layers' resident experts the test above runs)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("one-moe-src"), TinyModelConfig(num_hidden_layers=2))


@pytest.mark.slow
def test_engine_runs_the_speed_tier_through_exl3_linear_like_the_torch_backend(one_moe_source: Path) -> None:
    """A dummy `--retained-bits 4 --head-bits 6` artifact: with the Triton backend each projection holding an EXL3
    retained linear of over `dense_linear_max_weights` weights, and lm_head, is an `Exl3Proj` (run by `exl3_linear`,
    its stored bytes counted: the profile's lm_head class reads the head's EXL3 bytes), the smaller ones decoded at
    load (adjacent ones one weight), with the torch backend all decoded once; the same greedy tokens, logits within
    the kernels' fp16 error."""
    device = kernel_device()
    artifact = dummy_artifact(one_moe_source, device=device, retained_bits=4, head_bits=6)
    # KDA's in_proj: q, k, v of 64 x 128 weights through exl3_linear as one stack, then f_a, g_a (32 x 128) and b
    # (2 x 128) dense
    options = RuntimeOptions(device=device, dtype="float32", backend="triton", dense_linear_max_weights=32 * 128)
    triton = Engine.load(artifact, options, max_len=32)
    torch_ = Engine.load(artifact, RuntimeOptions(device=device, dtype="float32"), max_len=32)
    kda = triton.weights.layers[0].attention
    assert isinstance(kda, KDAWeights)
    assert all(isinstance(p, Exl3Proj) for p in [kda.in_proj, kda.o_proj, triton.weights.lm_head])
    assert isinstance(kda.in_proj, Exl3Proj) and [type(b).__name__ for b in kda.in_proj.blocks] == [
        "WeightStack",
        "Tensor",
    ]
    assert kda.in_proj.blocks[0].trellis.shape[:2] == (3, 1)  # q, k, v: one set of launches
    q_bytes = EXL3Tensor.storage_bytes(128, 64, 4, "mcg")
    assert kda.in_proj.nbytes == 3 * q_bytes + kda.in_proj.blocks[1].nbytes  # what a step reads
    # every EXL3 linear over the bound runs through the kernels but kv_b (attention absorbs it as a matrix)
    kernels = [
        name
        for name, lin in artifact.retained_linears.items()
        if lin.in_features * lin.out_features > 32 * 128 and not name.endswith("kv_b_proj")
    ]
    stacks = exl3_stacks(triton)
    assert stacks["linears"] == len(kernels) and stacks["stacks"] < len(kernels)  # q/k/v and gate/up stacked
    assert exl3_stacks(torch_) == {"stacks": 0, "linears": 0}
    assert kda.in_proj.blocks[1].shape == (32 + 32 + 2, 128) and isinstance(kda.f_b, torch.Tensor)
    assert isinstance(torch_.weights.layers[0].attention.in_proj, torch.Tensor)
    assert isinstance(torch_.weights.lm_head, torch.Tensor)
    cfg, norm = triton.cfg, triton.weights.norm.nbytes
    head_bytes = EXL3Tensor.storage_bytes(cfg.hidden, cfg.vocab, 6, "mcg")
    assert class_bytes(triton, 1, 8, 0, 0)["lm_head"] == head_bytes + norm < class_bytes(torch_, 1, 8, 0, 0)["lm_head"]
    _assert_same_greedy_steps(triton, torch_, device)
