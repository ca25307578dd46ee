"""`glmquant layer-costs SOURCE --observations OBS --artifact ART --out FILE`: each MoE layer's cost at K1-K4 and
the widths of least summed cost, for `encode --tiers layers:...`; `glmquant retained-costs` (the same arguments, a
speed-tier build): each decoder layer's retained linears' cost at K2-K6 and exact, for `encode
--retained-layer-bits`; `glmquant layer-widths` / `retained-widths COSTS --out FILE`: other widths from such costs,
without measuring again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from glmquant.checkpoint.hub import resolve_source
from glmquant.checkpoint.layouts import parse_layer_bits, width_name
from glmquant.cli.common import HubRevision, guarded, out
from glmquant.errors import UsageError
from glmquant.observe.layer_costs import SWEEP_BITS, LayerCosts, choose_layer_widths, measure_layer_costs
from glmquant.observe.retained_costs import (
    RETAINED_SWEEP_BITS,
    RetainedCosts,
    choose_retained_widths,
    measure_retained_costs,
)

_RETAINED_SWEEP = f"K{min(RETAINED_SWEEP_BITS)}-K{max(RETAINED_SWEEP_BITS)}"


def register(app: typer.Typer) -> None:
    app.command("layer-costs")(layer_costs)
    app.command("layer-widths")(layer_widths)
    app.command("retained-costs")(retained_costs)
    app.command("retained-widths")(retained_widths)


Source = Annotated[str, typer.Argument(help="BF16 source checkpoint the artifact was built from (directory or Hub id)")]
OutFile = Annotated[Path, typer.Option("--out", help="costs JSON to write")]
Rows = Annotated[int, typer.Option(help="calibration rows (of the observations' first lane) for the KL")]
Device = Annotated[str, typer.Option(help="cpu or cuda")]
Dtype = Annotated[
    str,
    typer.Option(
        help="compute dtype: auto (the model's), float32 (advised: BF16 rounding floors small KLs) or bfloat16"
    ),
]
BatchRows = Annotated[int, typer.Option(help="calibration rows per forward step")]
LayerMeanBits = Annotated[
    float | None, typer.Option(help="mean K of the MoE layers to allocate (default: the artifact's)")
]
RetainedMeanBits = Annotated[
    float | None,
    typer.Option(help=f"allocate the retained bytes of a mean K in {_RETAINED_SWEEP} (default: the artifact's)"),
]
ErrorExponent = Annotated[
    float,
    typer.Option(help="g of cost = KL alone x (output error ratio) ** g: 1 is second order; 0.5 fit the proxy"),
]
RetainedWidths = Annotated[
    str | None,
    typer.Option(
        help=f"the widths to choose among, e.g. K2,K4,exact (the K the fast GEMV core runs; default: "
        f"{_RETAINED_SWEEP} and exact)"
    ),
]


def _pass_options(rows: int, mean_bits: float | None, device: str, dtype: str, batch_rows: int) -> dict[str, Any]:
    """The options both measurements take alike, with a progress bar."""
    return {
        "rows": rows,
        "mean_bits": mean_bits,
        "device": device,
        "dtype": dtype,
        "batch_rows": batch_rows,
        "progress": True,
    }


def _check_out(out_file: Path) -> None:
    """Before the pass, which is the long part: a file to write in an existing directory."""
    if out_file.is_dir():
        raise UsageError(f"--out {out_file} is a directory; give the costs file's path")
    if not out_file.parent.is_dir():
        raise UsageError(f"--out {out_file}: its directory {out_file.parent} is not an existing directory")


@guarded
def layer_costs(
    source: Source,
    observations: Annotated[
        Path, typer.Option(help="the observations the artifact was encoded with (observe --tuning-tokens N)")
    ],
    artifact: Annotated[
        Path,
        typer.Option(help="an untuned build from them with natural Hessians and one K per MoE layer (the uniform K2)"),
    ],
    out_file: OutFile,
    rows: Rows = 16,
    experts: Annotated[int, typer.Option(help="experts per MoE layer encoded at K1-K4 for the error ratios")] = 8,
    mean_bits: LayerMeanBits = None,
    device: Device = "cpu",
    dtype: Dtype = "auto",
    batch_rows: BatchRows = 4,
    revision: HubRevision = None,
) -> None:
    """Measure each MoE layer's KL alone (the others exact) from the artifact and scale it to K1-K4 by sampled
    experts' output errors; print the widths of least summed cost as a --tiers spec for encode."""
    _check_out(out_file)
    pass_options = _pass_options(rows, mean_bits, device, dtype, batch_rows)
    costs = measure_layer_costs(
        resolve_source(source, revision).path, observations, artifact, experts=experts, **pass_options
    )
    _write_report(costs, out_file)


@guarded
def layer_widths(
    costs_file: Annotated[Path, typer.Argument(help="a costs file `glmquant layer-costs` wrote")],
    out_file: OutFile,
    mean_bits: LayerMeanBits = None,
) -> None:
    """Choose the MoE layers' widths again from costs `layer-costs` measured, at another mean K: no model, no pass,
    no encode; print them as a --tiers spec for encode."""
    _check_out(out_file)
    costs = choose_layer_widths(LayerCosts.load(costs_file), mean_bits)
    _write_report(costs, out_file)


@guarded
def retained_costs(
    source: Source,
    observations: Annotated[
        Path, typer.Option(help="the observations the artifact was encoded with (observe --dense-hessians)")
    ],
    artifact: Annotated[
        Path, typer.Option(help="a speed-tier build from them with one K per decoder layer (encode --retained-bits 4)")
    ],
    out_file: OutFile,
    rows: Rows = 16,
    outputs: Annotated[
        int, typer.Option(help=f"output rows of each retained linear encoded at {_RETAINED_SWEEP} for the error ratios")
    ] = 256,
    mean_bits: RetainedMeanBits = None,
    error_exponent: ErrorExponent = 0.5,
    widths: RetainedWidths = None,
    device: Device = "cpu",
    dtype: Dtype = "auto",
    batch_rows: BatchRows = 4,
    revision: HubRevision = None,
) -> None:
    """Measure each decoder layer's retained linears' KL alone (the rest exact) from a speed-tier build and scale it
    to K2-K6 by their sampled outputs' errors; print the widths of least summed cost within the byte budget as
    --retained-layer-bits for encode."""
    _check_out(out_file)
    pass_options = _pass_options(rows, mean_bits, device, dtype, batch_rows)
    costs = measure_retained_costs(
        resolve_source(source, revision).path,
        observations,
        artifact,
        outputs=outputs,
        error_exponent=error_exponent,
        offered=None if widths is None else parse_layer_bits(widths, "--widths"),
        **pass_options,
    )
    _write_report(costs, out_file)


@guarded
def retained_widths(
    costs_file: Annotated[Path, typer.Argument(help="a costs file `glmquant retained-costs` wrote")],
    out_file: OutFile,
    mean_bits: RetainedMeanBits = None,
    error_exponent: ErrorExponent = 0.5,
    widths: RetainedWidths = None,
) -> None:
    """Choose the retained linears' widths again from costs `retained-costs` measured, for another byte budget,
    other widths or another g: no model, no pass, no encode; print them as --retained-layer-bits for encode."""
    _check_out(out_file)
    costs = choose_retained_widths(
        RetainedCosts.load(costs_file),
        mean_bits=mean_bits,
        error_exponent=error_exponent,
        offered=None if widths is None else parse_layer_bits(widths, "--widths"),
    )
    _write_report(costs, out_file)


def _write_report(costs: LayerCosts | RetainedCosts, out_file: Path) -> None:
    """Write `costs` to `out_file` and print its table and the widths as encode's option."""
    costs.write(out_file)
    by_layer = {layer: (costs.artifact_bits[layer], by_k, costs.widths[layer]) for layer, by_k in costs.cost.items()}
    if isinstance(costs, LayerCosts):
        _print_costs(
            f"KL per MoE layer alone ({costs.rows} x {costs.tokens} tokens, {costs.compute_dtype})",
            SWEEP_BITS,
            by_layer,
            f"widths at mean K {costs.mean_bits:g}: [bold]--tiers {costs.tiers}[/] "
            f"(predicted KL {costs.predicted_kl:.3g}); written to {out_file}",
        )
    else:
        _print_costs(
            f"KL per decoder layer's retained linears alone ({costs.rows} x {costs.tokens} tokens)",
            RETAINED_SWEEP_BITS,
            by_layer,
            f"widths within {costs.budget_bytes / 1e9:.4g} GB: [bold]--retained-layer-bits "
            f"{costs.retained_layer_bits}[/] (predicted KL {costs.predicted_kl:.3g}); written to {out_file}",
        )


def _print_costs(
    title: str,
    bits: Sequence[int],
    by_layer: Mapping[int, tuple[int, Mapping[Any, float], int | None]],
    summary: str,
) -> None:
    """A table of each layer's K in the artifact, its cost at each of `bits` and its chosen K; then `summary`."""
    table = Table(title=title)
    for column in ("layer", "artifact K", *(f"K{k}" for k in bits), "chosen"):
        table.add_column(column, justify="right")
    for layer, (artifact_bits, cost, chosen) in by_layer.items():
        cells = [f"{cost[k]:.3g}" for k in bits]
        table.add_row(str(layer), f"K{artifact_bits}", *cells, width_name(chosen))
    out.print(table)
    out.print(summary)
