"""`glmquant serve` end to end with the official openai client: streaming and not, with and without tools,
reasoning apart from content, usage counts, text completions, tokenize/detokenize, metrics, and bad requests
answered as vLLM's server answers them (status, `param`, the openai client's exception) while it keeps serving.

The tiny model's weights are random, so tests that need known output script the next tokens with a hook on
lm_head (the whole forward still runs; only the logits are replaced)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from runtime_media import image_message, png_data_url

import glmquant
from glmquant.runtime.loader import LoadedModel
from glmquant.runtime.server import RunningServer, serve_in_background

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "country"],
                "additionalProperties": False,
            },
        },
    }
]
HELLO = [{"role": "user", "content": "Say hello."}]


class Script:
    """Replaces the next logits so the model 'says' a given text, then its first EOS id."""

    def __init__(self, server: RunningServer) -> None:
        self.tokenizer = server.service.chat.tokenizer
        self.eos = server.service.defaults.stop_token_ids[0]
        self.queue: list[int] = []
        loaded = server.service.loaded
        assert isinstance(loaded, LoadedModel)  # served by transformers' modules
        loaded.model.get_submodule("lm_head").register_forward_hook(self._hook)

    def say(self, text: str) -> None:
        self.queue = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]

    def _hook(self, module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        if not self.queue:
            return None
        forced = torch.full_like(out, -1e4)
        forced[..., self.queue.pop(0)] = 1e4
        return forced


@pytest.fixture(scope="module")
def server(artifacts) -> Iterator[RunningServer]:
    with serve_in_background(
        artifacts["tr3"], expert_cache=16, max_model_len=1024, served_model_name="tiny"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def module_script(server) -> Script:
    return Script(server)


@pytest.fixture
def script(module_script: Script) -> Iterator[Script]:
    """The module's script with an empty queue: a test that failed midway leaves no forced tokens behind."""
    module_script.queue.clear()
    yield module_script
    module_script.queue.clear()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_health_and_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = _get(server, "/health")
    assert health["status"] == "ok" and health["layout"] == "tr3" and "hit_rate" in health["expert_cache"]
    counted = _post(server, "/tokenize", {"messages": HELLO})[1]
    assert counted["count"] == len(counted["tokens"]) > 3 and counted["max_model_len"] == 1024


@pytest.mark.slow
def test_plain_completion_and_usage(server, client, script):
    script.say("<think>greet them</think>\nFINAL_BASELINE_OK")
    r = client.chat.completions.create(model="tiny", messages=HELLO, temperature=0)
    choice = r.choices[0]
    assert choice.message.content == "FINAL_BASELINE_OK" and choice.finish_reason == "stop"
    assert choice.message.reasoning_content == "greet them"
    prompt_tokens = _post(server, "/tokenize", {"messages": HELLO})[1]["count"]
    script_tokens = len(
        script.tokenizer.encode("<think>greet them</think>\nFINAL_BASELINE_OK", add_special_tokens=False)
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, script_tokens)


def test_ignore_eos_generates_past_the_end_of_sequence(server, script):
    """vLLM's `ignore_eos`: the scripted EOS does not end the completion, max_tokens does ("length")."""
    said = len(script.tokenizer.encode("OK", add_special_tokens=False))
    body = {"messages": HELLO, "temperature": 0, "max_tokens": said + 3}
    script.say("OK")
    ended = _post(server, "/v1/chat/completions", body)[1]
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == said
    script.say("OK")
    went_on = _post(server, "/v1/chat/completions", {**body, "ignore_eos": True})[1]
    assert went_on["choices"][0]["finish_reason"] == "length" and went_on["usage"]["completion_tokens"] == said + 3


@pytest.mark.slow
def test_streaming_with_usage_matches_non_streaming(client, script):
    text = "<think>hmm</think>Witaj, świecie 你好，世界 مرحبا بالعالم"
    script.say(text)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=HELLO, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Witaj, świecie 你好，世界 مرحبا بالعالم"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hmm"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        script.tokenizer.encode(text, add_special_tokens=False)
    )


@pytest.mark.slow
def test_tool_call_non_streaming(client, script):
    script.say(
        "<think>use the tool</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>country</arg_key><arg_value>France</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
        "</tool_call>"
    )
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris, France?"}], tools=TOOLS, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "country": "France", "days": 2}


@pytest.mark.slow
def test_tool_call_streaming(client, script):
    script.say(
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>country</arg_key><arg_value>Norway</arg_value></tool_call>"
    )
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "country": "Norway"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_unscripted_sampling_is_seeded(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=6, temperature=1.0, seed=5)
    first, again = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 6
    assert first.choices[0].message.content == again.choices[0].message.content


def test_image_request(client, script):
    script.say("red")
    r = client.chat.completions.create(model="tiny", messages=[image_message(png_data_url((255, 0, 0)))])
    text = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What colour is this?"}], max_tokens=1
    )
    assert r.choices[0].message.content == "red"
    assert r.usage.prompt_tokens == text.usage.prompt_tokens + 6  # 4 image tokens + begin/end markers


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, status, param, fragment",
    [
        (b"{not json", 400, None, "not valid JSON"),
        ({"model": "gpt-4", "messages": HELLO}, 404, "model", "does not exist"),
        (
            {"messages": [{"role": "user", "content": "x " * 600}]},
            400,
            "input_tokens",
            "maximum context length is 1024",
        ),
        ({"messages": HELLO, "max_tokens": 1020}, 400, "max_tokens", "'max_completion_tokens' is too large"),
        ({"messages": [image_message("data:image/png;base64,aGVsbG8=")]}, 400, "messages", "could not be decoded"),
        ({"messages": [image_message("data:image/png;base64,@@@")]}, 400, "messages", "not valid base64"),
        ({"messages": []}, 400, "messages", "at least 1 item"),
        ({"messages": HELLO, "temperature": "hot"}, 400, "temperature", "valid number"),
        ({"messages": HELLO, "top_p": 0}, 400, "top_p", "greater than 0"),
        ({"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "Input should be"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "valid"),
        ({"messages": [HELLO[0], {"content": "no role"}]}, 400, "messages[1].role", "Field required"),
        (
            {"messages": HELLO, "tools": [{"type": "function", "function": {}}]},
            400,
            "tools[0].function.name",
            "required",
        ),
        ([1, 2], 400, None, "valid dictionary"),
        ({"messages": HELLO, "seed": 2**64}, 400, "seed", "less than or equal to 9223372036854775807"),
        ({"messages": HELLO, "seed": -(2**63) - 1}, 400, "seed", "greater than or equal to"),
        ({"messages": HELLO, "stream_options": {"include_usage": True}}, 400, "stream_options", "`stream=True`"),
    ],
)
def test_bad_requests_get_vllms_status_and_param_and_the_server_keeps_serving(
    server, client, script, body, status, param, fragment
):
    got, error = _post(server, "/v1/chat/completions", body)
    assert (got, error["error"]["param"], error["error"]["code"]) == (status, param, status), error
    assert fragment in error["error"]["message"] and "object at 0x" not in error["error"]["message"]
    assert set(error["error"]) == {"message", "type", "param", "code"}
    script.say("still here")
    assert client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == "still here"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"top_k": 5}, "top_k"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_unsupported_parameters_are_400_not_supported(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, max_tokens=1, extra_body=extra)
    assert caught.value.body["param"] == param and "is not supported" in caught.value.body["message"]


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=1,
        n=1,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        tool_choice="auto",
        tools=TOOLS,
        extra_body={"top_k": -1, "unknown_field": 1},
    )
    assert r.usage.completion_tokens == 1


# What the `openai` client raises against vLLM's OpenAI server for the same bad requests: invalid fields,
# unknown model, a prompt or max_tokens beyond the context, a wrong API key.
VLLM_EXCEPTIONS = [
    ({"temperature": "hot"}, openai.BadRequestError),
    ({"messages": [{"role": "wizard", "content": "x"}]}, openai.BadRequestError),
    ({"model": "no-such-model"}, openai.NotFoundError),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, openai.BadRequestError),
    ({"max_tokens": 5000}, openai.BadRequestError),
    ({"max_completion_tokens": 5000}, openai.BadRequestError),
    ({"top_p": 2}, openai.BadRequestError),
]


@pytest.mark.parametrize("change, raised", VLLM_EXCEPTIONS)
def test_openai_client_raises_what_it_raises_against_vllm(client, change, raised):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**{"model": "tiny", "messages": HELLO, **change})
    assert type(caught.value) is raised


def test_api_key_is_required_on_v1_routes(artifacts):
    with serve_in_background(artifacts["tr3"], api_key="sesame", expert_cache=4) as running:
        wrong = openai.OpenAI(base_url=running.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=running.base_url, api_key="sesame", max_retries=0)
        assert [m.id for m in right.models.list().data] == ["tiny-EXL3-2bit"]  # the artifact's name
        assert _get(running, "/health")["status"] == "ok"  # outside /v1: open


def test_methods_and_routes_answer_json_errors(server):
    for method, path, status in [
        ("GET", "/v1/chat/completions", 405),
        ("PUT", "/v1/models", 405),
        ("PATCH", "/tokenize", 405),
        ("DELETE", "/v1/embeddings", 404),
        ("POST", "/v1/embeddings", 404),
        ("OPTIONS", "/nothing", 404),
    ]:
        got, body, headers = _request(server, method, path)
        assert got == status and body["error"]["code"] == status, (method, path, got, body)
        assert headers["content-type"] == "application/json"
    assert "POST" in _request(server, "GET", "/v1/chat/completions")[2]["allow"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present: video works")
def test_video_without_the_server_package_is_a_5xx(server, client, script):
    """A package the server lacks is the server's gap (501), not a bad request (4xx)."""
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    got, error = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [video]}]})
    assert got == 501 and "torchvision" in error["error"]["message"]
    script.say("still here")
    assert client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == "still here"


def test_bodies_not_declared_json_are_415(server):
    """vLLM's `validate_json_request`: a JSON route refuses any other media type (a form, text, none at all)."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        conn = http.client.HTTPConnection(*server.address, timeout=30)
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": HELLO}).encode(), headers)
        response = conn.getresponse()
        body = json.loads(response.read())
        assert response.status == 415 and "Unsupported Media Type" in body["error"]["message"], (content_type, body)
    assert _post(server, "/tokenize", {"prompt": "hi"})[0] == 200  # application/json, with or without a charset


def test_empty_prompts_are_400_before_any_generation(server):
    for body in ({"prompt": "", "max_tokens": 2}, {"prompt": [""], "max_tokens": 2}, {"prompt": "", "stream": True}):
        got, error = _post(server, "/v1/completions", body)
        assert (got, error["error"]["param"]) == (400, "prompt"), (body, error)
        assert "cannot be empty" in error["error"]["message"]


def test_null_asks_for_the_default(client, script):
    """`null` for n, stream, skip_special_tokens and ignore_eos is their default, as vLLM's Optional fields."""
    script.say("plain")
    extra = {"n": None, "stream": None, "skip_special_tokens": None, "ignore_eos": None}
    r = client.chat.completions.create(model="tiny", messages=HELLO, extra_body=extra)
    assert r.choices[0].message.content == "plain" and r.choices[0].finish_reason == "stop"


def test_stream_chunks_carry_usage_only_in_the_usage_chunk(server, script):
    for path, body in (
        ("/v1/chat/completions", {"messages": HELLO}),
        ("/v1/completions", {"prompt": "Say hello."}),
    ):
        for include_usage in (False, True):
            script.say("two words")
            stream = {"stream": True, **({"stream_options": {"include_usage": True}} if include_usage else {})}
            conn = http.client.HTTPConnection(*server.address, timeout=120)
            conn.request("POST", path, json.dumps({**body, **stream}).encode(), {"Content-Type": "application/json"})
            lines = conn.getresponse().read().decode().split("\n\n")
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            with_usage = [c for c in chunks if "usage" in c]
            assert lines[-2] == "data: [DONE]" and len(chunks) > 2, (path, lines)
            if include_usage:  # the last chunk alone, with no choices
                assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
                assert chunks[-1]["usage"]["total_tokens"] > 0
            else:
                assert with_usage == []


def test_a_client_that_leaves_a_non_streamed_request_frees_its_slot(server):
    """The generation is cancelled at its next token, as a closed stream's is, so the next request is not queued
    behind a reply nobody reads (vLLM's `with_cancellation`)."""
    generated = "glmquant:generation_tokens_total"
    before = _metrics(server).get(generated, 0.0)
    conn = http.client.HTTPConnection(*server.address, timeout=120)
    body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 60
    while _get(server, "/health")["requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    conn.close()  # gone before its reply
    left = time.monotonic()
    while _get(server, "/health")["requests_running"] and time.monotonic() < left + 60:
        time.sleep(0.05)
    assert _get(server, "/health")["requests_running"] == 0
    got, reply = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert got == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert _metrics(server)[generated] - before < 1000  # the abandoned generation stopped early (its tokens counted)


def test_oversize_body_is_refused_unread(server):
    conn = http.client.HTTPConnection(*server.address, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "exceeds" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert _get(server, "/health")["status"] == "ok"


def test_prompt_far_beyond_the_context_is_refused_before_tokenizing(server, monkeypatch):
    """4 MB of text cannot fit 1,024 tokens whatever its tokens: answered at once, the tokenizer never runs."""
    calls = []
    tokenizer = server.service.chat.tokenizer
    monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: calls.append(a) or pytest.fail("tokenized"))
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 1_400_000}]})
    text = _post(server, "/v1/completions", {"prompt": "ab " * 1_400_000})
    assert not calls
    assert [(s, e["error"]["param"]) for s, e in (chat, text)] == [(400, "messages"), (400, "prompt")]
    assert "maximum context length is 1024" in chat[1]["error"]["message"]


@pytest.mark.slow
def test_special_tokens_are_stripped_from_content(client, script):
    """As vLLM decodes (skip_special_tokens): GLM-V's box markers and other specials leave the content, the
    reasoning and tool markup still structure the answer."""
    said = '<think>look<|begin_of_box|></think>Answer: <|begin_of_box|>{"a": 1}<|end_of_box|>'
    script.say(said)
    r = client.chat.completions.create(model="tiny", messages=HELLO)
    assert (r.choices[0].message.content, r.choices[0].message.reasoning_content) == ('Answer: {"a": 1}', "look")
    script.say(said)
    chunks = client.chat.completions.create(model="tiny", messages=HELLO, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == 'Answer: {"a": 1}'
    script.say(said)
    kept = client.chat.completions.create(model="tiny", messages=HELLO, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].message.content == 'Answer: <|begin_of_box|>{"a": 1}<|end_of_box|>'


@pytest.mark.slow
def test_text_completions(server, client, script):
    script.say("Paris<|begin_of_box|> is")
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=20)
    prompt_ids = _post(server, "/tokenize", {"prompt": "The capital of France is"})[1]["tokens"]
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.prompt_tokens) == (
        "Paris is",
        "stop",
        len(prompt_ids),
    )
    script.say("Paris is")
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt_ids, max_tokens=20, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Paris is"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids) and chunks[-1].usage.completion_tokens == len("Paris is")
    default = client.completions.create(model="tiny", prompt="x", temperature=1.0, seed=3)
    assert default.usage.completion_tokens == 16 or default.choices[0].finish_reason == "stop"  # OpenAI's default 16
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=1)
    assert caught.value.body["param"] == "prompt"


def test_detokenize_and_version(server):
    ids = _post(server, "/tokenize", {"prompt": "Witaj, świecie <think>"})[1]["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}) == (200, {"prompt": "Witaj, świecie <think>"})
    status, error = _post(server, "/detokenize", {"tokens": [-1, 10**9]})
    assert (status, error["error"]["param"]) == (400, "tokens")
    assert _get(server, "/version") == {"version": glmquant.__version__}


@pytest.mark.slow
def test_metrics_count_requests_tokens_and_latency(server, client, script):
    before = _metrics(server)
    script.say("one two three")
    r = client.chat.completions.create(
        model="tiny", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in r if c.usage][0]
    _post(server, "/v1/chat/completions", {"messages": HELLO, "n": 3})
    after = _metrics(server)

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("glmquant:generation_tokens_total") == usage.completion_tokens
    assert grew("glmquant:prompt_tokens_total") == usage.prompt_tokens
    assert grew('glmquant:request_success_total{finished_reason="stop"}') == 1
    assert grew("glmquant:time_to_first_token_seconds_count") == 1
    assert grew("glmquant:decode_tokens_per_second_count") == 1 and after["glmquant:decode_tokens_per_second_sum"] > 0
    assert grew('glmquant:http_requests_total{handler="/v1/chat/completions",method="POST",status="400"}') == 1
    assert after["glmquant:num_requests_waiting"] == 0 and after["glmquant:num_requests_running"] == 0


def test_served_name_comes_from_the_artifact_not_its_directory(artifacts, tmp_path):
    """A Hugging Face cache snapshot directory is named by its commit; the name served is the artifact's."""
    snapshot = tmp_path / "0123456789abcdef0123456789abcdef01234567"
    snapshot.symlink_to(artifacts["tr3"], target_is_directory=True)
    with serve_in_background(snapshot, expert_cache=4) as running:
        assert [m["id"] for m in _get(running, "/v1/models")["data"]] == ["tiny-EXL3-2bit"]


@pytest.mark.slow
def test_requests_queue_with_one_active_sequence(server, client):
    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, temperature=0)
                .choices[0]
                .finish_reason
            )
        )
        for _ in range(3)
    ]
    before = _get(server, "/health")["requests_served"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["length"] * 3 and _get(server, "/health")["requests_served"] == before + 3


def _request(server: RunningServer, method: str, path: str, body: object = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(*server.address, timeout=120)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read()), {k.lower(): v for k, v in response.getheaders()}


def _get(server: RunningServer, path: str) -> dict:
    return _request(server, "GET", path)[1]


def _post(server: RunningServer, path: str, body: object) -> tuple[int, dict]:
    return _request(server, "POST", path, body)[:2]


def _metrics(server: RunningServer) -> dict[str, float]:
    """Samples as `name{labels but model_name}` -> value."""
    conn = http.client.HTTPConnection(*server.address, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" not in s.labels:
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.mark.slow
def test_concurrent_sequences_match_sequential(artifacts):
    """With two generation slots, interleaved sequences (each with its own cache) give the sequential answers."""
    prompts = [[{"role": "user", "content": f"question {i} " * (i + 1)}] for i in range(3)]
    with serve_in_background(artifacts["exllamav3"], max_num_seqs=2, expert_cache=4) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)

        def ask(m):
            return client.chat.completions.create(model="tiny-EXL3-2bit", messages=m, max_tokens=6).choices[0]

        sequential = [ask(m).message.content for m in prompts]
        parallel: dict[int, str] = {}
        threads = [
            threading.Thread(target=lambda i=i: parallel.update({i: ask(prompts[i]).message.content})) for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [parallel[i] for i in range(3)] == sequential
        assert running.service.health()["requests_served"] == 6


CLEAN_EXIT = """
import os, openai
from glmquant.runtime.server import serve_in_background

def test_serve():
    with serve_in_background(os.environ["GLMQUANT_TEST_ARTIFACT"], served_model_name="tiny") as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # leaves a kept-alive connection open
"""


@pytest.mark.slow
def test_process_exits_cleanly_after_serving(artifacts, tmp_path) -> None:
    """Stopping joins the server thread with a kept-alive connection still open, and the process exits 0."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_serve_once.py").write_text(CLEAN_EXIT)
    env = {**os.environ, "GLMQUANT_TEST_ARTIFACT": str(artifacts["tr3"])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


def test_stop_ends_running_and_queued_streams_with_a_final_chunk(artifacts):
    """Shutdown with one stream generating and one waiting for the only slot: both end with a final chunk
    (finish reason "abort"), their usage and `[DONE]`; the waiting one generated nothing. vLLM's `ignore_eos` keeps
    the running one from sampling an end-of-sequence id of the random model first."""
    running = serve_in_background(artifacts["tr3"], expert_cache=16, max_model_len=4096)
    body = {
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4000,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    streams = []
    try:
        for _ in range(2):
            conn = http.client.HTTPConnection(*running.address, timeout=120)
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            streams.append(conn.getresponse())
            assert streams[-1].readline().startswith(b"data:")
        deadline = time.monotonic() + 60
        while _get(running, "/health")["requests_waiting"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        stopper = threading.Thread(target=running.stop)
        stopper.start()
    ends = [[line.decode().strip().removeprefix("data: ") for line in s if line.startswith(b"data:")] for s in streams]
    stopper.join(60)
    assert not stopper.is_alive()
    for events in ends:
        assert events[-1] == "[DONE]" and json.loads(events[-3])["choices"][0]["finish_reason"] == "abort"
    assert json.loads(ends[0][-2])["usage"]["completion_tokens"] > 0
    assert json.loads(ends[1][-2])["usage"]["completion_tokens"] == 0
