"""`glmquant serve ARTIFACT`: an OpenAI-compatible server on the embedded runtime, with vLLM's option names."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.logging import RichHandler

from glmquant.cli.common import console, guarded, out
from glmquant.runtime.options import DENSE_LINEAR_MAX_WEIGHTS, DTYPE_CHOICES, RuntimeOptions
from glmquant.runtime.server import check_port, run_server
from glmquant.runtime.service import ModelService, ServiceOptions
from glmquant.runtime.speculative import SpeculativeConfig


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


@guarded
def serve(
    artifact: Annotated[
        Path,
        typer.Argument(
            exists=True,
            file_okay=False,
            help=(
                "artifact directory (tr3 or exllamav3); with --load-format dummy any directory holding a config.json"
            ),
        ),
    ],
    host: Annotated[
        str, typer.Option(help="address to bind; keep 127.0.0.1 unless you mean to expose it")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port)")] = 8000,
    served_model_name: Annotated[
        str | None,
        typer.Option(help="model name clients send (default: the artifact's, e.g. GLM-5.3-Flash-EXL3-2bit)"),
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(help="prompt + completion tokens per request (default: the config's max_position_embeddings)"),
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="sequences generated at once; others wait in the queue")] = 1,
    api_key: Annotated[
        str | None, typer.Option(envvar="GLMQUANT_API_KEY", help="require 'Authorization: Bearer KEY' on /v1 routes")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help=f"activation dtype: {', '.join(DTYPE_CHOICES)} (auto: the checkpoint's 16-bit dtype)")
    ] = "auto",
    device: Annotated[str, typer.Option(help="torch device: cpu, cuda, cuda:1, ...")] = "cpu",
    expert_cache: Annotated[int, typer.Option(help="decoded virtual experts the torch backend keeps (0: none)")] = 256,
    backend: Annotated[
        str, typer.Option(help="expert backend: torch (any device) or a registered GPU backend")
    ] = "torch",
    load_format: Annotated[
        str,
        typer.Option(
            help=(
                "auto: read the artifact's weights; dummy: make them from its config, as `plan` predicts them "
                "(speed tests without weight files; layout and bits from the config's quantization block, else tr3 K2)"
            )
        ),
    ] = "auto",
    model_impl: Annotated[
        str,
        typer.Option(
            help=(
                "transformers: transformers' modules; glmquant: the runtime's own forward (static caches, chunked "
                "prefill, whole decode steps as CUDA graphs with --backend triton; text only)"
            )
        ),
    ] = "transformers",
    speculative_config: Annotated[
        str | None,
        typer.Option(
            help=(
                'vLLM\'s JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\': the model\'s MTP layer drafts '
                "1..3 tokens per step, verified in one forward (greedy requests; same output; either "
                '--model-impl); "draft_head": FILE drafts with a glmquant draft-head copy of lm_head'
            )
        ),
    ] = None,
    compile_decode: Annotated[
        bool,
        typer.Option(
            help=(
                "with --model-impl glmquant: compile the decode step's math with torch.compile (fused elementwise "
                "kernels inside the step's CUDA graph; slower start; 56 -> 72 tok/s on an H200, docs/engine.md)"
            )
        ),
    ] = False,
    dense_linear_max_weights: Annotated[
        int,
        typer.Option(
            help=(
                "with a Triton backend: EXL3 retained linears (the speed tier) of at most "
                "this many weights run decoded at load instead of through the EXL3 kernels (0: none)"
            )
        ),
    ] = DENSE_LINEAR_MAX_WEIGHTS,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /version and
    /metrics until Ctrl-C, which ends open streams cleanly before exiting."""
    check_port(port)
    runtime = RuntimeOptions(
        device=device,
        dtype=dtype,
        expert_cache=expert_cache,
        backend=backend,
        load_format=load_format,
        model_impl=model_impl,
        speculative_config=SpeculativeConfig.parse(speculative_config) if speculative_config is not None else None,
        compile_decode=compile_decode,
        dense_linear_max_weights=dense_linear_max_weights,
    )
    options = ServiceOptions(
        served_model_name=served_model_name, max_num_seqs=max_num_seqs, max_model_len=max_model_len
    )
    # A terminal gets rich's aligned log; a pipe or file plain lines (rich would pad each to the console's width)
    handler = RichHandler(console=console, show_path=False) if console.is_terminal else logging.StreamHandler()
    fmt = "%(message)s" if console.is_terminal else "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, handlers=[handler])
    console.print(
        f"loading {artifact} on {device} ({dtype}, {backend} experts, {model_impl} modules"
        f"{', dummy weights' if load_format == 'dummy' else ''}) ..."
    )
    run_server(artifact, host, port, runtime, options, api_key, on_ready=_ready)
    console.print("stopped")


def _ready(base_url: str, service: ModelService) -> None:
    artifact = service.loaded.artifact
    out.print(
        f"[bold green]serving[/] {service.model_name} ({artifact.layout}, {len(artifact.quantized_layers)} "
        f"quantized MoE layers, context {service.max_model_len}) at [bold]{base_url}[/]  (Ctrl-C stops)"
    )
