"""Generation: cached incremental decoding equals a full recompute, seeded sampling is deterministic,
and generation stops on EOS ids, stop strings and the token budget."""

from __future__ import annotations

import pytest
import torch

from glmquant.errors import NumericalError, UsageError
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate, next_token

PROMPT = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)  # one letter per token


def test_incremental_decoding_equals_full_recompute(tr3_f32):
    """Each cached decode step's logits equal a fresh forward over the whole prefix (float32, atol 1e-5)."""
    model = tr3_f32.model
    steps: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: steps.append(out[0, -1].clone()))
    try:
        result = generate(model, PROMPT, SamplingParams(max_tokens=10), decode)
    finally:
        hook.remove()
    # 12 + 10 tokens: past index_topk (8), so the DSA indexer's sparse selection and its cache are exercised
    assert result.finish_reason == "length" and len(result.token_ids) == 10 == len(steps)
    sequence = PROMPT.input_ids[0].tolist() + list(result.token_ids)
    with torch.no_grad():
        for i, step in enumerate(steps):
            prefix = torch.tensor([sequence[: PROMPT.num_tokens + i]])
            full = model(input_ids=prefix).logits[0, -1]
            torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
            assert int(full.argmax()) == result.token_ids[i]  # greedy picks the recomputed argmax


def test_sampling_is_deterministic_for_a_seed(tr3_f32):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    first = generate(tr3_f32.model, PROMPT, params, decode)
    again = generate(tr3_f32.model, PROMPT, params, decode)
    other = generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=8), decode)
    greedy = generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=10), decode)
    assert first.token_ids == again.token_ids and first.text == again.text
    assert other.token_ids != first.token_ids != greedy.token_ids  # 10 draws over ~300 tokens


def test_stops_on_eos_ids_stop_strings_and_budget(tr3_f32):
    greedy = generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=8), decode)
    assert (greedy.finish_reason, greedy.completion_tokens, greedy.prompt_tokens) == ("length", 8, 12)
    eos = generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(greedy.token_ids[3],)), decode)
    assert eos.finish_reason == "stop" and eos.token_ids == greedy.token_ids[:3]
    streamed: list[str] = []
    stop = greedy.text[4:6]
    cut = generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=8, stop=(stop,)), decode, streamed.append)
    assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.find(stop)]
    assert "".join(streamed) == cut.text


def test_non_finite_logits_stop_generation_with_a_clear_error(tr3_f32):
    """A NaN from the third forward (an overflowed activation, say) raises instead of sampling garbage tokens."""
    calls = []

    def poison(mod, args, out):
        calls.append(1)
        return out.index_fill(-1, torch.tensor([5]), float("nan")) if len(calls) == 3 else out

    hook = tr3_f32.model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(NumericalError, match="after 2 generated tokens hold 1 NaN/Inf values"):
            generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=8), decode)
    finally:
        hook.remove()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    draws = {next_token(logits, SamplingParams(temperature=1.0, top_p=0.7), gen) for _ in range(200)}
    assert draws == {0, 1}
    assert next_token(logits, SamplingParams(), gen) == 0


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(UsageError):
        SamplingParams(**bad)
