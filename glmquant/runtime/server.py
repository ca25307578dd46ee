"""OpenAI-compatible HTTP server on the standard library (`ThreadingHTTPServer`, HTTP/1.1 keep-alive).

Endpoints: POST /v1/chat/completions (JSON, or server-sent events with `data: [DONE]` when `stream`),
GET /v1/models, POST /tokenize, GET /health. Every request runs in its own thread; generation is queued
by the ChatService. Any failure becomes an OpenAI-style JSON error and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from glmquant.runtime.glm_output import Delta
from glmquant.runtime.openai_api import (
    ApiError,
    chunk_body,
    completion_body,
    completion_id,
    finish_reason,
    parse_chat_request,
    tool_call_json,
    usage,
)
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.service import ChatService, ServiceOptions

log = logging.getLogger("glmquant.serve")
MAX_REQUEST_BYTES = 64 << 20  # base64 images make bodies large; anything beyond is refused with 413


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        self._route({"/health": lambda _: self.server.service.health(),
                     "/v1/models": lambda _: self.server.service.models()}, read_body=False)

    def do_POST(self) -> None:  # noqa: N802
        self._route({"/v1/chat/completions": self._chat, "/tokenize": self.server.service.tokenize})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.info("%s %s", self.address_string(), format % args)

    def _route(self, routes: dict[str, Any], read_body: bool = True) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._json_body() if read_body else None
            if path not in routes:
                raise ApiError(404, f"no route {self.command} {path}", code="not_found")
            result = routes[path](body)
            if result is not None:
                self._send_json(200, result)
        except ApiError as exc:
            self._send_json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001  (a bug must cost one request, not the server)
            log.exception("request failed")
            self._send_json(500, ApiError(500, f"internal error: {exc}", type="server_error").body())

    def _json_body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411 if length is None else 400, "a Content-Length header is required")
        if int(length) > MAX_REQUEST_BYTES:
            self.close_connection = True  # the body is not read
            raise ApiError(413, f"request body of {length} bytes exceeds {MAX_REQUEST_BYTES}", code="request_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def _chat(self, body: Any) -> dict[str, Any] | None:
        service = self.server.service
        request = parse_chat_request(body, service.model_id, service.defaults)
        if not request.stream:
            generation, parsed = service.complete(request)
            return completion_body(completion_id(), service.model_id, generation, parsed)
        _SseStream(self, service.model_id, request.include_usage).run(lambda on_delta: service.complete(request, on_delta))
        return None

    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _SseStream:
    """One streamed completion: headers are sent with the first event, so early errors stay plain JSON."""

    def __init__(self, handler: _Handler, model_id: str, include_usage: bool) -> None:
        self.handler, self.model_id, self.include_usage = handler, model_id, include_usage
        self.cid, self.started, self.tool_calls = completion_id(), False, 0

    def run(self, complete: Any) -> None:
        try:
            generation, parsed = complete(self.on_delta)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001  (once streaming, errors travel as an event)
            if not self.started:
                raise
            log.exception("streamed request failed")
            error = exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {exc}", type="server_error")
            self.event(error.body())
        else:
            self.chunk({} if self.started else {"role": "assistant", "content": ""},
                       finish_reason(generation, parsed.tool_calls))
            if self.include_usage:
                self.event(chunk_body(self.cid, self.model_id, None, usage_=usage(generation), include_usage=True))
        self.write(b"data: [DONE]\n\n")
        self.write(b"")

    def on_delta(self, delta: Delta) -> None:
        if not self.started:
            self.chunk({"role": "assistant", "content": ""})
        if delta.tool_call is not None:
            self.chunk({"tool_calls": [tool_call_json(delta.tool_call, self.tool_calls)]})
            self.tool_calls += 1
        else:
            self.chunk({"content": delta.content} if delta.content else {"reasoning_content": delta.reasoning})

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> None:
        self.event(chunk_body(self.cid, self.model_id, delta, finish, include_usage=self.include_usage))

    def event(self, body: dict[str, Any]) -> None:
        self.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())

    def write(self, data: bytes) -> None:
        """Send one HTTP chunk (an empty one ends the response)."""
        h = self.handler
        if not self.started:
            self.started = True
            h.send_response(HTTPStatus.OK)
            h.send_header("Content-Type", "text/event-stream")
            h.send_header("Cache-Control", "no-cache")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
        h.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()


class _Server(ThreadingHTTPServer):
    """Handler threads are joined on close (not left as daemons: a daemon thread killed while the interpreter
    shuts down can abort the process from inside native code); idle keep-alive connections are closed first."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], service: ChatService) -> None:
        super().__init__(address, _Handler)
        self.service = service
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Wake every handler blocked on a kept-alive connection so that close can join it."""
        with self._open_lock:
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def server_close(self) -> None:
        self.close_connections()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up is routine; anything else is logged with its traceback."""
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


@dataclass
class RunningServer:
    """A server running in a background thread; use as a context manager or call `stop()`."""

    server: _Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def service(self) -> ChatService:
        return self.server.service

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
        self.service.loaded.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_server(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 runtime: RuntimeOptions = RuntimeOptions(), options: ServiceOptions = ServiceOptions()) -> _Server:
    """Load the artifact and bind the socket (port 0: any free port); `serve_forever()` starts serving."""
    return _Server((host, port), ChatService(artifact_dir, runtime, options))


def run_server(artifact_dir: str | Path, host: str, port: int, runtime: RuntimeOptions, options: ServiceOptions,
               on_ready: Callable[[str, ChatService], None] | None = None) -> None:
    """Load, bind and serve until interrupted (Ctrl-C), then close the socket."""
    server = build_server(artifact_dir, host, port, runtime, options)
    if on_ready is not None:
        on_ready(f"http://{server.server_address[0]}:{server.server_address[1]}/v1", server.service)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def serve_in_background(artifact_dir: str | Path, host: str = "127.0.0.1", port: int = 0, **options: Any) -> RunningServer:
    """Start a server thread. `options` are fields of RuntimeOptions (device, dtype, expert_cache, backend)
    or ServiceOptions (model_id, concurrency, max_context, default_max_tokens)."""
    runtime_keys = {f.name for f in fields(RuntimeOptions)}
    service_keys = {f.name for f in fields(ServiceOptions)}
    unknown = set(options) - runtime_keys - service_keys
    if unknown:
        raise TypeError(f"unknown server option(s): {sorted(unknown)}")
    server = build_server(artifact_dir, host, port,
                          RuntimeOptions(**{k: v for k, v in options.items() if k in runtime_keys}),
                          ServiceOptions(**{k: v for k, v in options.items() if k in service_keys}))
    thread = threading.Thread(target=server.serve_forever, name="glmquant-serve", daemon=True)
    thread.start()
    return RunningServer(server, thread)
