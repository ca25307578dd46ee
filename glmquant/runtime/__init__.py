"""The embedded reference runtime: an artifact in transformers' GLM-5.3-Flash model with quantized experts,
generation, GLM chat formatting and an OpenAI-compatible server (FastAPI on uvicorn).

    loaded = load_model("artifact/", RuntimeOptions(device="cpu", dtype="bfloat16", expert_cache=256))
    with serve_in_background("artifact/", port=0) as server: ...  # server.base_url -> http://127.0.0.1:N/v1
"""

from glmquant.runtime.artifact import Artifact, open_artifact
from glmquant.runtime.chat import ChatFormat
from glmquant.runtime.expert_cache import CacheStats
from glmquant.runtime.generate import Generation, PromptInputs, SamplingParams, generate
from glmquant.runtime.glm_output import GlmOutputParser, ParsedOutput, ToolCall, parse_output
from glmquant.runtime.loader import LoadedModel, load_model
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import ExpertBackend, QuantizedExperts, register_backend
from glmquant.runtime.server import RunningServer, run_server, serve_in_background
from glmquant.runtime.service import ModelService, ServiceOptions

__all__ = [
    "Artifact",
    "CacheStats",
    "ChatFormat",
    "ExpertBackend",
    "Generation",
    "GlmOutputParser",
    "LoadedModel",
    "ModelService",
    "ParsedOutput",
    "PromptInputs",
    "QuantizedExperts",
    "RunningServer",
    "RuntimeOptions",
    "SamplingParams",
    "ServiceOptions",
    "ToolCall",
    "generate",
    "load_model",
    "open_artifact",
    "parse_output",
    "register_backend",
    "run_server",
    "serve_in_background",
]
