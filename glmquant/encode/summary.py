"""Per-layer encode summary: mean proxy error, worst tensor, fallbacks, time, bytes written."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from glmquant.encode.layer import TensorReport


@dataclass(frozen=True)
class LayerSummary:
    layer: int
    tensors: int
    mean_proxy_error: float
    worst_tensor: str
    worst_proxy_error: float
    fallbacks: dict[str, int]
    fallback_tensors: list[str]
    seconds: float
    bytes_written: int


def summarize_layer(layer: int, reports: list[TensorReport], seconds: float, bytes_written: int) -> LayerSummary:
    worst = max(reports, key=lambda r: r.proxy_error)
    fallbacks: dict[str, int] = {}
    for r in reports:
        if r.fallback:
            fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
    return LayerSummary(layer, len(reports), sum(r.proxy_error for r in reports) / len(reports), worst.name,
                        worst.proxy_error, fallbacks, sorted(r.name for r in reports if r.fallback),
                        round(seconds, 3), bytes_written)


def summary_table(layers: list[LayerSummary]) -> Table:
    table = Table(title="encode summary")
    for column in ("layer", "tensors", "mean proxy err", "worst tensor", "worst", "fallbacks", "s", "bytes"):
        table.add_column(column, justify="left" if column == "worst tensor" else "right")
    for l in layers:
        fb = ", ".join(f"{k}: {v}" for k, v in sorted(l.fallbacks.items())) or "-"
        table.add_row(str(l.layer), str(l.tensors), f"{l.mean_proxy_error:.4f}", l.worst_tensor.split("layers.")[-1],
                      f"{l.worst_proxy_error:.4f}", fb, f"{l.seconds:.1f}", f"{l.bytes_written:,}")
    return table
