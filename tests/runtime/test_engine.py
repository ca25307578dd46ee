"""The runtime's own forward (`runtime.engine`) against transformers' modules on the tiny artifacts: every logit of a
chunked prefill and of each decode step to float32 rounding, the same greedy tokens, and batched decode steps equal
to the same sequences decoded alone. The 19-token prompt runs past index_topk (8), so the DSA indexer selects."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from indexer_ties import indexer_ties_to_earlier_pool

from glmquant.runtime.artifact import Artifact, open_artifact
from glmquant.runtime.dummy import dummy_artifact
from glmquant.runtime.engine import Engine, EngineDecoder
from glmquant.runtime.engine.cache import KDACache
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions

PROMPT = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 5, 7, 9, 11, 200, 201, 33]]))
F32 = RuntimeOptions(dtype="float32")


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)


class Recording(EngineDecoder):
    """An EngineDecoder that keeps every logits vector it returns."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.logits: list[torch.Tensor] = []

    def prefill(self, prompt: PromptInputs) -> torch.Tensor:
        return self._keep(super().prefill(prompt))

    def step(self, token: int) -> torch.Tensor:
        return self._keep(super().step(token))

    def _keep(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.clone())
        return logits


def transformers_logits(path: Path | Artifact, steps: int) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    model = load_model(path, F32).model
    seen: list[torch.Tensor] = []
    hook = model.get_submodule("lm_head").register_forward_hook(lambda mod, args, out: seen.append(out[0, -1].clone()))
    try:
        with indexer_ties_to_earlier_pool():  # the engine's tie rule (indexer_ties.py)
            tokens = generate(model, PROMPT, SamplingParams(max_tokens=steps), decode).token_ids
    finally:
        hook.remove()
    return seen, tokens


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_engine_reproduces_transformers_logits_and_greedy_tokens(artifacts: dict[str, Path], layout: str) -> None:
    expected, expected_tokens = transformers_logits(artifacts[layout], steps=12)
    engine = Engine.load(open_artifact(artifacts[layout]), F32, max_batch=1, max_len=64)
    recording = Recording(engine)
    tokens = generate(recording, PROMPT, SamplingParams(max_tokens=12), decode).token_ids
    assert tokens == expected_tokens
    assert len(recording.logits) == len(expected) == 12
    for ours, theirs in zip(recording.logits, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_chunked_prefill_equals_one_chunk(artifacts: dict[str, Path]) -> None:
    engine = Engine.load(open_artifact(artifacts["tr3"]), F32, max_batch=1, max_len=64)
    whole = engine.prefill(0, PROMPT.input_ids[0])
    for chunk in (1, 4, 7):
        torch.testing.assert_close(engine.prefill(0, PROMPT.input_ids[0], chunk=chunk), whole, rtol=0, atol=1e-5)


def test_warm_up_leaves_no_trace_in_later_output(artifacts: dict[str, Path]) -> None:
    """A server's start-up warm-up (a prefill and three decode steps in slot 0) changes no later logit."""
    artifact = open_artifact(artifacts["tr3"])
    fresh = _greedy(Engine.load(artifact, F32, max_batch=1, max_len=64), PROMPT.input_ids[0], 4)
    warmed = Engine.load(artifact, F32, max_batch=1, max_len=64)
    warmed.warm_up(prompt_tokens=20)
    assert all(not c.state.any() for c in warmed.caches.layers if isinstance(c, KDACache))  # slot 0 reset
    for ours, theirs in zip(_greedy(warmed, PROMPT.input_ids[0], 4), fresh, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_caches_that_did_not_fit_can_be_asked_for_again_smaller(
    artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reallocation that runs out of memory leaves the engine able to reallocate (the benchmark then measures the
    sizes that fit): the next, smaller one gives the same logits as a fresh engine of that size."""
    from glmquant.runtime.engine import model as engine_model

    artifact = open_artifact(artifacts["tr3"])
    engine = Engine.load(artifact, F32, max_batch=1, max_len=64)
    allocate = engine_model.Caches.allocate

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("caches of 16 sequences do not fit")

    monkeypatch.setattr(engine_model.Caches, "allocate", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.reallocate(16, 4096)
    monkeypatch.setattr(engine_model.Caches, "allocate", allocate)
    engine.reallocate(1, 48)
    fresh = _greedy(Engine.load(artifact, F32, max_batch=1, max_len=48), PROMPT.input_ids[0], 3)
    for ours, theirs in zip(_greedy(engine, PROMPT.input_ids[0], 3), fresh, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_batched_decode_equals_each_sequence_alone(artifacts: dict[str, Path]) -> None:
    """Two prompts of different lengths in slots 0 and 1 step together as they step alone."""
    engine = Engine.load(open_artifact(artifacts["tr3"]), F32, max_batch=2, max_len=64)
    prompts = [PROMPT.input_ids[0], PROMPT.input_ids[0, 3:14]]
    alone = [_greedy(engine, prompt, 6) for prompt in prompts]
    for slot, prompt in enumerate(prompts):
        engine.prefill(slot, prompt)
    lengths = [p.numel() for p in prompts]
    tokens = torch.tensor([int(seq[0].argmax()) for seq in alone])
    for step in range(1, 6):
        positions = torch.tensor(lengths) + step - 1
        logits = engine.decode(tokens, positions, int(positions.max()) + 1)
        for slot in range(2):
            torch.testing.assert_close(logits[slot], alone[slot][step], rtol=0, atol=1e-5)
        tokens = logits.argmax(dim=-1)


@pytest.mark.slow
def test_compiled_decode_math_equals_eager(artifacts: dict[str, Path]) -> None:
    """torch.compile'd decode math (engine/ops.py) gives the eager logits (here inductor's C++; Triton on CUDA)."""
    artifact = open_artifact(artifacts["tr3"])
    engines = [
        Engine.load(artifact, replace(F32, model_impl="glmquant", compile_decode=compiled), max_len=64)
        for compiled in (False, True)
    ]
    for batch in (1, 2):  # a second shape: dynamic dims after the first recompile
        logits = [_greedy(engine, PROMPT.input_ids[0, : 12 + batch], 3) for engine in engines]
        for eager, compiled in zip(*logits):
            torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


def _greedy(engine: Engine, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of the prompt and of `steps` - 1 greedy tokens, decoded alone in slot 0."""
    out = [engine.prefill(0, prompt)]
    for i in range(steps - 1):
        position = prompt.numel() + i
        out.append(engine.decode(out[-1].argmax().view(1), torch.tensor([position]), position + 1)[0].clone())
    return out


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_with_graphs_decodes_like_the_cpu_reference(artifacts: dict[str, Path]) -> None:
    """On CUDA: resident Triton experts, fla's KDA when installed, the fused mHC kernel and whole-step graphs give
    the CPU reference's greedy tokens (logits within the GEMV core's fp16 error), and the same tokens eagerly."""
    expected, expected_tokens = transformers_logits(artifacts["tr3"], steps=12)
    options = RuntimeOptions(device="cuda", dtype="float32", backend="triton")
    engine = Engine.load(open_artifact(artifacts["tr3"]), options, max_batch=1, max_len=64)
    recording = Recording(engine)
    assert generate(recording, PROMPT, SamplingParams(max_tokens=12), decode).token_ids == expected_tokens
    assert engine.graphs is not None and engine.graphs.captured == 1
    for ours, theirs in zip(recording.logits, expected):
        scale = theirs.abs().max()
        torch.testing.assert_close(ours.cpu() / scale, theirs / scale, rtol=0, atol=5e-3)
    eager = [int(engine.prefill(0, PROMPT.input_ids[0]).argmax())]
    for i in range(11):
        position = PROMPT.num_tokens + i
        token = torch.tensor([eager[-1]], device="cuda")
        eager.append(
            int(engine.decode(token, torch.tensor([position], device="cuda"), position + 1, eager=True)[0].argmax())
        )
    assert tuple(eager) == expected_tokens


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_engine_prefill_matches_transformers_on_cuda(artifacts: dict[str, Path]) -> None:
    options = RuntimeOptions(device="cuda", dtype="bfloat16", backend="triton")
    reference = load_model(artifacts["tr3"], options).model
    with torch.no_grad():
        want = reference(input_ids=PROMPT.input_ids.cuda()).logits[0, -1].float()
    engine = Engine.load(open_artifact(artifacts["tr3"]), options, max_batch=1, max_len=64)
    got = engine.prefill(0, PROMPT.input_ids[0]).float()
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=3e-2)  # bf16 rounding in another order


def test_engine_runs_the_speed_tier_like_transformers(tiny_source: Path) -> None:
    """A dummy `--retained-bits 4 --head-bits 6` artifact: the engine decodes its EXL3 retained linears and head once
    at load, as the transformers-module runtime's torch path does, so logits match to float32 rounding and greedy
    tokens are equal."""
    artifact = dummy_artifact(tiny_source, retained_bits=4, head_bits=6)
    assert len(artifact.retained_linears) > 1 and "lm_head" in artifact.retained_linears
    expected, expected_tokens = transformers_logits(artifact, steps=8)
    engine = Engine.load(artifact, F32, max_batch=1, max_len=64)
    recording = Recording(engine)
    tokens = generate(recording, PROMPT, SamplingParams(max_tokens=8), decode).token_ids
    assert tokens == expected_tokens
    for ours, theirs in zip(recording.logits, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
