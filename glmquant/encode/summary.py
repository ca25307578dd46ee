"""Per-layer encode summary: mean proxy error, worst tensor, fallbacks, time, bytes written, and with
`--tune-scales` each unit's tuning (held-out error before and after, the step kept, every step's error)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from glmquant.encode.layer import TensorReport, TuningReport


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
    tuning: list[dict[str, Any]] | None = None  # one TuningReport (as a dict) per unit, in unit order

    @property
    def tuned_ratio(self) -> float | None:
        """Mean over the tuned units of held-out error after / before tuning; None without tuning."""
        ratios = [u["heldout_after"] / u["heldout_before"] for u in self.tuning or [] if u["heldout_before"] > 0]
        return sum(ratios) / len(ratios) if ratios else None


def summarize_layer(
    layer: int,
    reports: list[TensorReport],
    seconds: float,
    bytes_written: int,
    tuning: list[TuningReport] | None = None,
) -> LayerSummary:
    worst = max(reports, key=lambda r: r.proxy_error)
    fallbacks: dict[str, int] = {}
    for r in reports:
        if r.fallback:
            fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
    return LayerSummary(
        layer,
        len(reports),
        sum(r.proxy_error for r in reports) / len(reports),
        worst.name,
        worst.proxy_error,
        fallbacks,
        sorted(r.name for r in reports if r.fallback),
        round(seconds, 3),
        bytes_written,
        [{**dataclasses.asdict(t), "heldout_by_step": list(t.heldout_by_step)} for t in tuning] if tuning else None,
    )


# What each fallback means, for the warning that names its tensor (the codec's labels and encode/hessians.py's).
FALLBACK_MEANINGS = {
    "no_tokens:all": "no calibration token was routed to this expert: encoded with the all-token Hessian",
    "no_tokens:identity": "no calibration token was routed to this expert and there is no all-token Hessian: "
    "encoded uncalibrated",
    "no_hessian": "no Hessian: encoded uncalibrated",
    "no_dense_hessian:identity": "no dense Hessian for this retained linear (--retained-uncalibrated-fallback): "
    "encoded uncalibrated",
    "nonfinite_hessian": "the Hessian holds NaN or Inf: encoded uncalibrated",
    "negative_hessian": "the Hessian's diagonal is negative (no E[x x^T] is): encoded uncalibrated",
    "zero_hessian": "the Hessian is zero (no input reached it): encoded uncalibrated",
    "cholesky_failed": "the Hessian could not be factored even with extra damping: encoded uncalibrated",
}


def fallback_warnings(reports: list[TensorReport]) -> list[str]:
    """One line per tensor encoded with a fallback, naming it and saying what was done instead."""
    lines = []
    for r in reports:
        if r.fallback is None or r.fallback == "uncalibrated":  # --uncalibrated was asked for, and said once
            continue
        retries = r.fallback.removeprefix("cholesky_retry:")
        meaning = (
            f"the Hessian needed {retries} extra damping step(s) to factor"
            if retries != r.fallback
            else FALLBACK_MEANINGS.get(r.fallback, r.fallback)
        )
        lines.append(f"{r.name}: {r.fallback} ({meaning})")
    return lines


def summary_table(layers: list[LayerSummary]) -> Table:
    tuned = any(summary.tuning for summary in layers)
    table = Table(title="encode summary")
    columns = ["layer", "tensors", "mean proxy err", "worst tensor", "worst", "fallbacks"]
    columns += ["tuned err", "kept step"] if tuned else []
    for column in (*columns, "s", "bytes"):
        table.add_column(column, justify="left" if column == "worst tensor" else "right")
    for summary in layers:
        fb = ", ".join(f"{k}: {v}" for k, v in sorted(summary.fallbacks.items())) or "-"
        row = [
            str(summary.layer),
            str(summary.tensors),
            f"{summary.mean_proxy_error:.4f}",
            summary.worst_tensor.split("layers.")[-1],
            f"{summary.worst_proxy_error:.4f}",
            fb,
        ]
        if tuned:
            ratio, steps = summary.tuned_ratio, [u["best_step"] for u in summary.tuning or []]
            row += [
                "-" if ratio is None else f"x{ratio:.3f}",
                "-".join(map(str, sorted({min(steps), max(steps)}))) if steps else "-",  # "100" or "61-100"
            ]
        table.add_row(*row, f"{summary.seconds:.1f}", f"{summary.bytes_written:,}")
    return table
