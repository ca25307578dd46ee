"""serve-check: the acceptance gates (text, tools, multilingual, images, video, long context, speed) run
through any OpenAI-compatible server, plus a fidelity gate against the BF16 source."""

from glmquant.servecheck.config import ALL_GATES, ServeCheckConfig
from glmquant.servecheck.results import CaseResult, GateResult, ServeCheckReport
from glmquant.servecheck.run import Observer, serve_check

__all__ = ["ALL_GATES", "CaseResult", "GateResult", "Observer", "ServeCheckConfig", "ServeCheckReport", "serve_check"]
