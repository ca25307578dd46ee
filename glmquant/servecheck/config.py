"""ServeCheckConfig: everything one serve-check run needs, built once at the CLI edge and checked here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmquant.errors import UsageError

if TYPE_CHECKING:  # the runtime package is imported only by a run that serves the artifact itself
    from glmquant.runtime.speculative import SpeculativeConfig

ALL_GATES = ("text", "tools", "multilingual", "images", "video", "needle", "speed", "fidelity")
REPORT_JSON, REPORT_MD = "serve-check.json", "serve-check.md"


@dataclass(frozen=True)
class ServeCheckConfig:
    """`gates=()` selects every gate, fidelity only when a BF16 source is given; `deselected_reason` says why the
    others are skipped. `max_tokens=None` sends no limit (as the gates doc asks); tiny models that never stop need
    one. `seed=None` draws a fresh nonce seed (recorded in the report, so a run can be repeated with it). Prompts
    are sized with `tokenizer` (default: the artifact's), else with the endpoint's `/tokenize`."""

    artifact: Path | None = None
    endpoint: str | None = None
    model: str | None = None
    gates: tuple[str, ...] = ()
    needle_tokens: int = 200_000
    speed_inputs: tuple[int, ...] = (1024, 32768)
    concurrency: int = 1
    bf16_source: Path | None = None
    kl_max: float = 0.5
    top1_min: float = 0.75
    min_decode_tps: float = 5.0  # speed: the slowest passing mean decode tok/s of a cell's streams
    panel_rows: int = 4
    panel_tokens: int = 256
    panel_text: Path | None = None
    out: Path | None = None
    tokenizer: Path | None = None
    max_tokens: int | None = None
    token_tolerance: int = 8
    seed: int | None = None
    timeout_s: float = 1800.0
    device: str = "cpu"
    backend: str = "torch"  # the embedded server's expert backend, model implementation and weights (RuntimeOptions)
    model_impl: str = "transformers"
    load_format: str = "auto"
    speculative_config: SpeculativeConfig | None = None  # the embedded server's MTP speculation (serve's option)
    api_key: str = "EMPTY"
    deselected_reason: str = "not selected (--gates)"

    def __post_init__(self) -> None:
        if (self.artifact is None) == (self.endpoint is None):
            raise UsageError("give exactly one of ARTIFACT (served here) or --endpoint URL")
        if self.speculative_config is not None and self.artifact is None:
            raise UsageError(
                "--speculative-config configures the embedded server (ARTIFACT); an --endpoint decodes as started"
            )
        unknown = sorted(set(self.gates) - set(ALL_GATES))
        if unknown:
            raise UsageError(f"unknown gate(s) {', '.join(unknown)}; choose from {','.join(ALL_GATES)}")
        if "fidelity" in self.selected_gates and (self.bf16_source is None or self.artifact is None):
            raise UsageError(
                "the fidelity gate runs the artifact in-process against its BF16 source: "
                "give ARTIFACT (not --endpoint) and --bf16-source DIR"
            )
        for name, value in (
            ("--needle-tokens", self.needle_tokens),
            ("--concurrency", self.concurrency),
            ("--panel-rows", self.panel_rows),
            ("--panel-tokens", self.panel_tokens),
        ):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if not self.speed_inputs or min(self.speed_inputs) < 1:
            raise UsageError(f"--speed-inputs must be positive token counts, got {self.speed_inputs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.kl_max <= 0 or not 0 <= self.top1_min <= 1:
            raise UsageError(f"--kl-max must be > 0 and --top1-min in [0, 1], got {self.kl_max}, {self.top1_min}")
        if self.min_decode_tps < 0:
            raise UsageError(f"--min-decode-tps must be >= 0, got {self.min_decode_tps}")

    @property
    def selected_gates(self) -> tuple[str, ...]:
        if self.gates:
            return tuple(g for g in ALL_GATES if g in self.gates)
        return tuple(g for g in ALL_GATES if g != "fidelity" or self.bf16_source is not None)

    @property
    def skipped_gates(self) -> dict[str, str]:
        """Every gate that will not run, and why."""
        selected = self.selected_gates
        return {
            g: (
                "needs --bf16-source DIR and ARTIFACT (it runs the artifact in-process)"
                if g == "fidelity" and self.bf16_source is None and not self.gates
                else self.deselected_reason
            )
            for g in ALL_GATES
            if g not in selected
        }

    @property
    def thresholds(self) -> dict[str, str]:
        """What each selected gate passes on."""
        rules = {
            "text": "content exactly FINAL_BASELINE_OK, finish stop",
            "tools": "exactly one get_weather call with {city: Paris, country: France}",
            "multilingual": "each echo exact, finish stop",
            "images": "each JSON answer exact",
            "video": "each JSON answer exact",
            "needle": f"all 4 values exact, finish stop, server prompt tokens within {self.token_tolerance} of the "
            f"local count, no prefix-cache hit",
            "speed": f"every stream completes with usage, prompt tokens within {self.token_tolerance}, mean decode "
            f">= {self.min_decode_tps:g} tok/s",
            "fidelity": f"mean KL <= {self.kl_max:g} nats and top-1 agreement >= {self.top1_min:g}",
        }
        return {g: rules[g] for g in self.selected_gates}

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where the model's tokenizer is: the explicit one, else the artifact's (not with dummy weights: the server
        may use a stand-in, so its /tokenize counts), else the BF16 source's."""
        return self.tokenizer or (self.artifact if self.load_format == "auto" else None) or self.bf16_source

    @property
    def report_dir(self) -> Path:
        return self.out or self.artifact or Path.cwd()

    def check_report_dir(self) -> None:
        """UsageError unless the reports can be written into `report_dir` (made if missing): checked before any gate
        runs, since a run can take hours and would otherwise fail only when it writes them."""
        target = self.report_dir
        name = f"--out {target}" if self.out is not None else f"the report directory {target} (default of --out)"
        existing = target
        while not (existing.exists() or existing.is_symlink()) and existing.parent != existing:
            existing = existing.parent
        if existing == target and not target.is_dir():
            what = "a file" if target.is_file() else "not a directory"
            raise UsageError(f"{name} is {what}; give a directory for serve-check.json/.md")
        if not existing.is_dir():
            what = "a file" if existing.is_file() else "not a directory"
            raise UsageError(f"{name} cannot be made: {existing} is {what}")
        if not os.access(existing, os.W_OK | os.X_OK):
            why = "is not writable" if existing == target else f"cannot be made: {existing} is not writable"
            raise UsageError(f"{name} {why}; give a directory you can write serve-check.json/.md into")
