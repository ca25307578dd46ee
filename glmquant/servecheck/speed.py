"""Speed cells: N prompt tokens x C concurrent streams, timed from the stream (gates doc definitions).

Each stream gets its own nonce and filler, so no request is served from another's prefix cache.
A cell passes when every stream completed with usage, the server's prompt count matches the local one (so the
cell measured the length it claims) and the streams' mean decode rate reaches the stated threshold. A server that
decodes with MTP speculation reports its drafts in usage; the cell then records the acceptance rate and tokens per
verify step over its streams (None from a server that does not).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from glmquant.servecheck.chat import ChatRequest, ChatResult
from glmquant.servecheck.haystack import Filler, fit_filler
from glmquant.servecheck.needle import score_prompt_usage
from glmquant.servecheck.scoring import Verdict
from glmquant.servecheck.tokens import Tokenizer

ASK = "Now list 10 numbered facts about the history of astronomy."


@dataclass(frozen=True)
class SpeedRequest:
    request: ChatRequest
    prompt_tokens: int  # local count


@dataclass(frozen=True)
class SpeedMetrics:
    input_tokens: int
    concurrency: int
    wall_s: float  # the whole cell, first request sent to last stream closed
    ttft_s: float | None  # mean time to first token over the streams
    ttft_max_s: float | None
    decode_tps: float | None  # mean per-stream completion_tokens / (last token - first token)
    aggregate_tps: float  # all completion tokens / cell wall time
    completion_tokens: int
    acceptance_rate: float | None = None  # accepted / drafted tokens over the streams (MTP speculation)
    tokens_per_step: float | None = None  # (accepted + verify steps) / verify steps: tokens per target forward


def build_speed_requests(
    tokenizer: Tokenizer, input_tokens: int, concurrency: int, seed: int, max_tokens: int | None = None
) -> tuple[SpeedRequest, ...]:
    out = []
    for stream in range(concurrency):
        nonce = f"{random.Random(seed * 1009 + stream).getrandbits(64):016x}"

        def messages(filler: Filler, nonce: str = nonce) -> tuple[dict[str, str], ...]:
            text = f"Session {nonce}. Background notes follow.\n\n{filler.text()}\n\n{ASK}"
            return ({"role": "user", "content": text},)

        filler, count = fit_filler(tokenizer, messages, input_tokens, seed + stream)
        out.append(SpeedRequest(ChatRequest(messages(filler), max_tokens=max_tokens), count))
    return tuple(out)


def run_cell(
    send: Callable[[ChatRequest], ChatResult], requests: tuple[SpeedRequest, ...]
) -> tuple[list[ChatResult], float]:
    """Send all requests at once (one thread each); returns the results and the cell's wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        results = list(pool.map(send, [r.request for r in requests]))
    return results, time.perf_counter() - start


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _speculation(results: list[ChatResult]) -> dict[str, float | None]:
    """Acceptance rate and tokens per step over the streams that report speculation."""
    spec = [r.usage.speculative for r in results if r.usage is not None and r.usage.speculative is not None]
    drafts = sum(s.num_drafts for s in spec)
    drafted = sum(s.num_draft_tokens for s in spec)
    accepted = sum(s.num_accepted_tokens for s in spec)
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": (accepted + drafts) / drafts if drafts else None,
    }


def score_cell(
    results: list[ChatResult],
    requests: tuple[SpeedRequest, ...],
    wall_s: float,
    tolerance: int,
    min_decode_tps: float = 0.0,
) -> tuple[Verdict, SpeedMetrics]:
    failures: list[str] = []
    for i, (result, request) in enumerate(zip(results, requests)):
        problems = [f"request failed: {result.error}"] if result.error is not None else []
        if result.error is None and result.finish_reason not in ("stop", "length"):
            problems.append(f"finish_reason {result.finish_reason!r}")
        if result.usage is not None and result.usage.completion_tokens == 0:
            problems.append("no completion tokens")
        problems += score_prompt_usage(result, request.prompt_tokens, tolerance)
        failures += [f"stream {i}: {p}" for p in problems]
    ttfts = [r.timings.ttft_s if r.timings else None for r in results]
    completion = sum(r.usage.completion_tokens for r in results if r.usage is not None)
    metrics = SpeedMetrics(
        input_tokens=requests[0].prompt_tokens,
        concurrency=len(requests),
        wall_s=wall_s,
        ttft_s=_mean(ttfts),
        ttft_max_s=max((t for t in ttfts if t is not None), default=None),
        decode_tps=_mean([r.decode_tps for r in results]),
        aggregate_tps=completion / wall_s if wall_s > 0 else 0.0,
        completion_tokens=completion,
        **_speculation(results),
    )
    if not failures and (metrics.decode_tps or 0.0) < min_decode_tps:
        rate = "no decode rate" if metrics.decode_tps is None else f"mean decode {metrics.decode_tps:.2f} tok/s"
        failures.append(f"{rate}, below the {min_decode_tps:g} tok/s threshold")
    return Verdict(not failures, "; ".join(failures) or "ok"), metrics
