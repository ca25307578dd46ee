"""The server's Prometheus metrics (GET /metrics), named like vLLM's with a `glmquant:` prefix.

Each server has its own registry, so several servers in one process (tests, serve-check) never share counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from glmquant.runtime.generate import Generation

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
RATE_BUCKETS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)


class ServerMetrics:
    """Requests, tokens, time to first token, decode tokens per second, the queue and speculative decoding's
    drafted and accepted tokens, for one served model."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, [*label, *extra], registry=self.registry)

        self._http = counter(
            "glmquant:http_requests", "HTTP requests by method, route and status", "method", "handler", "status"
        )
        self._finished = counter(
            "glmquant:request_success", "Generations finished, by finish reason", "finished_reason"
        )
        self._prompt_tokens = counter("glmquant:prompt_tokens", "Prompt tokens prefilled").labels(**label)
        self._generation_tokens = counter("glmquant:generation_tokens", "Tokens generated").labels(**label)
        self._ttft = Histogram(
            "glmquant:time_to_first_token_seconds",
            "Arrival to first generated token, queue included",
            list(label),
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**label)
        self._rate = Histogram(
            "glmquant:decode_tokens_per_second",
            "Per request: tokens after the first / seconds after the first",
            list(label),
            buckets=RATE_BUCKETS,
            registry=self.registry,
        ).labels(**label)
        self._running = Gauge(
            "glmquant:num_requests_running", "Requests generating now", list(label), registry=self.registry
        ).labels(**label)
        self._waiting = Gauge(
            "glmquant:num_requests_waiting",
            "Requests queued for a generation slot",
            list(label),
            registry=self.registry,
        ).labels(**label)
        # vLLM's spec-decode counters: verify steps, drafted and accepted tokens (MTP speculative decoding)
        self._spec_drafts = counter("glmquant:spec_decode_num_drafts", "Speculative verify steps").labels(**label)
        self._spec_draft_tokens = counter(
            "glmquant:spec_decode_num_draft_tokens", "Tokens drafted by the MTP layer"
        ).labels(**label)
        self._spec_accepted_tokens = counter(
            "glmquant:spec_decode_num_accepted_tokens", "Drafted tokens the target model accepted"
        ).labels(**label)
        self._label = label

    def track_queue(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the queue depth from the scheduler at each scrape."""
        self._running.set_function(running)
        self._waiting.set_function(waiting)

    def http_request(self, method: str, handler: str, status: int) -> None:
        self._http.labels(**self._label, method=method, handler=handler, status=str(status)).inc()

    def generation(self, arrived: float, generation: Generation) -> None:
        """Count one finished generation (`arrived`: time.perf_counter() when its request came in)."""
        self._finished.labels(**self._label, finished_reason=generation.finish_reason).inc()
        self._prompt_tokens.inc(generation.prompt_tokens)
        self._generation_tokens.inc(generation.completion_tokens)
        if generation.first_token_at is not None:
            self._ttft.observe(generation.first_token_at - arrived)
            decode_seconds = generation.finished_at - generation.first_token_at
            if generation.completion_tokens > 1 and decode_seconds > 0:
                self._rate.observe((generation.completion_tokens - 1) / decode_seconds)
        if generation.speculative is not None:
            self._spec_drafts.inc(generation.speculative.steps)
            self._spec_draft_tokens.inc(generation.speculative.drafted)
            self._spec_accepted_tokens.inc(generation.speculative.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
