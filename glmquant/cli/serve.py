"""`glmquant serve ARTIFACT`: an OpenAI-compatible chat server on the embedded runtime (127.0.0.1 by default)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.logging import RichHandler

from glmquant.cli.common import console, guarded, out
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.server import run_server
from glmquant.runtime.service import ChatService, ServiceOptions


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@guarded
def serve(
    artifact: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="artifact directory (tr3 or exllamav3)")],
    host: Annotated[str, typer.Option(help="address to bind; keep 127.0.0.1 unless you mean to expose it")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port)")] = 8000,
    concurrency: Annotated[int, typer.Option(help="sequences generated at once; others wait in the queue")] = 1,
    expert_cache: Annotated[int, typer.Option(help="decoded virtual experts kept by the torch backend (0: none)")] = 256,
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="activation dtype: bfloat16, float16 or float32")] = "bfloat16",
    backend: Annotated[str, typer.Option(help="expert backend: torch (any device) or a registered GPU backend")] = "torch",
    model_id: Annotated[Optional[str], typer.Option(help="model name served (default: the directory name)")] = None,
    max_context: Annotated[Optional[int], typer.Option(help="prompt + completion tokens (default: the config's)")] = None,
) -> None:
    """Serve /v1/chat/completions (streaming too), /v1/models, /tokenize and /health until Ctrl-C."""
    runtime = RuntimeOptions(device=device, dtype=dtype, expert_cache=expert_cache, backend=backend)
    options = ServiceOptions(model_id=model_id, concurrency=concurrency, max_context=max_context)
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=console, show_path=False)])
    console.print(f"loading {artifact} on {device} ({dtype}, {backend} experts) ...")
    run_server(artifact, host, port, runtime, options, on_ready=_ready)


def _ready(base_url: str, service: ChatService) -> None:
    artifact = service.loaded.artifact
    out.print(f"[bold green]serving[/] {service.model_id} ({artifact.layout}, {len(artifact.quantized_layers)} quantized "
              f"MoE layers, context {service.max_context}) at [bold]{base_url}[/]  (Ctrl-C stops)")
