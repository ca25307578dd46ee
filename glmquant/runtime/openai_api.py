"""The OpenAI wire format as pydantic models: chat and text completion requests, their responses and stream
chunks, vLLM's /tokenize and /detokenize, and errors `{"error": {"message", "type", "param", "code"}}`.

Conventions are vLLM's OpenAI server's: unknown fields are accepted and ignored (logged), an invalid field is
a 400 naming it in `param`, `code` is the HTTP status and `type` vLLM's name for it. A parameter this
runtime cannot honour (logprobs, n > 1, response_format, penalties...) is a 400 "... is not supported"
unless it carries its neutral value: silently ignoring it would give an answer the client did not ask for.
"""

from __future__ import annotations

import logging
import reprlib
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer

from glmquant.runtime.generate import Generation
from glmquant.runtime.glm_output import Delta, ParsedOutput, ToolCall
from glmquant.runtime.speculative import SpecStats

log = logging.getLogger("glmquant.serve")
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}  # vLLM's; else the phrase


class ApiError(Exception):
    """A request the server refuses: the HTTP status, a message and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any) -> ApiError:
    """pydantic's first complaint about a request body as a 400 whose `param` names the field in the body."""
    if not errors:
        return ApiError(400, "the request body is invalid")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip())
    param = field_path(first.get("loc", ()), body, missing=first.get("type") == "missing")
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)


def field_path(loc: Sequence[Any], body: Any, missing: bool = False) -> str | None:
    """`messages[0].content` from pydantic's location, keeping only the keys and indices the body really has
    (pydantic inserts union member names such as 'str' or 'list[...]' into the location)."""
    path, node = "", body
    steps = list(loc[1:] if loc and loc[0] == "body" else loc)
    for i, step in enumerate(steps):
        if isinstance(step, int) and isinstance(node, list) and step < len(node):
            path, node = f"{path}[{step}]", node[step]
        elif isinstance(step, str) and isinstance(node, dict) and (step in node or (missing and i == len(steps) - 1)):
            path, node = f"{path}.{step}" if path else step, node.get(step)
    return path or None


class OpenAIModel(BaseModel):
    """A request: unknown fields are kept (and logged), as OpenAI's and vLLM's servers accept them."""

    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[Mapping[str, Callable[[Any], bool]]] = {}  # field -> "the value asks nothing special"

    def refuse_unsupported(self) -> None:
        """ApiError 400 for the first field whose value this runtime cannot honour."""
        for name, neutral in self.unsupported.items():
            value = getattr(self, name)
            if not neutral(value):
                raise ApiError(400, f"{name}={reprlib.repr(value)} is not supported by this server", name)
        if self.model_extra:
            log.warning("ignored request fields: %s", ", ".join(sorted(self.model_extra)))


def _off(value: Any) -> bool:
    return not value


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_form(self) -> dict[str, Any]:
        """The message as the chat template takes it (a developer message is a system message)."""
        out = self.model_dump(exclude_none=True)
        return {**out, "role": "system" if self.role == "developer" else self.role}

    def text_bytes(self) -> int:
        """UTF-8 bytes of the text this message puts into the prompt."""
        parts = [self.content] if isinstance(self.content, str) else [p.text or "" for p in self.content or ()]
        return sum(len(p.encode()) for p in [*parts, self.reasoning_content or ""])


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class SamplingFields(OpenAIModel):
    """The sampling fields chat and text completions share (vLLM's extras included)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # torch's generator seed, a 64-bit integer
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence ids (benchmarks, fixed-length runs)

    @field_validator("stream", "n", "skip_special_tokens", "ignore_eos", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """`null` asks for the default, as vLLM's Optional fields take it."""
        return cls.model_fields[info.field_name or ""].default if value is None else value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_a_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):  # `stream` is validated first (declared first)
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


_SAMPLING_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v == 1,
    "presence_penalty": _off,
    "frequency_penalty": _off,
    "logit_bias": _off,
    "top_k": lambda v: v in (None, 0, -1),
    "min_p": _off,
    "repetition_penalty": lambda v: v in (None, 1),
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    unsupported: ClassVar[Mapping[str, Callable[[Any], bool]]] = {
        **_SAMPLING_UNSUPPORTED,
        "logprobs": _off,
        "top_logprobs": _off,
        "reasoning_effort": lambda v: v is None,
        "response_format": lambda v: v is None or v.get("type") == "text",
        "functions": _off,
        "function_call": lambda v: v is None,
        "tool_choice": lambda v: v in (None, "none", "auto"),
    }

    @property
    def budget(self) -> int | None:
        """The completion tokens asked for (max_completion_tokens wins over the older max_tokens)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def active_tools(self) -> list[dict[str, Any]]:
        return [] if self.tool_choice == "none" else [t.model_dump(exclude_none=True) for t in self.tools or ()]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's default for text completions
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
    add_special_tokens: bool = True

    unsupported: ClassVar[Mapping[str, Callable[[Any], bool]]] = {
        **_SAMPLING_UNSUPPORTED,
        "echo": _off,
        "suffix": lambda v: v is None,
        "best_of": lambda v: v in (None, 1),
        "logprobs": lambda v: v is None,
        "prompt": lambda v: not _is_batch(v) or len(v) == 1,
    }

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (a batch of one is unwrapped)."""
        return self.prompt[0] if _is_batch(self.prompt) else self.prompt  # type: ignore[return-value]


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a `prompt` as it is, or `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class SpeculativeUsage(BaseModel):
    """MTP speculative decoding of one request, with vLLM's spec-decode metric names: `num_drafts` verify steps,
    `num_draft_tokens` drafted and `num_accepted_tokens` accepted; `acceptance_rate` = accepted / drafted and
    `tokens_per_step` = (accepted + drafts) / drafts, the tokens each target forward yielded (1.0: no gain)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    tokens_per_step: float

    @classmethod
    def of(cls, stats: SpecStats) -> SpeculativeUsage:
        return cls(
            num_drafts=stats.steps,
            num_draft_tokens=stats.drafted,
            num_accepted_tokens=stats.accepted,
            acceptance_rate=round(stats.acceptance_rate, 4),
            tokens_per_step=round(stats.tokens_per_step, 4),
        )


class UsageInfo(BaseModel):
    """OpenAI's usage, plus `speculative` (not OpenAI's: present only when the request was decoded with MTP
    speculation, so plain responses keep OpenAI's exact shape)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None

    @classmethod
    def of(cls, generation: Generation | None, prompt_tokens: int) -> UsageInfo:
        completion = generation.completion_tokens if generation is not None else 0
        spec = generation.speculative if generation is not None else None
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            speculative=SpeculativeUsage.of(spec) if spec is not None else None,
        )

    @model_serializer(mode="wrap")
    def _speculative_when_run(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return _without_null(handler(self), "speculative")


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON object text, as OpenAI returns it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallOut:
        return cls(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


class DeltaToolCall(ToolCallOut):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCallOut] = []


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    """What one chunk adds; only the fields it carries are sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _carried_only(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class _UsageWhenGiven(BaseModel):
    """A stream chunk without usage leaves the key out, as vLLM's do."""

    @model_serializer(mode="wrap")
    def _usage_when_given(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return _without_null(handler(self), "usage")


def _without_null(out: dict[str, Any], key: str) -> dict[str, Any]:
    """`out` without `key` where its value is null: an optional part of a response left out, not sent as null."""
    if out.get(key) is None:
        out.pop(key, None)
    return out


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_UsageWhenGiven):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None  # the usage chunk's (`stream_options.include_usage`); absent from the others


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_UsageWhenGiven):
    """A text completion, and each chunk of a streamed one (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # always in a whole response; in a stream, the usage chunk's alone


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "glmquant"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


def request_id(kind: Literal["chatcmpl", "cmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def finish_reason(generation: Generation, tool_calls: Sequence[ToolCall]) -> str:
    return "tool_calls" if tool_calls and generation.finish_reason == "stop" else generation.finish_reason


def chat_response(rid: str, model: str, generation: Generation, parsed: ParsedOutput) -> ChatCompletionResponse:
    message = AssistantMessage(
        content=parsed.content or None,
        reasoning_content=parsed.reasoning or None,
        tool_calls=[ToolCallOut.of(c) for c in parsed.tool_calls],
    )
    choice = ChatChoice(message=message, finish_reason=finish_reason(generation, parsed.tool_calls))
    return ChatCompletionResponse(
        id=rid, model=model, choices=[choice], usage=UsageInfo.of(generation, generation.prompt_tokens)
    )


def chat_delta(delta: Delta, tool_index: int) -> ChatDelta:
    """One parsed output step as a chunk's delta (`tool_index`: how many tool calls came before)."""
    if delta.tool_call is not None:
        return ChatDelta(tool_calls=[DeltaToolCall(index=tool_index, **ToolCallOut.of(delta.tool_call).model_dump())])
    return ChatDelta(content=delta.content) if delta.content else ChatDelta(reasoning_content=delta.reasoning)


def completion_response(rid: str, model: str, generation: Generation) -> CompletionResponse:
    return CompletionResponse(
        id=rid,
        model=model,
        choices=[CompletionChoice(text=generation.text, finish_reason=generation.finish_reason)],
        usage=UsageInfo.of(generation, generation.prompt_tokens),
    )
