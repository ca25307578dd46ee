"""CUDA: the streamed forward equals transformers' on the GPU, and an observation on CUDA is
deterministic (a resumed GPU run must be byte-identical) and agrees with the CPU one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from observe_helpers import killed_at_layer_2, observe_config

from glmquant.observe.hessian_reader import load_layer_hessians
from glmquant.observe.run import observe
from glmquant.observe.stats import LayerStats, stats_path
from glmquant.observe.streaming import stream_final_hidden

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_stream_on_cuda_equals_full_model_on_cuda(tiny_source: Path) -> None:
    from transformers import Glm5NextForConditionalGeneration

    loaded: Any = Glm5NextForConditionalGeneration.from_pretrained(str(tiny_source), dtype=torch.bfloat16)
    model = loaded.cuda().eval()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.model(input_ids=ids.cuda()).last_hidden_state
    got = stream_final_hidden(tiny_source, ids, device="cuda")
    assert got.device.type == "cuda" and torch.equal(got, want)


def test_cuda_observation_is_deterministic_and_matches_cpu(tiny_source: Path, observed: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    summary = observe(observe_config(tiny_source, a, device="cuda"))
    observe(observe_config(tiny_source, b, device="cuda"))
    assert summary.peak_device_bytes and summary.peak_device_bytes > 0
    for path in sorted(a.glob("layer-*.safetensors")) + [a / "prune_plan.json"]:
        assert path.read_bytes() == (b / path.name).read_bytes(), path.name
    for layer in (1, 2):
        gpu, cpu = LayerStats.load(stats_path(a, layer)), LayerStats.load(stats_path(observed, layer))
        assert gpu.tokens == cpu.tokens
        assert (gpu.count - cpu.count).abs().sum() <= 4  # BF16 near-ties may route a token differently
        torch.testing.assert_close(gpu.reap, cpu.reap, rtol=0.05, atol=0)
        shared_gpu = load_layer_hessians(a, layer, "all").gate_up(0).sum
        shared_cpu = load_layer_hessians(observed, layer, "all").gate_up(0).sum
        assert (shared_gpu - shared_cpu).abs().max() <= 0.02 * shared_cpu.abs().max()


def test_cuda_stream_checkpoints_hold_what_the_run_computed(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint writer copies the device streams to the host on a CUDA stream of its own while the run goes
    on: a run killed as it starts layer 2 resumes from that checkpoint to the bytes of an uninterrupted run; without
    checkpoints, from the streams recomputed from the embeddings (a plain forward through layers 0 and 1)."""
    want = tmp_path / "want"
    observe(observe_config(tiny_source, want, device="cuda", device_streams_every=0))
    for every, recomputed_from in ((1, 2), (0, 0)):
        got = tmp_path / f"got-{every}"
        killed_at_layer_2(monkeypatch, observe_config(tiny_source, got, device="cuda", device_streams_every=every))
        summary = observe(observe_config(tiny_source, got, device="cuda", device_streams_every=every))
        assert (summary.resumed_from_layer, summary.streams_recomputed_from) == (2, recomputed_from)
        for path in sorted(want.glob("layer-*.safetensors")) + [want / "prune_plan.json"]:
            assert path.read_bytes() == (got / path.name).read_bytes(), (every, path.name)
