"""serve-check.json (everything, raw responses included) and serve-check.md (the tables a person reads)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from glmquant.servecheck.chat import ChatResult
from glmquant.servecheck.config import REPORT_JSON, REPORT_MD
from glmquant.servecheck.results import CaseResult, ServeCheckReport

SCHEMA_VERSION = 1


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def response_json(r: ChatResult) -> dict[str, Any]:
    """A response with the derived timings (TTFT, wall, decode tok/s) spelled out."""
    t = r.timings
    return {
        "content": r.content,
        "reasoning": r.reasoning,
        "tool_calls": [_plain(c) for c in r.tool_calls],
        "finish_reason": r.finish_reason,
        "usage": _plain(r.usage),
        "error": r.error,
        "wall_s": t.wall_s if t else None,
        "ttft_s": t.ttft_s if t else None,
        "decode_tps": r.decode_tps,
    }


def report_json(report: ServeCheckReport) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": report.passed,
        "target": report.target,
        "model": report.model,
        "started_at": report.started_at,
        "finished_at": report.finished_at,
        "seed": report.seed,
        "settings": report.settings,
        "skipped_gates": report.skipped,
        "thresholds": report.thresholds,
        "gates": [
            {
                "name": g.name,
                "passed": g.passed,
                "summary": g.summary,
                "error": g.error,
                "notes": list(g.notes),
                "cases": [
                    {
                        "name": c.name,
                        "passed": c.passed,
                        "reason": c.reason,
                        "expected": _plain(c.expected),
                        "got": _plain(c.got),
                        "metrics": c.metrics,
                        "responses": [response_json(r) for r in c.responses],
                    }
                    for c in g.cases
                ],
            }
            for g in report.gates
        ],
    }


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def case_row(case: CaseResult) -> list[str]:
    """Case, result, reason, finish, prompt/completion tokens, TTFT, wall, decode tok/s (first response)."""
    r = case.responses[0] if case.responses else None
    u, t = (r.usage, r.timings) if r else (None, None)
    return [
        case.name,
        "PASS" if case.passed else "FAIL",
        case.reason,
        (r.finish_reason or "-") if r else "-",
        _num(u.prompt_tokens if u else None),
        _num(u.completion_tokens if u else None),
        _num(t.ttft_s if t else None),
        _num(t.wall_s if t else None),
        _num(r.decode_tps if r else None),
    ]


CASE_COLUMNS = [
    "case",
    "result",
    "reason",
    "finish",
    "prompt tok",
    "completion tok",
    "TTFT s",
    "wall s",
    "decode tok/s",
]


def report_markdown(report: ServeCheckReport) -> str:
    lines = [
        f"# serve-check: {'PASS' if report.passed else 'FAIL'}",
        "",
        f"- target: `{report.target}`",
        f"- model: `{report.model}`",
        f"- started {report.started_at}, finished {report.finished_at}",
        f"- seed: {report.seed}",
        "",
        "| gate | result | summary | passes on |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {g.name} | {'PASS' if g.passed else 'FAIL'} | {_cell(g.summary)} | "
        f"{_cell(report.thresholds.get(g.name, '-'))} |"
        for g in report.gates
    ]
    lines += [f"| {name} | SKIP | {_cell(why)} | - |" for name, why in report.skipped.items()]
    for gate in report.gates:
        lines += ["", f"## {gate.name}", ""]
        lines += [f"- {_cell(note)}" for note in gate.notes] + ([""] if gate.notes else [])
        if gate.error is not None:
            lines.append(f"could not run: {gate.error}")
            continue
        lines += ["| " + " | ".join(CASE_COLUMNS) + " |", "|" + "---|" * len(CASE_COLUMNS)]
        lines += ["| " + " | ".join(_cell(c) for c in case_row(case)) + " |" for case in gate.cases]
        measured = [case for case in gate.cases if case.metrics]
        if measured:
            keys = list(measured[0].metrics)
            lines += ["", "| case | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            lines += [f"| {c.name} | " + " | ".join(_num(c.metrics.get(k), 4) for k in keys) + " |" for c in measured]
    return "\n".join(lines) + "\n"


def result_text(passed: bool) -> Text:
    return Text("PASS", style="green") if passed else Text("FAIL", style="red")


def summary_table(report: ServeCheckReport) -> Table:
    """Every gate: its result and summary with any notes, what it passes on; skipped gates and why."""
    table = Table(title=f"serve-check of {report.target}: {'PASS' if report.passed else 'FAIL'}")
    for column in ("gate", "result", "summary", "passes on"):
        table.add_column(column, overflow="fold", no_wrap=column in ("gate", "result"))
    for gate in report.gates:
        summary = "; ".join((gate.summary, *gate.notes))
        table.add_row(gate.name, result_text(gate.passed), Text(summary), Text(report.thresholds.get(gate.name, "-")))
    for name, why in report.skipped.items():
        table.add_row(name, Text("SKIP", style="yellow"), Text(why), "-")
    return table


def write_report(report: ServeCheckReport, directory: Path) -> tuple[Path, Path]:
    """Write both files atomically (a reader never sees half a report)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / REPORT_JSON, directory / REPORT_MD
    texts = json.dumps(report_json(report), indent=2, ensure_ascii=False) + "\n", report_markdown(report)
    for path, text in zip(paths, texts):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return paths
