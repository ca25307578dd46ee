"""Long-context and speed prompts: sized with the model's tokenizer, needles placed and counted, scoring."""

from __future__ import annotations

import json
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glmquant.errors import UsageError
from glmquant.fixtures.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_tokenizer
from glmquant.servecheck.chat import ChatResult, Speculation, Timings, Usage
from glmquant.servecheck.haystack import filler_sentences
from glmquant.servecheck.needle import DEPTHS, NAMES, QUESTION, build_needle_prompt, score_needle
from glmquant.servecheck.speed import ASK, build_speed_requests, score_cell
from glmquant.servecheck.tokens import PromptTokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> PromptTokenizer:
    """The tiny model's byte-level tokenizer (one token per byte: counts add up exactly)."""
    return PromptTokenizer(build_tiny_tokenizer())


@pytest.fixture(scope="module")
def bpe_tokenizer() -> PromptTokenizer:
    """A byte-level BPE trained on filler text, so merges make token counts not add up across pieces."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    stream = filler_sentences(99)
    corpus = [" ".join(next(stream) for _ in range(20)) for _ in range(300)] + [QUESTION, ASK]
    trainer = trainers.BpeTrainer(
        vocab_size=1200, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return PromptTokenizer(tok)


@pytest.mark.parametrize("target", [3000, 20000])
@pytest.mark.parametrize("which", ["byte_tokenizer", "bpe_tokenizer"])
def test_needle_prompt_is_sized_and_placed(which: str, target: int, request: pytest.FixtureRequest) -> None:
    tokenizer: PromptTokenizer = request.getfixturevalue(which)
    prompt = build_needle_prompt(tokenizer, target, seed=7)
    text = prompt.request.messages[0]["content"]
    assert target - 3 <= prompt.prompt_tokens <= target
    assert prompt.prompt_tokens == tokenizer.count(prompt.request.messages)
    assert text.startswith(f"Session {prompt.nonce}.")
    records = re.findall(r"Registry record: (\w+) has retrieval value ([0-9a-f]{16})\.", text)
    assert records == list(prompt.expected.items()) and [name for name, _ in records] == list(NAMES)
    assert text.count("Registry record") == 4 and text.endswith(QUESTION)
    assert list(prompt.positions) == sorted(prompt.positions)
    slack = 0.05 if target < 10000 else 0.01  # sentence granularity relative to the haystack
    for depth, want in zip(prompt.depths, DEPTHS):
        assert abs(depth - want) <= slack, (prompt.depths, DEPTHS)


def test_needle_prompt_is_reproducible_from_its_seed(byte_tokenizer: PromptTokenizer) -> None:
    a, b = build_needle_prompt(byte_tokenizer, 2500, seed=3), build_needle_prompt(byte_tokenizer, 2500, seed=3)
    c = build_needle_prompt(byte_tokenizer, 2500, seed=4)
    assert a == b
    assert c.nonce != a.nonce and c.expected != a.expected


def test_too_short_a_needle_prompt_is_a_usage_error(byte_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(UsageError, match="shorter than its fixed part"):
        build_needle_prompt(byte_tokenizer, 100, seed=0)


def answered(
    prompt, values: dict[str, str], prompt_tokens: int, cached: int | None = 0, finish: str = "stop"
) -> ChatResult:
    return ChatResult(
        json.dumps(values),
        "I found four records.",
        (),
        finish,
        Usage(prompt_tokens, 60, cached),
        Timings(0.0, 5.0, 6.0, 6.0),
    )


def test_needle_scoring(byte_tokenizer: PromptTokenizer) -> None:
    prompt = build_needle_prompt(byte_tokenizer, 2500, seed=11)
    n = prompt.prompt_tokens
    assert score_needle(answered(prompt, prompt.expected, n + 3), prompt, tolerance=8).passed
    off = score_needle(answered(prompt, prompt.expected, n + 40), prompt, tolerance=8)
    assert not off.passed and f"server counted {n + 40} prompt tokens" in off.reason
    cached = score_needle(answered(prompt, prompt.expected, n, cached=2048), prompt, tolerance=8)
    assert not cached.passed and "prefix-cache hit: 2048" in cached.reason
    wrong = dict(prompt.expected, cobalt="0" * 16)
    partial = score_needle(answered(prompt, wrong, n), prompt, tolerance=8)
    assert not partial.passed and partial.reason.startswith("3/4 values right")
    truncated = score_needle(answered(prompt, prompt.expected, n, finish="length"), prompt, tolerance=8)
    assert not truncated.passed and "truncated" in truncated.reason
    no_usage = ChatResult(json.dumps(prompt.expected), "", (), "stop", None, Timings(0.0, 1.0, 2.0, 2.0))
    assert "sent no usage" in score_needle(no_usage, prompt, tolerance=8).reason


def test_speed_requests_and_cell_scoring(bpe_tokenizer: PromptTokenizer) -> None:
    requests = build_speed_requests(bpe_tokenizer, 1500, concurrency=3, seed=5, max_tokens=32)
    nonces = {r.request.messages[0]["content"].split(".")[0] for r in requests}
    assert len(nonces) == 3  # no stream can hit another's prefix cache
    for r in requests:
        assert 1497 <= r.prompt_tokens <= 1500 and r.request.max_tokens == 32
        assert r.request.messages[0]["content"].endswith(ASK)
    good = [
        ChatResult("1. Fact.", "", (), "length", Usage(r.prompt_tokens, 32), Timings(0.0, 0.5, 2.1, 2.1))
        for r in requests
    ]
    verdict, metrics = score_cell(good, requests, wall_s=2.2, tolerance=8)
    assert verdict.passed, verdict.reason
    assert metrics.ttft_s == pytest.approx(0.5) and metrics.decode_tps == pytest.approx(32 / 1.6)
    assert metrics.aggregate_tps == pytest.approx(96 / 2.2) and metrics.completion_tokens == 96
    assert metrics.acceptance_rate is None and metrics.tokens_per_step is None  # a server without speculation
    # all 8 tokens in one chunk (or as no text at all): no span to time, so the stream's wall bounds the rate
    burst = ChatResult("1. Fact.", "", (), "length", Usage(1500, 8), Timings(0.0, 0.2, 0.2, 0.25))
    silent = ChatResult("", "", (), "length", Usage(1500, 8), Timings(0.0, None, None, 0.4))
    assert burst.decode_tps == pytest.approx(8 / 0.25) and silent.decode_tps == pytest.approx(8 / 0.4)
    assert ChatResult("", "", (), "length", Usage(1500, 0), Timings(0.0, None, None, 0.4)).decode_tps is None
    drafts = (Speculation(10, 20, 11), Speculation(12, 24, 9), None)  # the third stream reports none
    speculated = [
        ChatResult("1. Fact.", "", (), "length", Usage(r.prompt_tokens, 32, None, s), Timings(0.0, 0.5, 2.1, 2.1))
        for r, s in zip(requests, drafts)
    ]
    verdict, metrics = score_cell(speculated, requests, wall_s=2.2, tolerance=8)
    assert verdict.passed and metrics.acceptance_rate == pytest.approx(20 / 44)
    assert metrics.tokens_per_step == pytest.approx((20 + 22) / 22)
    bad = good[:2] + [ChatResult(error="APITimeoutError: Request timed out.", timings=Timings(0.0, None, None, 9.0))]
    verdict, metrics = score_cell(bad, requests, wall_s=9.0, tolerance=8)
    assert not verdict.passed and verdict.reason == "stream 2: request failed: APITimeoutError: Request timed out."
    assert metrics.ttft_max_s == pytest.approx(0.5)
