"""bench_exl3_linear.py's summary: per row count, the candidate of least time summed over every shape (one that
missed a shape is not ranked), and each shape's own fastest against its default."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _row(shape: str, rows: int, steps: tuple[int, int, int], us: float, default: bool = False) -> dict[str, Any]:
    ti, tj, warps = steps
    config = {"ti": ti, "tj": tj, "split_tiles": 64, "num_warps": warps}
    return {"shape": shape, "rows": rows, "config": config, "is_default": default, "us_per_linear": us,
            "trellis_gb_s": round(1000 / us, 1)}  # fmt: skip


def test_best_ranks_whole_candidates_and_names_each_shapes_fastest() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))  # its helpers (bench_moe_decode), as when run as a script
    from bench_exl3_linear import best

    rows = [
        _row("big", 1, (2, 2, 2), 100.0, default=True),
        _row("small", 1, (2, 2, 2), 10.0, default=True),
        _row("big", 1, (2, 1, 1), 80.0),  # fastest summed (80 + 14), slower on the small shape
        _row("small", 1, (2, 1, 1), 14.0),
        _row("big", 1, (1, 4, 1), 90.0),  # faster on both shapes
        _row("small", 1, (1, 4, 1), 9.0),
        _row("big", 1, (4, 1, 1), 50.0),  # timed on one shape only (the --max-seconds cap): not ranked
        {"shape": "small", "rows": 1, "config": {"ti": 4, "tj": 1, "num_warps": 1}, "error": "did not compile"},
    ]
    summary = best(rows)["rows_1"]
    assert summary["default_us"] == 110.0
    assert summary["best"] == {"ti": 2, "tj": 1, "num_warps": 1} and summary["best_us"] == 94.0
    assert summary["speedup"] == round(110 / 94, 3)
    assert summary["per_shape"]["big"] == {"best": {"ti": 4, "tj": 1, "num_warps": 1}, "speedup": 2.0,
                                           "trellis_gb_s": 20.0}  # fmt: skip
    assert summary["per_shape"]["small"]["best"] == {"ti": 1, "tj": 4, "num_warps": 1}
    assert summary["per_shape"]["small"]["speedup"] == round(10 / 9, 3)
