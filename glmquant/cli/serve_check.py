"""`glmquant serve-check ARTIFACT | --endpoint URL`: the acceptance gates in a live table; exit 0 only if all pass."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.live import Live
from rich.table import Table
from rich.text import Text

from glmquant.cli.common import console, guarded, out
from glmquant.errors import UsageError
from glmquant.servecheck import ALL_GATES, CaseResult, ServeCheckConfig, serve_check
from glmquant.servecheck.config import REPORT_JSON, REPORT_MD
from glmquant.servecheck.report import result_text, summary_table

if TYPE_CHECKING:
    from glmquant.runtime.speculative import SpeculativeConfig


def register(app: typer.Typer) -> None:
    app.command("serve-check")(serve_check_command)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _ints(value: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _csv(value))
    except ValueError:
        raise UsageError(f"{option} takes comma-separated integers, got {value!r}") from None


def _cases_table(rows: list[list[str | Text]]) -> Table:
    table = Table(title="serve-check cases")
    for column in ("gate", "case", "result", "reason", "TTFT s", "decode tok/s"):
        table.add_column(column, overflow="fold", no_wrap=column != "reason", ratio=4 if column == "reason" else None)
    for row in rows:
        table.add_row(*row)
    return table


class LiveTable:
    """The run's cases as rows of a rich table, redrawn as each case starts and ends."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.rows: dict[tuple[str, str], list[str | Text]] = {}

    def started(self, gate: str, case: str) -> None:
        self.rows[(gate, case)] = [gate, case, Text("running", style="yellow"), "", "", ""]
        self.live.update(self.table())

    def finished(self, case: CaseResult) -> None:
        r = case.responses[0] if case.responses else None
        ttft = r.timings.ttft_s if r and r.timings else None
        tps = r.decode_tps if r else None
        self.rows[(case.gate, case.name)] = [
            case.gate,
            case.name,
            result_text(case.passed),
            Text(case.reason),  # model text is never rich markup
            "-" if ttft is None else f"{ttft:.2f}",
            "-" if tps is None else f"{tps:.1f}",
        ]
        self.live.update(self.table())

    def table(self) -> Table:
        return _cases_table(list(self.rows.values()))


Opt = typer.Option


@guarded
def serve_check_command(
    artifact: Annotated[Path | None, typer.Argument(help="artifact directory, served on a free local port")] = None,
    endpoint: Annotated[str | None, Opt(help="an OpenAI-compatible server instead (http://host:8000/v1)")] = None,
    model: Annotated[str | None, Opt(help="model name to ask for (default: the first one listed)")] = None,
    gates: Annotated[
        str,
        Opt(help=f"comma-separated subset of {','.join(ALL_GATES)} (default: all; fidelity only with --bf16-source)"),
    ] = "",
    needle_tokens: Annotated[int, Opt(help="prompt tokens of the long-context gate")] = 200_000,
    speed_inputs: Annotated[str, Opt(help="comma-separated prompt lengths of the speed cells")] = "1024,32768",
    concurrency: Annotated[int, Opt(help="concurrent streams per speed cell")] = 1,
    bf16_source: Annotated[Path | None, Opt(help="BF16 source checkpoint: enables the fidelity gate")] = None,
    kl_max: Annotated[float, Opt(help="fidelity: highest passing mean KL (nats)")] = 0.5,
    top1_min: Annotated[float, Opt(help="fidelity: lowest passing top-1 agreement (0-1)")] = 0.75,
    min_decode_tps: Annotated[float, Opt(help="speed: lowest passing mean decode tok/s per stream")] = 5.0,
    panel_rows: Annotated[int, Opt(help="fidelity: panel rows")] = 4,
    panel_tokens: Annotated[int, Opt(help="fidelity: tokens per panel row")] = 256,
    panel_text: Annotated[Path | None, Opt(help="fidelity: a UTF-8 text file instead of the built-in panel")] = None,
    tokenizer: Annotated[
        Path | None, Opt(help="the model's tokenizer directory (default: ARTIFACT, else the endpoint's /tokenize)")
    ] = None,
    max_tokens: Annotated[int | None, Opt(help="cap on generated tokens per request (default: none)")] = None,
    token_tolerance: Annotated[int, Opt(help="allowed |server - local| prompt tokens")] = 8,
    seed: Annotated[int | None, Opt(help="seed of nonces and needle values (default: random, recorded)")] = None,
    timeout: Annotated[float, Opt(help="seconds per request")] = 1800.0,
    device: Annotated[str, Opt(help="device of the embedded server and the fidelity gate")] = "cpu",
    backend: Annotated[str, Opt(help="expert backend of the embedded server (as serve's --backend)")] = "torch",
    model_impl: Annotated[
        str, Opt(help="the embedded server's modules: transformers or glmquant (as serve's)")
    ] = "transformers",
    load_format: Annotated[
        str,
        Opt(
            help="auto, or dummy: the embedded server makes weights from the config "
            "(as serve's; for speed and load tests, not answers)"
        ),
    ] = "auto",
    speculative_config: Annotated[
        str | None,
        Opt(
            help='the embedded server\'s MTP speculation, as serve\'s (e.g. \'{"method": "mtp", '
            '"num_speculative_tokens": 2}\'); the speed gate reports acceptance rate and tokens per step'
        ),
    ] = None,
    api_key: Annotated[str, Opt(envvar="OPENAI_API_KEY", help="API key for --endpoint")] = "EMPTY",
    out_dir: Annotated[
        Path | None, Opt("--out", help="directory for serve-check.json/.md (default: ARTIFACT, else .)")
    ] = None,
) -> None:
    """Run the acceptance gates; write serve-check.json and serve-check.md; exit 0 only if every gate passed."""
    config = ServeCheckConfig(
        artifact=artifact,
        endpoint=endpoint,
        model=model,
        gates=_csv(gates),
        needle_tokens=needle_tokens,
        speed_inputs=_ints(speed_inputs, "--speed-inputs"),
        concurrency=concurrency,
        bf16_source=bf16_source,
        kl_max=kl_max,
        top1_min=top1_min,
        min_decode_tps=min_decode_tps,
        panel_rows=panel_rows,
        panel_tokens=panel_tokens,
        panel_text=panel_text,
        out=out_dir,
        tokenizer=tokenizer,
        max_tokens=max_tokens,
        token_tolerance=token_tolerance,
        seed=seed,
        timeout_s=timeout,
        device=device,
        backend=backend,
        model_impl=model_impl,
        load_format=load_format,
        speculative_config=_speculative(speculative_config),
        api_key=api_key,
    )
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        cases = LiveTable(live)
        report = serve_check(config, cases)
    out.print(cases.table())
    out.print(summary_table(report))
    out.print(f"reports: {config.report_dir / REPORT_JSON}, {config.report_dir / REPORT_MD}")
    raise typer.Exit(0 if report.passed else 1)


def _speculative(text: str | None) -> SpeculativeConfig | None:
    if text is None:
        return None
    from glmquant.runtime.speculative import SpeculativeConfig

    return SpeculativeConfig.parse(text)
