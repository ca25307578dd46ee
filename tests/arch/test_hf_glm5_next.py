"""transformers' GLM-5.3-Flash kernels follow the tensors' device: a CPU forward never reaches a CUDA kernel."""

from __future__ import annotations

import functools

import pytest
import torch

from glmquant.arch.hf_glm5_next import KERNEL_FUNCTIONS, _route_by_device, modeling, reference


def test_cpu_tensors_take_the_reference_and_cuda_tensors_the_kernel() -> None:
    calls: list[str] = []

    def reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        calls.append("reference")
        return x * scale

    @functools.wraps(reference)
    def hub_wrapper(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # what transformers binds fla's kernel in
        calls.append("kernel")
        return x * scale

    routed = _route_by_device(hub_wrapper)
    assert torch.equal(routed(torch.ones(2), scale=3.0), torch.full((2,), 3.0))
    assert torch.equal(routed(x=torch.ones(1)), torch.ones(1))
    assert calls == ["reference", "reference"]
    if torch.cuda.is_available():
        routed(torch.ones(1, device="cuda"))
        assert calls[-1] == "kernel"


def test_modeling_routes_every_kernel_once_and_keeps_the_reference_math() -> None:
    pytest.importorskip("transformers.models.glm5_next")
    glm = modeling()
    first = [getattr(glm, name) for name in KERNEL_FUNCTIONS]
    assert [getattr(modeling(), name) for name in KERNEL_FUNCTIONS] == first  # not wrapped twice
    torch.manual_seed(0)
    b, s, h, d = 1, 5, 2, 8
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    g = -torch.rand(b, s, h, d)
    beta = torch.rand(b, s, h)
    out, state = glm.chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    want, want_state = reference("chunk_kimi_delta_attention")(
        q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.equal(out, want) and torch.equal(state, want_state)
    assert out.shape == (b, s, h, d) and torch.isfinite(out).all()
