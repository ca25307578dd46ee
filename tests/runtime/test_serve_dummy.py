"""`serve --load-format dummy`: a bare config directory (no weights, no tokenizer) is served by the runtime's own
forward or by transformers' modules and answers OpenAI requests, concurrent sequences kept apart (the engine: in
its cache slots); on a real artifact the engine's greedy answers equal transformers' modules'."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from glmquant.runtime.server import serve_in_background


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["glmquant", "transformers"])
def test_dummy_weights_answer_openai_requests(tiny_source: Path, tmp_path: Path, impl: str) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_source / "config.json", bare / "config.json")
    prompts = [[{"role": "user", "content": f"question {i} " * (i + 1)}] for i in range(3)]
    with serve_in_background(bare, load_format="dummy", model_impl=impl, max_model_len=256, max_num_seqs=2) as running:
        client = _client(running.base_url)

        def ask(m):
            return client.chat.completions.create(model="bare", messages=m, max_tokens=5)

        first = ask(prompts[0])
        assert first.choices[0].finish_reason == "length"
        assert first.usage is not None and first.usage.completion_tokens == 5
        text = client.completions.create(model="bare", prompt=[256, 10, 20, 30], max_tokens=3)
        assert text.usage is not None and text.usage.completion_tokens == 3

        def content(m):
            return ask(m).choices[0].message.content

        sequential = [content(m) for m in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:  # 3 requests on 2 cache slots
            assert list(pool.map(content, prompts)) == sequential
        assert running.service.health()["status"] == "ok"


@pytest.mark.slow
def test_engine_answers_like_transformers_on_an_artifact(artifacts: dict[str, Path]) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something about the sea."}]
    answers = []
    for impl in ("transformers", "glmquant"):
        with serve_in_background(artifacts["tr3"], model_impl=impl, dtype="float32", max_model_len=128) as running:
            reply = _client(running.base_url).chat.completions.create(
                model="tiny-EXL3-2bit", messages=messages, max_tokens=8
            )
            assert reply.usage is not None
            answers.append((reply.choices[0].message.content, reply.usage.completion_tokens))
    assert answers[0] == answers[1]
