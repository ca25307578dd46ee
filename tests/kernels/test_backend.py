"""The registered GPU expert backends on a tiny tr3 artifact: same outputs as the torch backend, graphs replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_helpers import kernel_device, rel_err

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from glmquant.fixtures.random_artifact import build_artifact
from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.loader import make_backend
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import expand_routes
from glmquant.runtime.torch_backend import TorchExpertBackend


@pytest.fixture(scope="module")
def tr3_artifact(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(tiny_source, tmp_path_factory.mktemp("kernels-tr3") / "artifact", "tr3")


def _routes(artifact, tokens: int, seed: int):
    spec, gen = artifact.spec, torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, spec.hidden_size, generator=gen)
    top = torch.stack(
        [torch.randperm(spec.n_routed_experts, generator=gen)[: spec.num_experts_per_tok] for _ in range(tokens)]
    )
    return (
        hidden,
        *expand_routes(top, torch.rand(tokens, spec.num_experts_per_tok, generator=gen) * 2.5, artifact.ranks),
    )


@pytest.mark.slow
def test_triton_backend_matches_torch_backend(tr3_artifact):
    device = kernel_device()
    artifact = open_artifact(tr3_artifact)
    ours = make_backend(artifact, RuntimeOptions(device=device, dtype="float32", backend="triton-eager"))
    ref = TorchExpertBackend(artifact, cache_size=0, dtype=torch.float32)
    for layer in artifact.quantized_layers:
        hidden, ids, weights = _routes(artifact, tokens=3, seed=layer)
        want = ref.forward(layer, hidden, ids, weights)
        got = ours.forward(layer, hidden.to(device), ids.to(device), weights.to(device))
        assert want.abs().max() > 0.05
        assert rel_err(got, want) < 2e-3  # the torch backend decodes W with ExLlamaV3's fp16 rounding steps
    stats = ours.stats()
    assert stats.hits == 2 * 3 * artifact.spec.num_experts_per_tok * artifact.ranks and stats.misses == 0


@pytest.mark.gpu
def test_graph_replays_follow_new_inputs(tr3_artifact):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    artifact = open_artifact(tr3_artifact)
    graphed = make_backend(artifact, RuntimeOptions(device="cuda", dtype="float32", backend="triton"))
    eager = make_backend(artifact, RuntimeOptions(device="cuda", dtype="float32", backend="triton-eager"))
    layer = artifact.quantized_layers[0]
    for seed in range(4):  # eager, capture, replay, replay: every call sees fresh routes
        hidden, ids, weights = (t.cuda() for t in _routes(artifact, tokens=2, seed=seed))
        got = graphed.forward(layer, hidden, ids, weights).clone()
        torch.testing.assert_close(got, eager.forward(layer, hidden, ids, weights), rtol=0, atol=0)
    assert graphed.graphs.captured == 1


@pytest.mark.gpu
def test_tiny_artifact_decodes_on_cuda_with_graphs_like_the_torch_backend(tr3_artifact):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
    from glmquant.runtime.loader import load_model

    prompt = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))
    tokens = {}
    for device, backend in (("cuda", "triton"), ("cuda", "torch")):
        loaded = load_model(tr3_artifact, RuntimeOptions(device=device, dtype="float32", backend=backend))
        tokens[backend] = generate(loaded.model, prompt, SamplingParams(max_tokens=16), lambda ids: "").token_ids
        if backend == "triton":
            assert loaded.backend.graphs.captured >= 1  # prefill and decode steps replayed from graphs
    assert tokens["triton"] == tokens["torch"]
