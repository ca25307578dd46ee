"""`glmquant observe --report`: per-layer tables of the router and REAP statistics, and a heat map PNG
(MoE layers x experts, REAP saliency) drawn with matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from glmquant.observe.stats import LayerStats
from glmquant.observe.summary import ObservationSummary

HEATMAP_FILE = "reap_saliency.png"


@dataclass(frozen=True)
class ObservationReport:
    summary: ObservationSummary
    stats: dict[int, LayerStats]
    heatmap: Path | None


def build_report(obs_dir: Path) -> ObservationReport:
    """Load a finished observation's statistics and draw the heat map beside them."""
    summary = ObservationSummary.load(obs_dir)
    stats = {x.layer: LayerStats.load(obs_dir / x.stats_file) for x in summary.layers if x.stats_file}
    heatmap = write_heatmap(stats, obs_dir / HEATMAP_FILE) if stats else None
    return ObservationReport(summary, stats, heatmap)


def layer_table(report: ObservationReport, top: int = 5) -> Table:
    """One row per MoE layer: tokens, coverage, balance, routed share (what `--tiers share:...` ranks), saliency range
    and the most salient experts."""
    summary = report.summary
    table = Table(title=f"REAP statistics (token rows {summary.token_rows_sha256[:12]}, hessians {summary.hessians})")
    for column in (
        "layer",
        "tokens",
        "experts hit",
        "load imbalance",
        "max share",
        "routed share",
        "REAP min",
        "REAP max",
        f"top {top} by REAP",
    ):
        table.add_column(column, justify="right" if column != f"top {top} by REAP" else "left")
    for layer, s in sorted(report.stats.items()):
        reap = s.reap
        best = torch.argsort(-reap, stable=True)[:top].tolist()
        table.add_row(
            str(layer),
            str(s.tokens),
            f"{int((s.count > 0).sum())}/{s.count.numel()}",
            f"{s.load_imbalance:.2f}",
            f"{s.selection_share.max().item():.3f}",
            "-" if s.routed_share is None else f"{s.routed_share:.4g}",
            f"{reap.min().item():.4g}",
            f"{reap.max().item():.4g}",
            " ".join(f"{e}:{reap[e].item():.3g}" for e in best),
        )
    return table


def expert_table(report: ObservationReport, layer: int) -> Table:
    """Every expert of one layer with all its statistics."""
    s = report.stats[layer]
    table = Table(title=f"layer {layer} experts")
    for column in ("expert", "tokens", "share", "EAN", "REAP", "Σg", "max ‖f‖", "mean score"):
        table.add_column(column, justify="right")
    mean_score = s.sums["sum_score"] / max(1, s.tokens)
    for e in range(s.count.numel()):
        table.add_row(
            str(e),
            str(int(s.count[e])),
            f"{s.selection_share[e].item():.4f}",
            f"{s.ean[e].item():.4g}",
            f"{s.reap[e].item():.4g}",
            f"{s.sums['sum_gate'][e].item():.4g}",
            f"{s.max_norm[e].item():.4g}",
            f"{mean_score[e].item():.4f}",
        )
    return table


def write_heatmap(stats: dict[int, LayerStats], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(stats)
    grid = torch.stack([stats[i].reap for i in layers]).numpy()
    fig, ax = plt.subplots(figsize=(min(24, 6 + grid.shape[1] * 0.05), 2 + 0.25 * len(layers)))
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), [str(i) for i in layers])
    ax.set_title("REAP saliency per expert")
    fig.colorbar(image, ax=ax, label="saliency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
