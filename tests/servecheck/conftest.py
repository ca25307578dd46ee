"""A scripted OpenAI-compatible HTTP server for the client and scoring path (a test double, not the
acceptance run): it streams canned GLM-shaped answers over real HTTP/SSE, counts prompt tokens with the
tiny model's tokenizer, and in `flawed` mode answers every gate the wrong way a real server can."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from glmquant.fixtures.tokenizer import save_tiny_tokenizer
from glmquant.servecheck.fixtures import IMAGES, VIDEOS
from glmquant.servecheck.tokens import PromptTokenizer

BY_SHA = {f.sha256: f for f in IMAGES + VIDEOS}
RECORD = re.compile(r"Registry record: (\w+) has retrieval value ([0-9a-f]{16})\.")


def _text_of(content: Any) -> str:
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)


def _media(content: Any):
    for part in content if isinstance(content, list) else []:
        url = (part.get("image_url") or part.get("video_url") or {}).get("url", "")
        if url.startswith("data:"):
            return BY_SHA.get(hashlib.sha256(base64.b64decode(url.split(",", 1)[1])).hexdigest())
    return None


def script(body: dict[str, Any], flawed: bool) -> dict[str, Any]:
    """The answer as {reasoning, content, tool_calls, finish, usage_off (prompt-token error), cached, no_usage,
    speculative (the embedded server's extra usage field)}."""
    content = body["messages"][-1]["content"]
    text = _text_of(content)
    if body.get("tools"):
        if flawed:
            return {"content": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"}
        return {
            "reasoning": "The user wants the weather.",
            "finish": "tool_calls",
            "tool_calls": [("get_weather", ['{"city": ', '"Paris", "country": "France"}'])],
        }
    if "FINAL_BASELINE_OK" in text:
        if flawed:
            return {"reasoning": "Let me think about what exactly is being asked here", "finish": "length"}
        return {"reasoning": "The user wants exactly one token back.", "content": "FINAL_BASELINE_OK"}
    if text.startswith("Reply with exactly the following text"):
        echo = text.rsplit(": ", 1)[1]
        return {"content": "你好世界" if flawed and echo == "你好，世界" else echo}
    fixture = _media(content)
    if fixture is not None:
        answer = json.dumps(fixture.expected)
        if flawed:
            flipped = {"left_to_right": "right_to_left", "right_to_left": "left_to_right"}
            answer = (
                answer[:-1]
                if fixture.kind == "image"
                else json.dumps({**fixture.expected, "direction": flipped[fixture.expected["direction"]]})
            )
        return {"content": f"<|begin_of_box|>{answer}<|end_of_box|>" if fixture.kind == "image" else answer}
    if "Registry record" in text:
        values = dict(RECORD.findall(text))
        if flawed:
            values["cobalt"] = "0" * 16
            return {"content": json.dumps(values), "usage_off": 50, "cached": 1024}
        return {"reasoning": "Four records.", "content": json.dumps(values)}
    if "numbered facts" in text:
        spec = {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6}  # as `serve --speculative-config`
        return {"content": "\n".join(f"{i}. A fact." for i in range(1, 11)), "no_usage": flawed, "speculative": spec}
    return {"content": "I do not know."}


class ScriptedServer:
    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer = PromptTokenizer.from_dir(tokenizer_dir)
        self.flawed = False
        self.max_model_len: int | None = None  # stated in the model listing, as vLLM does
        self.offers_tokenize = False  # vLLM's /tokenize
        self.requests: list[dict[str, Any]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def chunks(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        plan = script(body, self.flawed)
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        pieces = [{"reasoning_content": p} for p in re.findall(r".{1,8}", plan.get("reasoning", ""), re.DOTALL)]
        pieces += [{"content": p} for p in re.findall(r".{1,8}", plan.get("content", ""), re.DOTALL)]
        for i, (name, args) in enumerate(plan.get("tool_calls", [])):
            pieces.append(
                {
                    "tool_calls": [
                        {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": ""}}
                    ]
                }
            )
            pieces += [{"tool_calls": [{"index": i, "function": {"arguments": a}}]} for a in args]
        for delta in pieces:
            yield {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": plan.get("finish", "stop")}]}
        if (body.get("stream_options") or {}).get("include_usage") and not plan.get("no_usage"):
            prompt = self.tokenizer.count(body["messages"]) + plan.get("usage_off", 0)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": len(pieces),
                "total_tokens": prompt + len(pieces),
                "prompt_tokens_details": {"cached_tokens": plan.get("cached", 0)},
                **({"speculative": plan["speculative"]} if "speculative" in plan else {}),
            }
            yield {**base, "choices": [], "usage": usage}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                model: dict[str, object] = {"id": "scripted-glm", "object": "model", "owned_by": "test"}
                if server.max_model_len is not None:
                    model["max_model_len"] = server.max_model_len
                self._json({"object": "list", "data": [model]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    if not server.offers_tokenize:
                        self.send_error(404)
                        return
                    tok = server.tokenizer
                    ids = tok.encode(body["prompt"]) if "prompt" in body else tok.encode(tok.render(body["messages"]))
                    self._json({"count": len(ids), "tokens": ids, "max_model_len": server.max_model_len})
                    return
                server.requests.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in server.chunks(body):
                    self.wfile.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.002)
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

        return Handler


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    save_tiny_tokenizer(path)
    return path


@pytest.fixture
def scripted(tiny_tokenizer_dir: Path) -> Iterator[ScriptedServer]:
    server = ScriptedServer(tiny_tokenizer_dir)
    server.thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
