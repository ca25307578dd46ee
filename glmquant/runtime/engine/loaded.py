"""LoadedEngine: the runtime's own forward (`--model-impl glmquant`) ready to serve, with one decoder per cache
slot handed out to generations as they run (as many as `--max-num-seqs`)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from glmquant.devices import require_visible
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.engine.decoder import EngineDecoder
from glmquant.runtime.engine.model import Engine
from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import ExpertBackend

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    engine: Engine
    artifact: Artifact
    options: RuntimeOptions
    decoders: queue.Queue[EngineDecoder]

    @property
    def backend(self) -> ExpertBackend:
        return self.engine.experts

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def close(self) -> None:
        self.artifact.checkpoint.close()

    @contextlib.contextmanager
    def session(self) -> Iterator[EngineDecoder]:
        """A free cache slot's decoder for one generation (waits while every slot is busy)."""
        decoder = self.decoders.get()
        try:
            yield decoder
        finally:
            self.decoders.put(decoder)


def load_engine(artifact: Artifact, options: RuntimeOptions, max_seqs: int, max_len: int) -> LoadedEngine:
    """The engine with caches for `max_seqs` sequences of `max_len` tokens; its decoders share one lock, so one
    forward runs at a time (sequences interleave token by token; they are not batched together). With
    `speculative_config` the engine loads its MTP layer and each slot's decoder speculates (`EngineMtpDecoder`)."""
    require_visible(options.device)
    spec = options.speculative_config
    # a verify step writes k positions past the last token (and drafts as many into the MTP cache)
    room = max_len + (spec.num_speculative_tokens if spec is not None else 0)
    draft_head = spec.draft_head if spec is not None else None
    engine = Engine.load(artifact, options, max_seqs, room, mtp=spec is not None, draft_head=draft_head)
    if engine.device.type == "cuda":  # the first request would otherwise wait for every kernel's compile
        started = time.monotonic()
        engine.warm_up()
        log.info("kernels compiled and the decode graph captured in %.1f s", time.monotonic() - started)
    lock = threading.Lock()
    decoders: queue.Queue[EngineDecoder] = queue.Queue()
    for slot in range(max_seqs):
        if spec is None:
            decoders.put(EngineDecoder(engine, slot, lock))
        else:
            decoders.put(EngineMtpDecoder(engine, spec.num_speculative_tokens, slot, lock))
    return LoadedEngine(engine, artifact, options, decoders)
