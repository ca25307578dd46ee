"""Kimi delta attention (KDA) for the runtime: flash-linear-attention's Triton kernels on CUDA when `fla` is
installed (the optional extra `fla`), transformers' reference PyTorch functions otherwise (any device).

Both entry points take q, k [B, S, heads, dk], v [B, S, heads, dv] in the model dtype, the fp32 log decay g
[B, S, heads, dk], beta [B, S, heads] and the fp32 recurrent state [B, heads, dk, dv], which they update in place
(static address: a captured decode graph keeps reading it); q and k are L2-normalized inside, scale dk^-1/2.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

import torch

from glmquant.arch.hf_glm5_next import reference
from glmquant.runtime.kernels.availability import FLA_AVAILABLE

KDAFunction = Callable[..., tuple[torch.Tensor, torch.Tensor]]
RECURRENT_TOKENS = 4  # a verify step's tokens at the most drafts (runtime.speculative.MAX_SPECULATIVE_TOKENS + 1)


def uses_fla(device: torch.device) -> bool:
    """Whether KDA on `device` runs flash-linear-attention's kernels."""
    return FLA_AVAILABLE and device.type == "cuda"


@cache
def _functions(fla: bool) -> tuple[KDAFunction, KDAFunction]:
    """(recurrent, chunked) implementations: fla's, or the torch functions transformers falls back to (its
    hub-kernel wrappers would pick fla themselves)."""
    if fla:
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        return partial(_fla_recurrent_in_place, fused_recurrent_kda_fwd), chunk_kda
    return reference("recurrent_kimi_delta_attention"), reference("chunk_kimi_delta_attention")


def _fla_recurrent_in_place(
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's recurrent kernel (`forward`: `fused_recurrent_kda_fwd`) writing the final state over `initial_state`
    (its decode path, as vLLM runs it): `fused_recurrent_kda` would write a new state tensor that then has to be
    copied back, one more read and write of the 4 MB state per layer and token on GLM-5.3-Flash (a Spark's 218 GB/s:
    ~1.2 ms a step over 34 layers). Returns (output, initial_state)."""
    if not output_final_state or not initial_state.is_contiguous():
        raise ValueError("the in-place KDA recurrence writes the final state over a contiguous initial state")
    out, final = forward(
        *(t.contiguous() for t in (q, k, v, g, beta)),
        initial_state=initial_state,
        output_final_state=True,
        inplace_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    return out, final


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    states: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA over S new tokens from `state`; returns the output [B, S, heads, dv] and leaves the final state in
    `state`. Up to RECURRENT_TOKENS per sequence take the recurrent kernel (decode, and speculation's verify steps:
    the same per-token recurrence as one-token steps, without the chunked kernel's set-up), more the chunked one
    (prefill). `states` [S, heads, dk, dv] (one sequence's verify step) gets the state after every token: the
    recurrence then runs token by token."""
    recurrent, chunked = _functions(uses_fla(q.device))
    if states is None:
        return _advance(recurrent if q.shape[1] <= RECURRENT_TOKENS else chunked, q, k, v, g, beta, state)
    if q.shape[0] != 1 or q.shape[1] > states.shape[0]:
        raise ValueError(f"a KDA history of {states.shape[0]} tokens of one sequence cannot take {tuple(q.shape[:2])}")
    outs = []
    for t in range(q.shape[1]):
        at = slice(t, t + 1)
        outs.append(_advance(recurrent, q[:, at], k[:, at], v[:, at], g[:, at], beta[:, at], state))
        states[t].copy_(state[0])
    return torch.cat(outs, dim=1)


def _advance(
    fn: KDAFunction,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """`fn` over the tokens from `state`, leaving the final state there (its address stays: graphs read it)."""
    out, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if final is not state:  # fla's recurrence wrote it in place
        state.copy_(final)
    return out
