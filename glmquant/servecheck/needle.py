"""The long-context gate: four registry records hidden at 5/35/65/95 % of a haystack of N model tokens.

The prompt opens with a random nonce so no server can answer from a prefix cache; the seed that drew
the nonce and the values is recorded, so a run can be repeated exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from glmquant.servecheck.chat import ChatRequest, ChatResult
from glmquant.servecheck.haystack import Filler, fit_filler
from glmquant.servecheck.scoring import Verdict, score_json_answer
from glmquant.servecheck.tokens import Tokenizer

NAMES = ("amber", "birch", "cobalt", "dahlia")
DEPTHS = (0.05, 0.35, 0.65, 0.95)
RECORD = "Registry record: {name} has retrieval value {value}."
QUESTION = (
    "The text above contains four registry records. Reply with only a JSON object that maps each "
    "name (amber, birch, cobalt, dahlia) to its retrieval value as a string, in the form "
    '{"amber": "<value>", "birch": "<value>", "cobalt": "<value>", "dahlia": "<value>"}.'
)


@dataclass(frozen=True)
class NeedlePrompt:
    request: ChatRequest
    expected: dict[str, str]
    nonce: str
    prompt_tokens: int  # the local tokenizer's count of the whole rendered prompt
    positions: tuple[int, ...]  # prompt token index where each record starts
    depths: tuple[float, ...]  # filler tokens before each record / all filler tokens (0..1)


def _hex16(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


def build_needle_prompt(
    tokenizer: Tokenizer, target_tokens: int, seed: int, max_tokens: int | None = None
) -> NeedlePrompt:
    """A chat request of `target_tokens` prompt tokens (counted with the model's template) with 4 needles."""
    rng = random.Random(seed)
    nonce = _hex16(rng)
    expected = {name: _hex16(rng) for name in NAMES}
    records = [RECORD.format(name=name, value=value) for name, value in expected.items()]
    head = f"Session {nonce}. Read the following notes carefully.\n\n"

    def messages(filler: Filler) -> tuple[dict[str, str], ...]:
        inserts = [(filler.index_at(depth), record) for depth, record in zip(DEPTHS, records)]
        return ({"role": "user", "content": f"{head}{filler.text(inserts)}\n\n{QUESTION}"},)

    filler, count = fit_filler(tokenizer, messages, target_tokens, seed)
    msgs = messages(filler)
    if not tokenizer.renders:  # the server's /tokenize: depths from the filler's own token counts, no positions
        before = [sum(filler.lengths[: filler.index_at(depth)]) for depth in DEPTHS]
        total = max(sum(filler.lengths), 1)
        return NeedlePrompt(
            ChatRequest(msgs, max_tokens=max_tokens), expected, nonce, count, (), tuple(b / total for b in before)
        )
    rendered = tokenizer.render(msgs)
    body = rendered.index(head) + len(head)
    start, end = tokenizer.count_text(rendered[:body]), tokenizer.count_text(rendered[: rendered.index(QUESTION)])
    positions = tuple(tokenizer.count_text(rendered[: rendered.index(r)]) for r in records)
    sizes = tokenizer.lengths([" " + r for r in records])
    filler_tokens = max(end - start - sum(sizes), 1)
    depths = tuple((p - start - sum(sizes[:i])) / filler_tokens for i, p in enumerate(positions))
    return NeedlePrompt(ChatRequest(msgs, max_tokens=max_tokens), expected, nonce, count, positions, depths)


def score_prompt_usage(result: ChatResult, local_tokens: int, tolerance: int) -> list[str]:
    """Failures of the server's usage report: missing, prompt count off the local count, prefix-cache hit."""
    if result.error is not None:
        return []
    if result.usage is None:
        return ["the server sent no usage (stream_options.include_usage ignored)"]
    failures = []
    if abs(result.usage.prompt_tokens - local_tokens) > tolerance:
        failures.append(
            f"server counted {result.usage.prompt_tokens} prompt tokens, the model's tokenizer "
            f"{local_tokens} (tolerance {tolerance})"
        )
    if result.usage.cached_tokens:
        failures.append(f"prefix-cache hit: {result.usage.cached_tokens} cached prompt tokens")
    return failures


def score_needle(result: ChatResult, prompt: NeedlePrompt, tolerance: int) -> Verdict:
    """All 4 values exact with finish stop, and the server's prompt count within `tolerance`, no cache hit."""
    verdict = score_json_answer(result, prompt.expected)
    failures = [] if verdict.passed else [verdict.reason]
    failures += score_prompt_usage(result, prompt.prompt_tokens, tolerance)
    if isinstance(verdict.got, dict) and not verdict.passed:
        found = sum(verdict.got.get(k) == v for k, v in prompt.expected.items())
        failures[0] = f"{found}/4 values right: {failures[0]}"
    return Verdict(not failures, "; ".join(failures) or "ok", verdict.got)
