"""The engine with the runtime's own Triton kernels for its math (`engine/ops.py`: mHC, the router's scores) against
the same engine on the PyTorch math."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import torch
from kernel_helpers import kernel_device

from glmquant.arch import glm5_next_math as math
from glmquant.runtime.kernels import mhc


def test_engine_with_the_runtime_kernels_decodes_like_its_pytorch_math(tiny_source: Path) -> None:
    """The tiny model's engine (float32, torch experts) with mHC and the router's scores through their kernels: a
    prefill and three greedy steps give the PyTorch math's logits to float32 rounding, so the kernels sit in the
    forward as the math does (a prefill's rows through the matrix-product paths, decode rows through the kernels).
    On a GPU "float32 rounding" is what the same math gives on the CPU, times 4: the tiny random model amplifies a
    reordered sum (the GPU's exp and division, cuBLAS's sums) to ~1e-4 of the largest logit, above 1e-5."""
    from dataclasses import replace

    from glmquant.runtime.dummy import dummy_artifact
    from glmquant.runtime.engine import Engine
    from glmquant.runtime.engine.ops import ops_for
    from glmquant.runtime.options import RuntimeOptions

    device = kernel_device()
    setups = [(device, False), (device, True)] + ([("cpu", False)] if device != "cpu" else [])
    engines = []
    for where, kernels in setups:  # on CUDA the engine takes the kernels by default
        engine = Engine.load(
            dummy_artifact(tiny_source, device=where), RuntimeOptions(device=where, dtype="float32"), max_len=80
        )
        ops = ops_for(torch.device(where), kernels=kernels)
        engine.prefill_run, engine.decode_run = (
            replace(engine.prefill_run, ops=ops),
            replace(engine.decode_run, ops=ops),
        )
        engines.append(engine)
    fused = engines[1]
    assert (
        fused.decode_run.ops.hyper_enter is mhc.hyper_enter
        and engines[0].decode_run.ops.hyper_enter is math.hyper_enter
    )
    prompt = torch.arange(70) % 200  # past PARTIALS_MAX_TOKENS and KERNEL_MAX_TOKENS: matrix products
    logits = [engine.prefill(0, prompt).cpu() for engine in engines]
    for step in range(3):
        largest = float(logits[0].abs().max())
        rounding = float((logits[2] - logits[0]).abs().max()) if len(logits) > 2 else 0.0
        assert rounding <= 1e-3 * largest, f"the math on the GPU strays from the CPU's by {rounding:.3g}"
        bound = max(1e-5 * largest, 4 * rounding)
        try:
            torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=bound)
        except AssertionError as exc:  # which forward differs: the prefill's matrix products or a decode's kernels
            raise AssertionError(
                f"{'prefill' if step == 0 else f'greedy step {step}'} (math CPU vs GPU: {rounding:.3g}): {exc}"
            ) from None
        token, at = logits[0].argmax().view(1), prompt.numel() + step
        logits = [
            engine.decode(token.to(where), torch.tensor([at], device=where), at + 1)[0].cpu()
            for engine, (where, _) in zip(engines, setups)
        ]


@pytest.mark.parametrize(("backend", "router_dtype"), [("triton", torch.bfloat16), ("torch", torch.float32)])
def test_the_router_stays_in_the_model_dtype_where_its_kernel_reads_it(
    tiny_source: Path, backend: str, router_dtype: torch.dtype
) -> None:
    """A BF16 engine with the Triton backends keeps the router BF16 for `kernels/router.py` (text layers and the MTP
    layer), and routes one step like the fp32 router of the torch backend; the torch backend keeps it fp32."""
    from glmquant.runtime.dummy import dummy_artifact
    from glmquant.runtime.engine import Engine
    from glmquant.runtime.engine.weights import MoEBlock
    from glmquant.runtime.options import RuntimeOptions

    device = kernel_device()
    artifact = dummy_artifact(tiny_source, device=device)
    engine = Engine.load(
        artifact, RuntimeOptions(device=device, dtype="bfloat16", backend=backend), max_len=16, mtp=True
    )
    blocks = [lw.mlp for lw in engine.weights.layers if isinstance(lw.mlp, MoEBlock)]
    assert engine.mtp is not None and blocks
    assert {b.router.dtype for b in blocks} == {router_dtype} and engine.mtp.mlp.router.dtype == router_dtype
    cfg, block = engine.cfg, blocks[0]
    hidden = torch.randn(2, cfg.hidden, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(device=block.router.device, dtype=torch.bfloat16)  # where the engine keeps its weights
    ids, weights = engine.decode_run.ops.route(hidden, block.router, block.bias, cfg.top_k, cfg.routed_scaling, True)
    expected_ids, expected = math.route(hidden, block.router.float(), block.bias, cfg.top_k, cfg.routed_scaling, True)
    assert torch.equal(ids.sort(-1).values, expected_ids.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), expected.sum(-1), rtol=1e-6, atol=1e-6)
