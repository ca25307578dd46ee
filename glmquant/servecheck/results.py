"""What a serve-check run found: per case, per gate, and for the whole run (the report files are made of these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glmquant.servecheck.chat import ChatResult


@dataclass(frozen=True)
class CaseResult:
    """One scored request (or one measurement, for the speed and fidelity gates)."""

    gate: str
    name: str
    passed: bool
    reason: str
    expected: Any = None
    got: Any = None
    responses: tuple[ChatResult, ...] = ()  # the raw responses that were scored (several for a speed cell)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GateResult:
    name: str
    cases: tuple[CaseResult, ...]
    error: str | None = None  # the gate could not run at all (bad fixture, missing tokenizer, ...)
    notes: tuple[str, ...] = ()  # cells skipped or resized, and why (e.g. the endpoint's max_model_len)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def summary(self) -> str:
        if self.error is not None:
            return f"could not run: {self.error}"
        failed = [c for c in self.cases if not c.passed]
        if not failed:
            return f"{len(self.cases)}/{len(self.cases)} passed"
        return f"{len(self.cases) - len(failed)}/{len(self.cases)} passed; {failed[0].name}: {failed[0].reason}"


@dataclass(frozen=True)
class ServeCheckReport:
    target: str  # the artifact directory or the endpoint URL
    model: str  # the model name the server was asked for
    started_at: str  # ISO-8601 UTC
    finished_at: str
    seed: int
    settings: dict[str, Any]  # the run's configuration, as plain JSON values
    gates: tuple[GateResult, ...]
    skipped: dict[str, str] = field(default_factory=dict)  # gate -> why it did not run
    thresholds: dict[str, str] = field(default_factory=dict)  # gate -> what it passes on

    @property
    def passed(self) -> bool:
        """True only when at least one gate ran and every selected gate passed."""
        return bool(self.gates) and all(g.passed for g in self.gates)
