"""The runtime's own GLM-5.3-Flash forward: fused weights, static caches (MLA latents and DSA indexer state, KDA
conv inputs and recurrent state), chunked prefill and whole-model decode steps that CUDA graphs capture at once."""

from glmquant.runtime.engine.decoder import EngineDecoder
from glmquant.runtime.engine.model import Engine
from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder

__all__ = ["Engine", "EngineDecoder", "EngineMtpDecoder"]
