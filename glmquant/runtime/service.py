"""ModelService: one loaded artifact answering chat and text completions, independent of HTTP.

A request is admitted first (model name, supported parameters, prompt size, context length: every refusal
before any generation), then waits for one of `max_num_seqs` generation slots in arrival order; each slot
runs one sequence with its own cache. `stop()` ends running generations (finish reason "abort") and refuses
the waiting ones, so a server shutting down answers everything it accepted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.model_card import artifact_model_name
from glmquant.errors import MissingDependencyError, UsageError
from glmquant.runtime.chat import ChatFormat, RenderedPrompt
from glmquant.runtime.generate import Generation, PromptInputs, SamplingParams, generate, stop_token_ids
from glmquant.runtime.glm_output import Delta, GlmOutputParser, ParsedOutput, collect
from glmquant.runtime.loader import LoadedModel, load_artifact, load_model
from glmquant.runtime.metrics import ServerMetrics
from glmquant.runtime.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
)
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.text_stream import Decode

if TYPE_CHECKING:
    from glmquant.runtime.engine.loaded import LoadedEngine

log = logging.getLogger("glmquant.serve")


@dataclass(frozen=True)
class ServiceOptions:
    """vLLM's names: `served_model_name` defaults to the artifact's model name, `max_model_len` (prompt +
    completion tokens) to the config's max_position_embeddings, `max_num_seqs` is sequences generated at once."""

    served_model_name: str | None = None
    max_num_seqs: int = 1
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise UsageError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2, got {self.max_model_len}")


@dataclass
class Job:
    """One admitted request: its prompt, sampling, how its tokens become text and how that text is read."""

    inputs: PromptInputs
    sampling: SamplingParams
    decode: Decode
    parser: GlmOutputParser | None  # None: the text as generated (/v1/completions)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)  # the client went away

    @property
    def prompt_tokens(self) -> int:
        return self.inputs.num_tokens


class Slots:
    """`size` generation slots handed out in arrival order; once closed, waiting requests are refused (503)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = size
        self._line: deque[object] = deque()
        self._changed = threading.Condition()
        self.closed = False
        self.served = 0

    @property
    def waiting(self) -> int:
        return len(self._line)

    @property
    def running(self) -> int:
        return self.size - self._free

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        me = object()
        with self._changed:
            self._line.append(me)
            self._changed.wait_for(lambda: self.closed or (self._free > 0 and self._line[0] is me))
            self._line.remove(me)
            self._changed.notify_all()
            if self.closed:
                raise ApiError(503, "the server is shutting down; this request was not started")
            self._free -= 1
        try:
            yield
        finally:
            with self._changed:
                self._free += 1
                self.served += 1
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


class ModelService:
    """The model, its chat format, the generation slots and the metrics."""

    def __init__(
        self,
        artifact_dir: str | Path,
        runtime: RuntimeOptions = RuntimeOptions(),
        options: ServiceOptions = ServiceOptions(),
    ) -> None:
        path = Path(artifact_dir)
        artifact = load_artifact(path, runtime)
        spec = artifact.spec
        limit = int(spec.text.get("max_position_embeddings") or 4096)
        if options.max_model_len is not None and options.max_model_len > limit:
            raise UsageError(
                f"--max-model-len {options.max_model_len} exceeds the model's context of {limit} tokens "
                "(max_position_embeddings)"
            )
        self.max_model_len = options.max_model_len or limit
        if runtime.model_impl == "glmquant":
            from glmquant.runtime.engine.loaded import load_engine

            self.loaded: LoadedModel | LoadedEngine = load_engine(
                artifact, runtime, options.max_num_seqs, self.max_model_len
            )
        else:
            self.loaded = load_model(artifact, runtime)
        self.chat = ChatFormat(*chat_source(path, runtime.load_format, spec.vision is not None))
        self.model_name = options.served_model_name or served_model_name(path)
        self.defaults = _defaults(path, spec.text, self.max_model_len)
        self.slots = Slots(options.max_num_seqs)
        self.metrics = ServerMetrics(self.model_name)
        self.metrics.track_queue(lambda: self.slots.running, lambda: self.slots.waiting)

    def admit_chat(self, request: ChatCompletionRequest) -> Job:
        """Check and render a chat request; ApiError for anything that cannot run as asked."""
        self._check(request)
        self._bound_text(sum(m.text_bytes() for m in request.messages), "messages")
        tools = request.active_tools
        prompt = self._render([m.template_form() for m in request.messages], tools, request.chat_template_kwargs)
        decode = partial(self.chat.decode, skip_special_tokens=request.skip_special_tokens, keep_markup=True)
        return Job(
            prompt.inputs,
            self._sampling(request, request.budget, prompt.inputs.num_tokens),
            decode,
            GlmOutputParser(tools, prompt.starts_in_reasoning),
        )

    def admit_completion(self, request: CompletionRequest) -> Job:
        """Check and tokenize a text completion request (a prompt string or token ids)."""
        self._check(request)
        prompt = request.single_prompt
        if isinstance(prompt, str):
            self._bound_text(len(prompt.encode()), "prompt")
            ids = self.chat.tokenizer(prompt, add_special_tokens=request.add_special_tokens)["input_ids"]
        else:
            ids = self._known_ids(prompt, "prompt")
        inputs = PromptInputs(_as_batch(ids))
        decode = partial(self.chat.decode, skip_special_tokens=request.skip_special_tokens)
        return Job(inputs, self._sampling(request, request.max_tokens, inputs.num_tokens), decode, None)

    def run(self, job: Job, on_delta: Callable[[Delta], None] | None = None) -> tuple[Generation, ParsedOutput]:
        """Wait for a slot and generate (blocking); `on_delta` sees reasoning, content and tool calls as they
        appear. ApiError 503 when the service stops before the job started."""
        deltas: list[Delta] = []

        def emit(found: Sequence[Delta]) -> None:
            for delta in found:
                deltas.append(delta)
                if on_delta is not None:
                    on_delta(delta)

        def on_text(text: str) -> None:
            emit(job.parser.feed(text) if job.parser is not None else [Delta(content=text)])

        with self.slots.slot(), self.loaded.session() as model:
            generation = generate(
                model,
                job.inputs,
                job.sampling,
                job.decode,
                on_text,
                lambda: job.cancelled.is_set() or self.slots.closed,
            )
        if job.parser is not None:
            emit(job.parser.finish())
        self.metrics.generation(job.arrived, generation)
        spec = generation.speculative
        log.info(
            "generation: %d prompt + %d generated tokens in %.2f s (%s), expert cache hit rate %.1f%%%s",
            generation.prompt_tokens,
            generation.completion_tokens,
            generation.finished_at - job.arrived,
            generation.finish_reason,
            100 * self.loaded.backend.stats().hit_rate,
            ""
            if spec is None
            else f", MTP acceptance {100 * spec.acceptance_rate:.1f}%, {spec.tokens_per_step:.2f} tokens per step",
        )
        return generation, collect(deltas)

    def stop(self) -> None:
        """End running generations at their next token and refuse the waiting ones (server shutdown)."""
        self.slots.close()

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a `prompt` string as it is, or `messages` through the chat template."""
        self._check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise ApiError(400, "/tokenize needs exactly one of 'prompt' (a string) or 'messages' (a list)", "prompt")
        if request.prompt is not None:
            self._bound_text(len(request.prompt.encode()), "prompt")
            ids = self.chat.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"]
        else:
            messages = request.messages or []
            self._bound_text(sum(m.text_bytes() for m in messages), "messages")
            tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
            prompt = self._render([m.template_form() for m in messages], tools, request.chat_template_kwargs)
            ids = prompt.inputs.input_ids[0].tolist()
        strs = self.chat.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> str:
        self._check_model(request.model)
        return self.chat.decode(self._known_ids(request.tokens, "tokens"))

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    def health(self) -> dict[str, Any]:
        stats = self.loaded.backend.stats()
        return {
            "status": "ok",
            "model": self.model_name,
            "layout": self.loaded.artifact.layout,
            "requests_served": self.slots.served,
            "requests_running": self.slots.running,
            "requests_waiting": self.slots.waiting,
            "expert_cache": {
                "capacity": stats.capacity,
                "resident": stats.resident,
                "hits": stats.hits,
                "misses": stats.misses,
                "hit_rate": round(stats.hit_rate, 4),
            },
        }

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None
    ) -> RenderedPrompt:
        try:
            return self.chat.render(messages, tools, template_kwargs)
        except MissingDependencyError as exc:  # the server lacks a package: its gap, not a bad request
            raise ApiError(501, str(exc), "messages") from None
        except UsageError as exc:
            raise ApiError(400, str(exc), "messages") from None

    def _check(self, request: SamplingFields) -> None:
        self._check_model(request.model)
        request.refuse_unsupported()
        if self.slots.closed:
            raise ApiError(503, "the server is shutting down")

    def _check_model(self, name: str | None) -> None:
        if name not in (None, self.model_name):
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.", "model")

    def _bound_text(self, text_bytes: int, param: str) -> None:
        """Refuse, before tokenizing, text too long for the context whatever its tokens: no token stands for
        more than `max_token_bytes` bytes, so this text is at least text_bytes / max_token_bytes tokens."""
        if text_bytes > self.max_model_len * self.chat.max_token_bytes:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {text_bytes:,} bytes of text, more than {self.max_model_len} "
                f"tokens of this tokenizer can hold. Please reduce the length of the input.",
                param,
            )

    def _known_ids(self, ids: Sequence[int], param: str) -> list[int]:
        vocab = len(self.chat.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad or not ids:
            raise ApiError(400, f"{param} must be a non-empty list of token ids in [0, {vocab}); got {bad[:5]}", param)
        return list(ids)

    def _sampling(self, request: SamplingFields, asked: int | None, prompt_tokens: int) -> SamplingParams:
        """vLLM's length rules: the prompt leaves room for a token, `asked` fits beside the prompt, and with
        no `asked` the budget is what the context leaves (capped by generation_config's max_new_tokens)."""
        if prompt_tokens == 0:
            raise ApiError(400, "The decoder prompt cannot be empty", "prompt")
        room = self.max_model_len - prompt_tokens
        if room < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
                "messages.",
                "input_tokens",
            )
        if asked is not None and asked > room:
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
                f"context length is {self.max_model_len} tokens and your request has {prompt_tokens} "
                f"input tokens ({asked} > {self.max_model_len} - {prompt_tokens}).",
                "max_tokens",
            )
        d = self.defaults
        return SamplingParams(
            max_tokens=asked or min(room, d.max_tokens),
            temperature=d.temperature if request.temperature is None else request.temperature,
            top_p=d.top_p if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop_strings,
            stop_token_ids=() if request.ignore_eos else d.stop_token_ids,
        )


def chat_source(path: Path, load_format: str, has_vision: bool) -> tuple[Path, bool]:
    """Where the tokenizer and chat template come from: the artifact; for dummy weights from a directory without a
    tokenizer (a bare config), the byte-level test tokenizer, text only (its ids are a corner of the vocabulary)."""
    if load_format != "dummy" or (path / "tokenizer_config.json").is_file():
        return path, has_vision
    from glmquant.fixtures.tokenizer import save_tiny_tokenizer

    fallback = Path(tempfile.mkdtemp(prefix="glmquant-dummy-tokenizer-"))
    save_tiny_tokenizer(fallback)
    log.warning("%s has no tokenizer: dummy weights are served with the byte-level test tokenizer", path)
    return fallback, False


def served_model_name(artifact_dir: Path) -> str:
    """The name an artifact is served under: its manifest's model name, else its directory's name (a Hugging
    Face cache snapshot directory is named by its commit, which is why the manifest comes first)."""
    try:
        return artifact_model_name(json.loads((artifact_dir / MANIFEST_NAME).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return artifact_dir.resolve().name


def _as_batch(ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(ids)], dtype=torch.long)


def _defaults(path: Path, text_config: Mapping[str, Any], max_model_len: int) -> SamplingParams:
    """Sampling defaults from generation_config.json (greedy unless it asks to sample; max_new_tokens caps a
    request that names no budget); EOS ids from both configs."""
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = set(stop_token_ids(text_config.get("eos_token_id"))) | set(stop_token_ids(gen.get("eos_token_id")))
    sample = bool(gen.get("do_sample"))
    return SamplingParams(
        max_tokens=int(gen.get("max_new_tokens") or max_model_len),
        temperature=float(gen.get("temperature", 1.0)) if sample else 0.0,
        top_p=float(gen.get("top_p", 1.0)) if sample else 1.0,
        stop_token_ids=tuple(sorted(eos)),
    )
