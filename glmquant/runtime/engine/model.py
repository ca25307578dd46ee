"""Engine: GLM-5.3-Flash's text model on the runtime's own forward with static caches.

A sequence lives in a cache slot: `prefill` runs its prompt in chunks (chunked KDA, the indexer's top-k per query),
`decode` runs one token for each of B consecutive slots at once. On CUDA a decode step of the whole model
(embedding, every layer, final norm, lm_head) is one CUDA graph, captured per (first slot, batch size, indexer
window) on its second use and replayed after; elsewhere the same code runs eagerly. The indexer scores only the
first `pools_for(context)` k-pools (the context rounded up to a power of two): a short sequence does not pay for
the cache's full length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from glmquant.errors import UsageError
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.engine.blocks import Run, decoder_layer
from glmquant.runtime.engine.cache import Caches, KDACache, LayerCache, MLACache
from glmquant.runtime.engine.config import EngineConfig
from glmquant.runtime.engine.experts import engine_experts
from glmquant.runtime.engine.linears import project
from glmquant.runtime.engine.mtp import MtpWeights, allocate_mtp_cache, load_mtp_weights, mtp_hidden, mtp_logits
from glmquant.runtime.engine.ops import ops_for
from glmquant.runtime.engine.weights import ModelWeights, load_weights
from glmquant.runtime.loader import hf_config, retained_linear_mode
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import ExpertBackend
from glmquant.runtime.speculative import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from glmquant.runtime.kernels.cuda_graphs import StepGraphs

PREFILL_CHUNK = 4096  # prompt tokens per forward: bounds activations (the MoE step's buffers grow with routes)


@dataclass
class Engine:
    cfg: EngineConfig
    weights: ModelWeights
    caches: Caches
    prefill_run: Run  # eager math
    decode_run: Run  # eager or compiled math (`compile_decode`)
    graphs: StepGraphs | None  # on CUDA with graphs on
    cuda_graphs: bool = False  # decode steps replay graphs where the device has them
    mtp: MtpWeights | None = field(default=None, kw_only=True)  # the MTP layer, when speculation is asked
    mtp_cache: MLACache | None = field(default=None, kw_only=True)  # its own latents and indexer caches per slot

    @classmethod
    def load(
        cls,
        artifact: Artifact,
        options: RuntimeOptions,
        max_batch: int = 1,
        max_len: int = 4096,
        cuda_graphs: bool = True,
        mtp: bool = False,
        draft_head: str | Path | None = None,
    ) -> Engine:
        """Weights (one layer at a time), experts and caches for `max_batch` sequences of `max_len` tokens;
        `options.compile_decode` runs decode steps' math through torch.compile (`engine/ops.py`); `mtp` also loads
        the MTP layer (speculative decoding) with a cache of its own, its drafts reading `draft_head`'s lm_head
        where one is given."""
        options = options.resolved_for(artifact.config)
        device, dtype = torch.device(options.device), options.torch_dtype
        cfg = EngineConfig.from_text_config(hf_config(artifact, options.dtype).get_text_config())
        kernels = retained_linear_mode(options.backend) == "kernel"
        weights = load_weights(artifact, cfg, dtype, device, kernels, options.dense_linear_max_weights)
        experts = engine_experts(artifact, options)
        cuda_graphs = cuda_graphs and options.backend == "triton"  # the torch backend syncs with the host
        prefill_run, decode_run = (
            Run(cfg, ops_for(device, compiled, device.type == "cuda" or kernels), experts, artifact.ranks)
            for compiled in (False, options.compile_decode)
        )
        return cls(
            cfg,
            weights,
            Caches.allocate(cfg, max_batch, max_len, dtype, device, _verify_tokens(mtp)),
            prefill_run,
            decode_run,
            _graphs(device) if cuda_graphs else None,
            cuda_graphs,
            mtp=load_mtp_weights(artifact, dtype, device, kernels, draft_head, options.dense_linear_max_weights)
            if mtp
            else None,
            mtp_cache=allocate_mtp_cache(cfg, max_batch, max_len, dtype, device) if mtp else None,
        )

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def experts(self) -> ExpertBackend:
        return self.decode_run.experts

    @torch.no_grad()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: tuple[LayerCache, ...], pools: int, run: Run
    ) -> torch.Tensor:
        """Logits [B, V] of the last of S new tokens per row: tokens and positions [B, S] (int64, on the device),
        `caches` those rows' caches, `pools` the k-pools the indexer scores (covering every position)."""
        streams = self._streams(tokens, positions, caches, pools, run)
        return self.lm_head(run.ops.rms_norm(streams[:, -1].mean(dim=-2), self.weights.norm, self.cfg.rms_eps))

    @torch.no_grad()
    def hidden_states(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: tuple[LayerCache, ...], pools: int, run: Run
    ) -> torch.Tensor:
        """As `forward`, but the final hidden states [B, S, H] (after the final norm) of every new token."""
        streams = self._streams(tokens, positions, caches, pools, run)
        return run.ops.rms_norm(streams.mean(dim=-2), self.weights.norm, self.cfg.rms_eps)

    def _streams(
        self, tokens: torch.Tensor, positions: torch.Tensor, caches: tuple[LayerCache, ...], pools: int, run: Run
    ) -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        x = F.embedding(tokens, w.embed)
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], cfg.hc_mult, x.shape[-1]).contiguous()
        for layer, (lw, cache) in enumerate(zip(w.layers, caches, strict=True)):
            streams = decoder_layer(streams, layer, lw, cache, positions, pools, run)
        return streams

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of final-norm hidden states [..., H] (an EXL3 head, `--head-bits`, through its kernels)."""
        return project(hidden, self.weights.lm_head)

    def prefill(self, slot: int, token_ids: torch.Tensor, start: int = 0, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
        """Feed token_ids [S] to `slot` from position `start` (0 starts a new sequence); logits [V] of the last."""
        end = start + token_ids.numel()
        self._check_room(slot, end)
        if start == 0:
            self.caches.reset(slot)
        ids = token_ids.to(self.device).view(1, -1)
        rows = self.caches.rows(slot, slot + 1)
        for c in range(0, ids.shape[1], chunk):
            part = ids[:, c : c + chunk]
            positions = torch.arange(start + c, start + c + part.shape[1], device=self.device).view(1, -1)
            logits = self.forward(part, positions, rows, self.pools_for(start + c + part.shape[1]), self.prefill_run)
        return logits[0]

    @torch.no_grad()
    def prefill_hidden(
        self, slot: int, token_ids: torch.Tensor, start: int = 0, chunk: int = PREFILL_CHUNK, run: Run | None = None
    ) -> torch.Tensor:
        """As `prefill`, but the final hidden states [S, H] of every token fed (the MTP layer reads them);
        `run` the math (default the prefill's)."""
        end = start + token_ids.numel()
        self._check_room(slot, end)
        if start == 0:
            self.caches.reset(slot)
        ids = token_ids.to(self.device).view(1, -1)
        rows = self.caches.rows(slot, slot + 1)
        parts = []
        for c in range(0, ids.shape[1], chunk):
            part = ids[:, c : c + chunk]
            positions = torch.arange(start + c, start + c + part.shape[1], device=self.device).view(1, -1)
            pools = self.pools_for(start + c + part.shape[1])
            parts.append(self.hidden_states(part, positions, rows, pools, run or self.prefill_run)[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def verify(
        self, slot: int, token_ids: torch.Tensor, start: int, graphs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative decoding's verify step: S tokens (the last token and k drafts) at positions start ..
        start + S - 1 of `slot` in one forward on the decode math against the static caches: (logits [S, V],
        final hidden states [S, H]). MLA caches take the new positions (a rollback is only a shorter length: later
        positions are overwritten before they are read); KDA states advance over all S and record each token's
        (`keep_verified` cuts them back). With `graphs` (where the engine has CUDA graphs) one graph per (slot,
        S, indexer window)."""
        s = token_ids.numel()
        if not 0 < s <= MAX_SPECULATIVE_TOKENS + 1:
            raise UsageError(f"a verify step takes 1 to {MAX_SPECULATIVE_TOKENS + 1} tokens, not {s}")
        self._check_room(slot, start + s)
        tokens = token_ids.to(self.device).view(1, s)
        positions = torch.arange(start, start + s, device=self.device).view(1, s)
        pools = self.pools_for(start + s)
        step = partial(self._verify_step, slot=slot, pools=pools)
        if graphs and self.graphs is not None:
            hidden = self.graphs(("verify", slot, pools), step, tokens, positions)[0].clone()
        else:
            hidden = step(tokens, positions)[0]
        return self.lm_head(hidden), hidden

    def _verify_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, pools: int) -> torch.Tensor:
        rows = self.caches.rows(slot, slot + 1, history=True)
        return self.hidden_states(tokens, positions, rows, pools, self.decode_run)

    def keep_verified(self, slot: int, tokens: int) -> None:
        """After a verify step in `slot`: only its first `tokens` tokens stand (the rest were rejected drafts)."""
        self.caches.keep(slot, tokens)

    def save_recurrent(self, slot: int) -> list[torch.Tensor]:
        """Copies of `slot`'s KDA conv inputs and recurrent states (a benchmark repeats a step from one state)."""
        return [t[slot].clone() for c in self.caches.layers if isinstance(c, KDACache) for t in (c.conv, c.state)]

    def restore_recurrent(self, slot: int, saved: list[torch.Tensor]) -> None:
        tensors = [t for c in self.caches.layers if isinstance(c, KDACache) for t in (c.conv, c.state)]
        for t, s in zip(tensors, saved, strict=True):
            t[slot].copy_(s)

    @torch.no_grad()
    def draft(
        self, slot: int, hidden: torch.Tensor, next_ids: torch.Tensor, start: int, graphs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over hidden [S, H] (the target's h_i) and next_ids [S] (t_{i+1}) at positions start ..
        start + S - 1 of `slot`'s MTP cache: (logits [S, V] of t_{i+2}, its output hidden states [S, H]). With
        `graphs` (where the engine has CUDA graphs) and at most a verify step's tokens (a prompt's first draft is
        eager) the layer replays one graph per (slot, S, indexer window), its head runs after it."""
        if self.mtp is None or self.mtp_cache is None:
            raise UsageError("the engine was loaded without its MTP layer (Engine.load(..., mtp=True))")
        end = start + hidden.shape[0]
        self._check_room(slot, end)
        positions = torch.arange(start, end, device=self.device).view(1, -1)
        ids = next_ids.to(self.device).view(1, -1)
        pools = self.pools_for(end)
        run = Run(self.cfg, self.prefill_run.ops, self.mtp.experts, 1)
        step = partial(self._draft_step, slot=slot, pools=pools, run=run)
        if graphs and self.graphs is not None and hidden.shape[0] <= MAX_SPECULATIVE_TOKENS + 1:
            out = self.graphs(("draft", slot, pools), step, hidden.view(1, *hidden.shape), ids, positions)[0].clone()
        else:
            out = step(hidden.view(1, *hidden.shape), ids, positions)[0]
        return mtp_logits(out, self.mtp, self.weights, run), out

    def _draft_step(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, slot: int, pools: int, run: Run
    ) -> torch.Tensor:
        assert self.mtp is not None and self.mtp_cache is not None
        c = self.mtp_cache
        cache = MLACache(*(t[slot : slot + 1] for t in (c.latents, c.index_keys, c.index_gates, c.pooled)))
        return mtp_hidden(hidden, next_ids, positions, self.mtp, self.weights, cache, pools, run)

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, context: int, first_slot: int = 0, eager: bool = False
    ) -> torch.Tensor:
        """One token for each of slots first_slot .. first_slot + B - 1: tokens, positions [B] on the device;
        `context` bounds every position + 1 (the host knows the lengths; it picks the indexer window).
        Logits [B, V]; from a graph, the same tensor is overwritten by the next step. `eager` skips the graphs."""
        self._check_room(first_slot + tokens.shape[0] - 1, context)
        pools = self.pools_for(context)
        step = partial(self._step, first_slot=first_slot, pools=pools)
        if self.graphs is None or eager:
            return step(tokens, positions)
        return self.graphs(("decode", first_slot, pools), step, tokens, positions)

    @torch.no_grad()
    def warm_up(self, prompt_tokens: int = 32, steps: int = 3) -> None:
        """Compile and autotune the prefill and decode kernels and capture batch 1's decode graph now (a server's
        start) instead of in its first request (~100 s of the whole model's first request on an H200), then
        leave slot 0 as a new sequence. Later output is unchanged: a slot is reset before every sequence."""
        prompt_tokens = min(prompt_tokens, self.caches.max_len - steps)
        ids = torch.arange(prompt_tokens, device=self.device) % self.cfg.vocab
        token = self.prefill(0, ids).argmax().view(1)
        for i in range(steps):  # eager, captured, replayed: StepGraphs' three paths
            position = torch.full((1,), prompt_tokens + i, dtype=torch.long, device=self.device)
            token = self.decode(token, position, prompt_tokens + i + 1).argmax(-1)
        self.caches.reset(0)

    def reallocate(self, max_batch: int, max_len: int) -> None:
        """Fresh zeroed caches of another size (captured graphs are dropped: they address the old ones)."""
        dtype, device = self.weights.embed.dtype, self.device
        self.graphs = None
        mtp, self.mtp_cache = self.mtp_cache is not None, None
        self.__dict__.pop("caches", None)  # the old freed before the new are allocated (none after a failed try)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.caches = Caches.allocate(self.cfg, max_batch, max_len, dtype, device, _verify_tokens(mtp))
        if mtp:
            self.mtp_cache = allocate_mtp_cache(self.cfg, max_batch, max_len, dtype, device)
        self.graphs = _graphs(device) if self.cuda_graphs else None

    def pools_for(self, context: int) -> int:
        """k-pools the indexer scores for sequences up to `context` tokens: a power of two, at least the top-k's,
        at most the cache's (few windows: few graphs)."""
        tokens = max(self.cfg.index_topk, 1 << max(0, context - 1).bit_length())
        return min(tokens, self.caches.max_len) // self.cfg.kpool

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, first_slot: int, pools: int) -> torch.Tensor:
        rows = self.caches.rows(first_slot, first_slot + tokens.shape[0])
        return self.forward(tokens.view(-1, 1), positions.view(-1, 1), rows, pools, self.decode_run)

    def _check_room(self, slot: int, end: int) -> None:
        if not 0 <= slot < self.caches.max_batch:
            raise UsageError(f"slot {slot} is outside the engine's {self.caches.max_batch} cache slots")
        if end > self.caches.max_len:
            raise UsageError(f"{end} tokens exceed the engine's cache of {self.caches.max_len} tokens per sequence")


def _verify_tokens(mtp: bool) -> int:
    """Tokens of the KDA history a verify step records: speculation's most (with the MTP layer), else none."""
    return MAX_SPECULATIVE_TOKENS + 1 if mtp else 0


def _graphs(device: torch.device) -> StepGraphs | None:
    """A StepGraphs on CUDA (decode steps replay graphs), None elsewhere."""
    if device.type != "cuda":
        return None
    from glmquant.runtime.kernels.cuda_graphs import StepGraphs

    return StepGraphs()
