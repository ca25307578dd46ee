"""serve_check: start the embedded server (or use an endpoint), run the selected gates, write the reports."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from glmquant.errors import GlmquantError, UsageError
from glmquant.servecheck.chat import ChatRequest, ChatResult
from glmquant.servecheck.client import ChatClient
from glmquant.servecheck.config import ServeCheckConfig
from glmquant.servecheck.fidelity import check_source_matches, measure_fidelity, score_fidelity
from glmquant.servecheck.gates import CHAT_GATES, Case
from glmquant.servecheck.needle import build_needle_prompt, score_needle
from glmquant.servecheck.panel import panel_ids
from glmquant.servecheck.report import write_report
from glmquant.servecheck.results import CaseResult, GateResult, ServeCheckReport
from glmquant.servecheck.speed import build_speed_requests, run_cell, score_cell
from glmquant.servecheck.tokens import PromptTokenizer, ServerTokenizer, Tokenizer

ANSWER_RESERVE = 1024  # context tokens left for the answer when --max-tokens does not say


class Observer(Protocol):
    """Told when each case starts and ends (the CLI's live table)."""

    def started(self, gate: str, case: str) -> None: ...

    def finished(self, case: CaseResult) -> None: ...


class _Quiet:
    def started(self, gate: str, case: str) -> None:
        pass

    def finished(self, case: CaseResult) -> None:
        pass


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _openai_base(endpoint: str) -> str:
    """The OpenAI base URL of a server given with or without its `/v1`."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


@contextlib.contextmanager
def _server(config: ServeCheckConfig) -> Iterator[str]:
    """The endpoint to test: the given one, or the embedded server on a free local port for the artifact."""
    if config.endpoint is not None:
        yield _openai_base(config.endpoint)
        return
    from glmquant.runtime.server import serve_in_background

    assert config.artifact is not None  # ServeCheckConfig takes an artifact or an endpoint, exactly one
    with serve_in_background(
        config.artifact,
        host="127.0.0.1",
        port=0,
        device=config.device,
        backend=config.backend,
        model_impl=config.model_impl,
        load_format=config.load_format,
        speculative_config=config.speculative_config,
        max_num_seqs=config.concurrency,
    ) as server:
        yield _openai_base(server.base_url)


@dataclasses.dataclass
class _Run:
    """The state shared by the gates of one run."""

    config: ServeCheckConfig
    seed: int
    observer: Observer
    client: ChatClient | None = None
    model: str = ""
    base_url: str = ""
    max_model_len: int | None = None  # the endpoint's context length, when its model listing states one
    notes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    _tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer files if at hand, else the endpoint's /tokenize."""
        if self._tokenizer is None:
            directory = self.config.tokenizer_dir
            self._tokenizer = (
                PromptTokenizer.from_dir(directory)
                if directory is not None
                else ServerTokenizer(self.base_url.removesuffix("/v1"), self.model, self.config.timeout_s)
            )
        return self._tokenizer

    def fits(self, gate: str, prompt_tokens: int) -> int | None:
        """The prompt size a cell can use within the endpoint's max_model_len (None: skip it), noted when cut."""
        reserve = self.config.max_tokens or ANSWER_RESERVE
        if self.max_model_len is None or prompt_tokens + reserve <= self.max_model_len:
            return prompt_tokens
        room = self.max_model_len - reserve
        verdict = f"sized to {room}" if gate == "needle" and room > 0 else "skipped"
        self.notes.setdefault(gate, []).append(
            f"{prompt_tokens}-token prompt {verdict}: the endpoint's max_model_len is {self.max_model_len}, "
            f"{reserve} tokens kept for the answer"
        )
        return room if verdict != "skipped" else None

    def send(self, request: ChatRequest) -> ChatResult:
        assert self.client is not None
        return self.client.complete(self.model, request)

    def record(self, case: CaseResult) -> CaseResult:
        self.observer.finished(case)
        return case

    def chat_case(self, case: Case) -> CaseResult:
        self.observer.started(case.gate, case.name)
        result = self.send(case.request)
        verdict = case.score(result)
        return self.record(
            CaseResult(case.gate, case.name, verdict.passed, verdict.reason, case.expected, verdict.got, (result,))
        )

    def needle(self) -> list[CaseResult]:
        cfg = self.config
        target = self.fits("needle", cfg.needle_tokens)
        if target is None:
            return []
        self.observer.started("needle", f"{target} tokens")
        prompt = build_needle_prompt(self.tokenizer, target, self.seed, cfg.max_tokens)
        result = self.send(prompt.request)
        verdict = score_needle(result, prompt, cfg.token_tolerance)
        metrics = {
            "local_prompt_tokens": prompt.prompt_tokens,
            "server_prompt_tokens": result.usage.prompt_tokens if result.usage else None,
            "cached_tokens": result.usage.cached_tokens if result.usage else None,
            "needle_positions": list(prompt.positions),
            "needle_depths": [round(d, 4) for d in prompt.depths],
            "nonce": prompt.nonce,
        }
        return [
            self.record(
                CaseResult(
                    "needle",
                    f"{target} tokens",
                    verdict.passed,
                    verdict.reason,
                    prompt.expected,
                    verdict.got,
                    (result,),
                    metrics,
                )
            )
        ]

    def speed(self) -> list[CaseResult]:
        cfg, out = self.config, []
        for n in cfg.speed_inputs:
            if self.fits("speed", n) is None:
                continue
            name = f"{n} in x{cfg.concurrency}"
            self.observer.started("speed", name)
            requests = build_speed_requests(self.tokenizer, n, cfg.concurrency, self.seed + n, cfg.max_tokens)
            results, wall = run_cell(self.send, requests)
            verdict, metrics = score_cell(results, requests, wall, cfg.token_tolerance, cfg.min_decode_tps)
            out.append(
                self.record(
                    CaseResult(
                        "speed",
                        name,
                        verdict.passed,
                        verdict.reason,
                        None,
                        None,
                        tuple(results),
                        dataclasses.asdict(metrics),
                    )
                )
            )
        return out

    def fidelity(self) -> list[CaseResult]:
        cfg = self.config
        assert cfg.artifact is not None and cfg.bf16_source is not None
        name = f"{cfg.panel_rows}x{cfg.panel_tokens} panel"
        self.observer.started("fidelity", name)
        ids = panel_ids(self.tokenizer, cfg.panel_rows, cfg.panel_tokens, cfg.panel_text)
        result = measure_fidelity(cfg.artifact, cfg.bf16_source, ids, cfg.device)
        verdict = score_fidelity(result, cfg.kl_max, cfg.top1_min)
        expected = {"mean_kl_max": cfg.kl_max, "top1_agreement_min": cfg.top1_min}
        return [
            self.record(
                CaseResult(
                    "fidelity", name, verdict.passed, verdict.reason, expected, None, (), dataclasses.asdict(result)
                )
            )
        ]

    def gate(self, name: str) -> GateResult:
        """Run one gate; an expected failure that stops it (a fixture that fails its pin...) fails the gate."""
        runners: dict[str, Callable[[], list[CaseResult]]] = {
            "needle": self.needle,
            "speed": self.speed,
            "fidelity": self.fidelity,
        }
        try:
            if name in CHAT_GATES:
                return GateResult(name, tuple(self.chat_case(c) for c in CHAT_GATES[name](self.config.max_tokens)))
            cases = tuple(runners[name]())
            return GateResult(name, cases, notes=tuple(self.notes.get(name, ())))
        except UsageError:
            raise
        except GlmquantError as exc:
            return GateResult(name, (), error=str(exc), notes=tuple(self.notes.get(name, ())))


def _settings(config: ServeCheckConfig) -> dict[str, object]:
    """The configuration as JSON values, without the API key."""
    plain = {
        k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
        for k, v in dataclasses.asdict(config).items()
        if k != "api_key"
    }
    if config.speculative_config is not None:
        plain["speculative_config"] = config.speculative_config.as_json()
    return {**plain, "gates": list(config.selected_gates)}


def serve_check(config: ServeCheckConfig, observer: Observer | None = None) -> ServeCheckReport:
    """Run every selected gate and write serve-check.json/.md into `config.report_dir`; a report directory that
    cannot be written or a BF16 source of another model is refused first, before any gate runs."""
    config.check_report_dir()
    if config.artifact is not None and config.bf16_source is not None:
        check_source_matches(config.artifact, config.bf16_source)
    seed = config.seed if config.seed is not None else secrets.randbits(31)
    run = _Run(config, seed, observer or _Quiet())
    started, gates = _now(), []
    served = [g for g in config.selected_gates if g != "fidelity"]
    if served:
        with (
            _server(config) as base_url,
            contextlib.closing(ChatClient(base_url, config.api_key, config.timeout_s)) as client,
        ):
            run.client, run.base_url = client, base_url
            run.model = config.model or client.first_model()
            run.max_model_len = client.max_model_len(run.model)
            gates += [run.gate(g) for g in served]
    if "fidelity" in config.selected_gates:
        gates.append(run.gate("fidelity"))
    target = str(config.endpoint or config.artifact)
    report = ServeCheckReport(
        target,
        run.model or config.model or Path(target).name,
        started,
        _now(),
        seed,
        _settings(config),
        tuple(gates),
        config.skipped_gates,
        config.thresholds,
    )
    write_report(report, config.report_dir)
    return report
