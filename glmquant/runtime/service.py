"""ChatService: one loaded artifact answering chat completions, independent of HTTP.

Requests render their prompt concurrently, then wait for one of `concurrency` generation slots (a FIFO-ish
queue: threads blocked on a semaphore); each slot runs one sequence with its own cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from glmquant.errors import MissingDependencyError, UsageError
from glmquant.runtime.chat import ChatFormat, RenderedPrompt
from glmquant.runtime.generate import Generation, SamplingParams, generate, stop_token_ids
from glmquant.runtime.glm_output import Delta, GlmOutputParser, ParsedOutput, collect
from glmquant.runtime.loader import load_model
from glmquant.runtime.openai_api import ApiError, ChatRequest
from glmquant.runtime.options import RuntimeOptions

log = logging.getLogger("glmquant.serve")


@dataclass(frozen=True)
class ServiceOptions:
    """`model_id` defaults to the artifact directory's name, `max_context` to max_position_embeddings."""

    model_id: str | None = None
    concurrency: int = 1
    max_context: int | None = None
    default_max_tokens: int = 4096  # completion budget when a request names none (the context may cap it)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")


class ChatService:
    """The model, its chat format and the generation queue."""

    def __init__(self, artifact_dir: str | Path, runtime: RuntimeOptions = RuntimeOptions(),
                 options: ServiceOptions = ServiceOptions()) -> None:
        path = Path(artifact_dir)
        self.loaded = load_model(path, runtime)
        spec = self.loaded.artifact.spec
        self.chat = ChatFormat(path, has_vision=spec.vision is not None)
        self.model_id = options.model_id or path.resolve().name
        self.max_context = options.max_context or int(spec.text.get("max_position_embeddings") or 4096)
        self.defaults = _defaults(path, spec.text, options.default_max_tokens)
        self._slots = threading.BoundedSemaphore(options.concurrency)
        self._lock = threading.Lock()
        self._served = self._waiting = 0

    def complete(self, request: ChatRequest, on_delta: Callable[[Delta], None] | None = None
                 ) -> tuple[Generation, ParsedOutput]:
        """Run one chat completion; `on_delta` sees reasoning, content and tool calls as they appear."""
        prompt = self.render(request.messages, request.tools, request.template_kwargs)
        room = self.max_context - prompt.inputs.num_tokens
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt.inputs.num_tokens} tokens but the context holds "
                                f"{self.max_context}", "messages", "context_length_exceeded")
        sampling = replace(request.sampling, max_tokens=min(request.sampling.max_tokens, room))
        parser, deltas = GlmOutputParser(request.tools, prompt.starts_in_reasoning), []

        def on_text(text: str) -> None:
            for delta in parser.feed(text):
                deltas.append(delta)
                if on_delta is not None:
                    on_delta(delta)

        with self._queued():
            start = time.perf_counter()
            generation = generate(self.loaded.model, prompt.inputs, sampling, self.chat.decode, on_text)
            seconds = time.perf_counter() - start
        log.info("completion: %d prompt + %d generated tokens in %.2f s (%s), expert cache hit rate %.1f%%",
                 generation.prompt_tokens, generation.completion_tokens, seconds, generation.finish_reason,
                 100 * self.loaded.backend.stats().hit_rate)
        for delta in parser.finish():
            deltas.append(delta)
            if on_delta is not None:
                on_delta(delta)
        return generation, collect(deltas)

    def render(self, messages: Any, tools: Any = (), template_kwargs: Mapping[str, Any] | None = None) -> RenderedPrompt:
        try:
            return self.chat.render(messages, tools, template_kwargs)
        except MissingDependencyError as exc:  # the server lacks a package: its gap, not a bad request
            raise ApiError(501, str(exc), "messages", type="server_error") from None
        except UsageError as exc:
            raise ApiError(400, str(exc), "messages") from None

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's /tokenize: a `prompt` string as is, or `messages` through the chat template."""
        if isinstance(body, dict) and isinstance(body.get("prompt"), str):
            ids = self.chat.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        elif isinstance(body, dict) and isinstance(body.get("messages"), list):
            prompt = self.render(body["messages"], body.get("tools") or (), body.get("chat_template_kwargs"))
            ids = prompt.inputs.input_ids[0].tolist()
        else:
            raise ApiError(422, "/tokenize needs 'prompt' (a string) or 'messages' (a list)")
        return {"count": len(ids), "max_model_len": self.max_context, "tokens": ids}

    def models(self) -> dict[str, Any]:
        entry = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "glmquant",
                 "max_model_len": self.max_context}
        return {"object": "list", "data": [entry]}

    def health(self) -> dict[str, Any]:
        stats = self.loaded.backend.stats()
        with self._lock:
            counts = {"requests_served": self._served, "requests_waiting": self._waiting}
        return {"status": "ok", "model": self.model_id, "layout": self.loaded.artifact.layout, **counts,
                "expert_cache": {"capacity": stats.capacity, "resident": stats.resident, "hits": stats.hits,
                                 "misses": stats.misses, "hit_rate": round(stats.hit_rate, 4)}}

    @contextlib.contextmanager
    def _queued(self) -> Iterator[None]:
        """Wait for a generation slot, counting the requests waiting for one."""
        with self._lock:
            self._waiting += 1
        self._slots.acquire()
        with self._lock:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()
            with self._lock:
                self._served += 1


def _defaults(path: Path, text_config: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    """Sampling defaults from generation_config.json (greedy unless it asks to sample); EOS ids from both."""
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = set(stop_token_ids(text_config.get("eos_token_id"))) | set(stop_token_ids(gen.get("eos_token_id")))
    sample = bool(gen.get("do_sample"))
    return SamplingParams(max_tokens=max_tokens, temperature=float(gen.get("temperature", 1.0)) if sample else 0.0,
                          top_p=float(gen.get("top_p", 1.0)) if sample else 1.0, stop_token_ids=tuple(sorted(eos)))
