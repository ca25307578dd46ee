"""`glmquant serve` end to end with the official openai client: streaming and not, with and without tools,
reasoning apart from content, usage counts, and bad requests answered with 4xx while the server keeps serving.

The tiny model's weights are random, so tests that need known output script the next tokens with a hook on
lm_head (the whole forward still runs; only the logits are replaced)."""

from __future__ import annotations

import http.client
import importlib.util
import json
import threading
from collections.abc import Iterator

import openai
import pytest
import torch
from runtime_media import image_message, png_data_url

from glmquant.runtime.server import RunningServer, serve_in_background

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "country": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "country"], "additionalProperties": False}}}]
HELLO = [{"role": "user", "content": "Say hello."}]


class Script:
    """Replaces the next logits so the model 'says' a given text, then its first EOS id."""

    def __init__(self, server: RunningServer) -> None:
        self.tokenizer = server.service.chat.tokenizer
        self.eos = server.service.defaults.stop_token_ids[0]
        self.queue: list[int] = []
        server.service.loaded.model.lm_head.register_forward_hook(self._hook)

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
    with serve_in_background(artifacts["tr3"], expert_cache=16, max_context=1024, model_id="tiny") as running:
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


def test_plain_completion_and_usage(server, client, script):
    script.say("<think>greet them</think>\nFINAL_BASELINE_OK")
    r = client.chat.completions.create(model="tiny", messages=HELLO, temperature=0)
    choice = r.choices[0]
    assert choice.message.content == "FINAL_BASELINE_OK" and choice.finish_reason == "stop"
    assert choice.message.reasoning_content == "greet them"
    prompt_tokens = _post(server, "/tokenize", {"messages": HELLO})[1]["count"]
    script_tokens = len(script.tokenizer.encode("<think>greet them</think>\nFINAL_BASELINE_OK", add_special_tokens=False))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, script_tokens)


def test_streaming_with_usage_matches_non_streaming(client, script):
    text = "<think>hmm</think>Witaj, świecie 你好，世界 مرحبا بالعالم"
    script.say(text)
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Witaj, świecie 你好，世界 مرحبا بالعالم"
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "hmm"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        script.tokenizer.encode(text, add_special_tokens=False))


def test_tool_call_non_streaming(client, script):
    script.say("<think>use the tool</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
               "<arg_key>country</arg_key><arg_value>France</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
               "</tool_call>")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris, France?"}],
                                       tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "country": "France", "days": 2}


def test_tool_call_streaming(client, script):
    script.say("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
               "<arg_key>country</arg_key><arg_value>Norway</arg_value></tool_call>")
    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "country": "Norway"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_unscripted_sampling_is_seeded(client):
    kwargs = dict(model="tiny", messages=HELLO, max_tokens=6, temperature=1.0, seed=5)
    first, again = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 6
    assert first.choices[0].message.content == again.choices[0].message.content


def test_image_request(client, script):
    script.say("red")
    r = client.chat.completions.create(model="tiny", messages=[image_message(png_data_url((255, 0, 0)))])
    text = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What colour is this?"}],
                                          max_tokens=1)
    assert r.choices[0].message.content == "red"
    assert r.usage.prompt_tokens == text.usage.prompt_tokens + 6  # 4 image tokens + begin/end markers


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "gpt-4", "messages": HELLO}, 404, "does not exist"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, 400, "context holds 1024"),
    ({"messages": [image_message("data:image/png;base64,aGVsbG8=")]}, 400, "could not be decoded"),
    ({"messages": [image_message("data:image/png;base64,@@@")]}, 400, "not valid base64"),
    ({"messages": []}, 422, "non-empty list"),
    ({"messages": HELLO, "temperature": "hot"}, 422, "temperature"),
    ({"messages": HELLO, "top_p": 0}, 422, "top_p"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ([1, 2], 422, "JSON object"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, client, script, body, status, fragment):
    got, error = _post(server, "/v1/chat/completions", body)
    assert got == status and fragment in error["error"]["message"]
    assert set(error["error"]) == {"message", "type", "param", "code"}
    script.say("still here")
    assert client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == "still here"


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision present: video works")
def test_video_without_the_server_package_is_a_5xx(server, client, script):
    """A package the server lacks is the server's gap (501), not a bad request (4xx)."""
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    got, error = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [video]}]})
    assert got == 501 and "torchvision" in error["error"]["message"] and error["error"]["type"] == "server_error"
    script.say("still here")
    assert client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == "still here"


def test_oversize_body_unknown_route_and_missing_length(server):
    conn = http.client.HTTPConnection(*server.server.server_address[:2], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "exceeds" in json.loads(response.read())["error"]["message"]
    conn.close()
    assert _post(server, "/v1/completions", {"prompt": "x"})[0] == 404
    assert _get(server, "/health")["status"] == "ok"


def test_requests_queue_with_one_active_sequence(server, client):
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=3, temperature=0).choices[0].finish_reason)) for _ in range(3)]
    before = _get(server, "/health")["requests_served"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["length"] * 3 and _get(server, "/health")["requests_served"] == before + 3


def _get(server: RunningServer, path: str) -> dict:
    conn = http.client.HTTPConnection(*server.server.server_address[:2], timeout=60)
    conn.request("GET", path)
    return json.loads(conn.getresponse().read())


def _post(server: RunningServer, path: str, body: object) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server.server_address[:2], timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_concurrent_sequences_match_sequential(artifacts):
    """With two generation slots, interleaved sequences (each with its own cache) give the sequential answers."""
    prompts = [[{"role": "user", "content": f"question {i} " * (i + 1)}] for i in range(3)]
    with serve_in_background(artifacts["exllamav3"], concurrency=2, expert_cache=4) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)
        ask = lambda m: client.chat.completions.create(model="exllamav3", messages=m, max_tokens=6).choices[0]  # noqa: E731
        sequential = [ask(m).message.content for m in prompts]
        parallel: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: parallel.update({i: ask(prompts[i]).message.content}))
                   for i in range(3)]
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
    with serve_in_background(os.environ["GLMQUANT_TEST_ARTIFACT"], model_id="tiny") as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # leaves a kept-alive connection open
"""


def test_process_exits_cleanly_after_serving(artifacts, tmp_path) -> None:
    """Handler threads are joined on stop. As daemons, one killed during interpreter shutdown aborted a pytest
    process from native code (exit status 134) after every test had passed."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_serve_once.py").write_text(CLEAN_EXIT)
    env = {**os.environ, "GLMQUANT_TEST_ARTIFACT": str(artifacts["tr3"])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
