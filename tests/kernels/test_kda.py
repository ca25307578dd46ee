"""The runtime's KDA entry point: a few tokens at once run the same recurrence as one-token steps."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")

from glmquant.runtime.kernels.kda import RECURRENT_TOKENS, kda
from glmquant.runtime.speculative import MAX_SPECULATIVE_TOKENS


def _inputs(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    b, h, d = 1, 2, 16
    q, k, v = (torch.randn(b, tokens, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(b, tokens, h, d, generator=gen)
    beta = torch.rand(b, tokens, h, generator=gen)
    return q, k, v, g, beta


def _token(
    i: int, *inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token i of q, k, v, g, beta."""
    q, k, v, g, beta = (t[:, i : i + 1] for t in inputs)
    return q, k, v, g, beta


def test_verify_sized_steps_equal_one_token_steps_bit_for_bit() -> None:
    """A verify step (k + 1 tokens) and a re-run take the recurrence plain decoding takes, token for token: the
    same outputs and final state as one-token steps, exactly (speculation's greedy identity rests on it)."""
    assert RECURRENT_TOKENS >= MAX_SPECULATIVE_TOKENS + 1
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = _inputs(RECURRENT_TOKENS, gen)
    start = torch.randn(1, 2, 16, 16, generator=gen)
    together = start.clone()
    out = kda(q, k, v, g, beta, together)
    alone = start.clone()
    steps = [kda(*_token(i, q, k, v, g, beta), alone) for i in range(RECURRENT_TOKENS)]
    assert torch.equal(out, torch.cat(steps, dim=1)) and torch.equal(together, alone)


def test_longer_inputs_take_the_chunked_form_of_the_same_recurrence() -> None:
    gen = torch.Generator().manual_seed(1)
    tokens = RECURRENT_TOKENS + 9
    q, k, v, g, beta = _inputs(tokens, gen)
    chunked_state, stepped_state = torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16)
    out = kda(q, k, v, g, beta, chunked_state)
    steps = [kda(*_token(i, q, k, v, g, beta), stepped_state) for i in range(tokens)]
    torch.testing.assert_close(out, torch.cat(steps, dim=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_state, stepped_state, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, torch.cat(steps, dim=1))  # a different summation: the chunked kernel ran


def test_fla_recurrence_writes_the_final_state_over_the_initial_one() -> None:
    """With flash-linear-attention (CUDA, or its kernels under Triton's interpreter) the recurrent path leaves the
    final state in the cache's own tensor, with fla's public function's output and state (no state copy per step);
    the engine's q, k, v are views of one fused projection, not contiguous."""
    pytest.importorskip("fla.ops.kda", reason="flash-linear-attention is not installed (the optional extra fla)")
    from fla.ops.kda import fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from glmquant.runtime.kernels.kda import _fla_recurrent_in_place

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(2)
    fused = torch.randn(1, 2, 3, 2, 16, generator=gen).to(device)
    q, k, v = fused.unbind(2)
    _, _, _, g, beta = (t.to(device) for t in _inputs(2, gen))
    state = torch.randn(1, 2, 16, 16, generator=gen).to(device)
    expected_out, expected_state = fused_recurrent_kda(
        q, k, v, g, beta, initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    address = state.data_ptr()
    out, final = _fla_recurrent_in_place(
        fused_recurrent_kda_fwd,
        q,
        k,
        v,
        g,
        beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert final is state and state.data_ptr() == address
    assert torch.equal(out, expected_out) and torch.equal(state, expected_state)
