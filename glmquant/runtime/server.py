"""The OpenAI-compatible HTTP server: a FastAPI app on uvicorn in front of a ModelService.

Routes: POST /v1/chat/completions and /v1/completions (JSON, or server-sent events ending in `data: [DONE]`
when `stream`), GET /v1/models, POST /tokenize and /detokenize, GET /health, /version and /metrics
(Prometheus). Every error is JSON `{"error": {...}}` with vLLM's statuses: 400 for any invalid or unsupported
field (with `param`), 401 without the API key, 404 unknown model or route, 405 wrong method, 413 body too
large, 503 while shutting down. Generation runs in worker threads; the event loop only moves bytes.

Shutdown (Ctrl-C, or `RunningServer.stop`): stop accepting, end running generations at their next token
(finish reason "abort"; a stream gets its final chunk and `[DONE]`), refuse queued requests (503, or a final
"abort" chunk for a stream), then exit. The socket is bound before the model loads, so a busy port fails fast.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import glmquant
from glmquant.errors import UsageError
from glmquant.runtime.generate import Generation
from glmquant.runtime.glm_output import Delta, ParsedOutput
from glmquant.runtime.openai_api import (
    ApiError,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    UsageInfo,
    chat_delta,
    chat_response,
    completion_response,
    finish_reason,
    request_id,
    validation_error,
)
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.service import Job, ModelService, ServiceOptions

log = logging.getLogger("glmquant.serve")
MAX_REQUEST_BYTES = 64 << 20  # base64 images make bodies large; anything beyond is refused with 413 unread
DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left before the reply (never sent)
_WORKERS: set[asyncio.Future[Any]] = set()  # generations whose client may have gone before they finished


def build_app(service: ModelService, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `service`; with `api_key`, /v1 routes need `Authorization: Bearer <key>`."""
    app = FastAPI(title="glmquant", version=glmquant.__version__, docs_url=None, redoc_url=None)
    app.add_middleware(_CountRequests, service=service)
    app.add_middleware(_LimitBody, limit=MAX_REQUEST_BYTES)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc.errors(), exc.body)
        return JSONResponse(error.body(), error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(ApiError(exc.status_code, message).body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    def authorized(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Unauthorized: this server needs 'Authorization: Bearer <api key>'")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.post("/chat/completions", dependencies=[Depends(_json_body)])
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        job = service.admit_chat(request)
        rid = request_id("chatcmpl")
        if request.stream:
            return _sse(_chat_events(service, job, rid, request.include_usage))
        result = await _run(service, job, raw)
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return _json(chat_response(rid, service.model_name, *result))

    @v1.post("/completions", dependencies=[Depends(_json_body)])
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        job = service.admit_completion(request)
        rid = request_id("cmpl")
        if request.stream:
            return _sse(_completion_events(service, job, rid, request.include_usage))
        result = await _run(service, job, raw)
        if result is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return _json(completion_response(rid, service.model_name, result[0]))

    @v1.get("/models")
    async def models() -> Response:
        return _json(service.models())

    app.include_router(v1)

    @app.post("/tokenize", dependencies=[Depends(_json_body)])
    async def tokenize(request: TokenizeRequest) -> Response:
        return _json(await run_in_threadpool(service.tokenize, request))

    @app.post("/detokenize", dependencies=[Depends(_json_body)])
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _json(DetokenizeResponse(prompt=service.detokenize(request)))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return service.health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": glmquant.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    return app


def _json(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"))


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event(body: BaseModel | dict[str, Any]) -> str:
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body, ensure_ascii=False)
    return f"data: {data}\n\n"


def _json_body(request: Request) -> None:
    """415 for a body that does not say it is JSON, as vLLM's `validate_json_request`."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Unsupported Media Type: only 'application/json' is allowed, got {media_type!r}")


async def _run(service: ModelService, job: Job, request: Request) -> tuple[Generation, ParsedOutput] | None:
    """The job's result, or None when the client went away first: the generation is then cancelled at its next
    token (as a closed stream's is), so it holds no slot for a reply nobody reads."""
    work = asyncio.ensure_future(run_in_threadpool(service.run, job))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        job.cancelled.set()
        _WORKERS.add(work)  # ends at the next token; its result (or error) is nobody's
        work.add_done_callback(_forgotten)
        return None
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _forgotten(work: asyncio.Future[Any]) -> None:
    _WORKERS.discard(work)
    if not work.cancelled() and work.exception() is not None:
        log.info("a generation whose client went away ended with %r", work.exception())


async def _generation(service: ModelService, job: Job) -> AsyncIterator[Delta | tuple[Generation, ParsedOutput]]:
    """The job's deltas as the worker thread produces them, then its result; closing the iterator early (the
    client went away) cancels the generation at its next token."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Delta | tuple[Generation, ParsedOutput] | BaseException] = asyncio.Queue()

    def forward(delta: Delta) -> None:  # called on the worker thread
        loop.call_soon_threadsafe(queue.put_nowait, delta)

    async def work() -> None:
        try:
            queue.put_nowait(await run_in_threadpool(service.run, job, forward))
        except BaseException as exc:  # noqa: BLE001  (handed to the consumer, which raises it)
            queue.put_nowait(exc)

    worker = asyncio.ensure_future(work())
    _WORKERS.add(worker)  # the loop keeps only weak references to tasks
    worker.add_done_callback(_WORKERS.discard)
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if not isinstance(item, Delta):
                return
    finally:
        job.cancelled.set()  # a no-op once finished; else the thread ends the generation at its next token


async def _stream(
    service: ModelService,
    job: Job,
    on_delta: Callable[[Delta], str],
    final: Callable[[Generation | None, ParsedOutput | None], Iterator[str]],
) -> AsyncIterator[str]:
    """Server-sent events of one job: a chunk per delta, then `final`'s chunks and `[DONE]`. A job refused at
    shutdown still ends cleanly (final chunks without a generation); any other failure is an error event."""
    result: tuple[Generation | None, ParsedOutput | None] = (None, None)
    try:
        async for item in _generation(service, job):
            if isinstance(item, Delta):
                yield on_delta(item)
            else:
                result = item
    except ApiError as exc:
        if exc.status != 503:
            yield _event(exc.body())
            yield DONE
            return
    except Exception as exc:  # the response has started: errors travel as an event
        log.exception("streamed request failed")
        yield _event(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body())
        yield DONE
        return
    for chunk in final(*result):
        yield chunk
    yield DONE


def _chat_events(service: ModelService, job: Job, rid: str, include_usage: bool) -> AsyncIterator[str]:
    model, tool_calls = service.model_name, 0

    def chunk(delta: ChatDelta, finish: str | None = None) -> str:
        return _event(
            ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(delta=delta, finish_reason=finish)])
        )

    def on_delta(delta: Delta) -> str:
        nonlocal tool_calls
        out = chunk(chat_delta(delta, tool_calls))
        tool_calls += delta.tool_call is not None
        return out

    def final(generation: Generation | None, parsed: ParsedOutput | None) -> Iterator[str]:
        yield chunk(ChatDelta(), finish_reason(generation, parsed.tool_calls) if generation and parsed else "abort")
        if include_usage:
            yield _event(
                ChatCompletionChunk(id=rid, model=model, choices=[], usage=UsageInfo.of(generation, job.prompt_tokens))
            )

    async def events() -> AsyncIterator[str]:
        yield chunk(ChatDelta(role="assistant", content=""))
        async for event in _stream(service, job, on_delta, final):
            yield event

    return events()


def _completion_events(service: ModelService, job: Job, rid: str, include_usage: bool) -> AsyncIterator[str]:
    model = service.model_name

    def chunk(text: str, finish: str | None = None) -> str:
        return _event(
            CompletionResponse(id=rid, model=model, choices=[CompletionChoice(text=text, finish_reason=finish)])
        )

    def final(generation: Generation | None, _: ParsedOutput | None) -> Iterator[str]:
        yield chunk("", generation.finish_reason if generation else "abort")
        if include_usage:
            yield _event(
                CompletionResponse(id=rid, model=model, choices=[], usage=UsageInfo.of(generation, job.prompt_tokens))
            )

    return _stream(service, job, lambda d: chunk(d.content), final)


class _LimitBody:
    """413 for a body over `limit` bytes: at once from Content-Length, else as soon as the count passes it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0").decode("latin-1")
        if not length.isdigit() or int(length) > self.limit:
            error = (
                ApiError(
                    413, f"the request body of {int(length):,} bytes exceeds the server's limit of {self.limit:,} bytes"
                )
                if length.isdigit()
                else ApiError(400, f"Content-Length {length!r} is not a number")
            )
            await JSONResponse(error.body(), error.status, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, f"the request body exceeds the server's limit of {self.limit:,} bytes")
            return message

        await self.app(scope, counted, send)


class _CountRequests:
    """Counts every HTTP request by method, route and status for /metrics."""

    def __init__(self, app: ASGIApp, service: ModelService) -> None:
        self.app, self.metrics = app, service.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noted)
        finally:
            route = scope.get("route")
            self.metrics.http_request(scope["method"], getattr(route, "path", "unmatched"), status)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that stops the service first, so open streams end with a final chunk before uvicorn
    waits for their connections to close."""

    def __init__(self, config: uvicorn.Config, service: ModelService) -> None:
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.stop()
        await super().shutdown(sockets)


MAX_PORT = 65535


def check_port(port: int) -> None:
    """UsageError for a port outside 0..65535: the OS would take it modulo 65536 (70000 listens on 4464) or blame the
    host (-1), so it is refused by name before anything is bound or loaded."""
    if not 0 <= port <= MAX_PORT:
        raise UsageError(f"--port must be in 0..{MAX_PORT} (0: any free port), got {port}")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port), or a UsageError saying why not."""
    check_port(port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r} is not an address this machine can listen on ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(
                f"{host}:{port}: address already in use (another process listens there; choose another --port)"
            ) from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _uvicorn(service: ModelService, api_key: str | None) -> _Uvicorn:
    config = uvicorn.Config(
        build_app(service, api_key), log_config=None, timeout_keep_alive=30, h11_max_incomplete_event_size=1 << 20
    )
    return _Uvicorn(config, service)


@dataclass
class RunningServer:
    """A server running in a background thread; use as a context manager or call `stop()`."""

    server: _Uvicorn
    thread: threading.Thread
    service: ModelService
    address: tuple[str, int]

    @property
    def base_url(self) -> str:
        return _base_url(self.address)

    def stop(self) -> None:
        """Shut down gracefully (as on Ctrl-C) and release the artifact's files."""
        self.server.should_exit = True
        self.thread.join()
        self.service.loaded.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server(
    artifact_dir: str | Path,
    host: str,
    port: int,
    runtime: RuntimeOptions,
    options: ServiceOptions,
    api_key: str | None = None,
    on_ready: Callable[[str, ModelService], None] | None = None,
) -> None:
    """Bind (a busy port fails here, before the model loads), load, serve until Ctrl-C, shut down gracefully."""
    sock = bind_socket(host, port)
    try:
        service = ModelService(artifact_dir, runtime, options)
    except BaseException:
        sock.close()
        raise
    if on_ready is not None:
        on_ready(_base_url(sock.getsockname()[:2]), service)
    try:
        _uvicorn(service, api_key).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down
        pass
    finally:
        service.loaded.close()


def serve_in_background(
    artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, **options: Any
) -> RunningServer:
    """Start a server thread. `options` are fields of RuntimeOptions (device, dtype, expert_cache, backend)
    or ServiceOptions (served_model_name, max_num_seqs, max_model_len)."""
    runtime_keys = {f.name for f in fields(RuntimeOptions)}
    service_keys = {f.name for f in fields(ServiceOptions)}
    unknown = set(options) - runtime_keys - service_keys
    if unknown:
        raise TypeError(f"unknown server option(s): {sorted(unknown)}")
    sock = bind_socket(host, port)
    service = ModelService(
        artifact_dir,
        RuntimeOptions(**{k: v for k, v in options.items() if k in runtime_keys}),
        ServiceOptions(**{k: v for k, v in options.items() if k in service_keys}),
    )
    server = _uvicorn(service, api_key)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="glmquant-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        thread.join(5)
        service.loaded.close()
        raise RuntimeError("the server thread did not start")
    return RunningServer(server, thread, service, sock.getsockname()[:2])


def _base_url(address: tuple[str, int]) -> str:
    return f"http://{address[0]}:{address[1]}/v1"
