"""`observe --report`: per-layer tables and the REAP heat map PNG."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from glmquant.observe.report import build_report, expert_table, layer_table


def test_report_tables_and_heatmap(observed: Path) -> None:
    report = build_report(observed)
    assert sorted(report.stats) == [1, 2]
    assert report.heatmap is not None and report.heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.heatmap.stat().st_size > 2000
    table = layer_table(report)
    assert table.row_count == 2
    experts = expert_table(report, 1)
    assert experts.row_count == 4
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "REAP statistics" in text and str(report.stats[1].tokens) in text
    for layer, stats in report.stats.items():  # each layer's routed share, in the table and in observations.json
        share = stats.routed_share
        assert share is not None and share > 0 and f"{share:.4g}" in text
        summary = next(s for s in report.summary.layers if s.layer == layer)
        assert summary.routed_share == share
