"""Static caches for `max_batch` sequences of up to `max_len` tokens, allocated once at fixed addresses so a
captured decode graph keeps reading and writing the same memory.

MLA/DSA layers keep the normalized KV latent of every position (the absorbed attention never expands keys or
values), the indexer's key and k-pool gate score of every position, and each k-pool's compressed key. KDA layers
keep the last kernel-1 conv inputs and the fp32 recurrent state. Row b of every tensor is sequence slot b.

With speculative decoding each KDA layer also keeps one verify step's history (its state after every token and
the conv inputs around them): a rejected draft is undone by copying the state after the last kept token back,
instead of restoring the state from before the verify and re-running the kept tokens (a whole decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from glmquant.runtime.engine.config import EngineConfig


@dataclass(frozen=True)
class MLACache:
    latents: torch.Tensor  # [B, L, kv_rank]
    index_keys: torch.Tensor  # [B, L, index_dim]
    index_gates: torch.Tensor  # [B, L, index_dim]
    pooled: torch.Tensor  # [B, L / kpool, index_dim]


@dataclass(frozen=True)
class KDAHistory:
    """One sequence's verify step of up to T tokens (written by the step, read by `Caches.keep`)."""

    states: torch.Tensor  # fp32 [T, heads, head_dim, head_dim]: the state after each token
    windows: torch.Tensor  # [kernel - 1 + T, 3 P]: the conv inputs before the step, then the step's own


@dataclass(frozen=True)
class KDACache:
    conv: torch.Tensor  # [B, kernel - 1, 3 P] the last conv inputs, oldest first
    state: torch.Tensor  # fp32 [B, heads, head_dim, head_dim]
    history: KDAHistory | None = None  # where a speculative verify step of one sequence records its tokens


LayerCache = MLACache | KDACache


@dataclass(frozen=True)
class Caches:
    layers: tuple[LayerCache, ...]
    max_batch: int
    max_len: int

    @classmethod
    def allocate(
        cls,
        cfg: EngineConfig,
        max_batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        verify_tokens: int = 0,
    ) -> Caches:
        """Zeroed caches; max_len is rounded up to whole k-pools. `verify_tokens` > 0 adds each KDA layer's history
        of a verify step of that many tokens (one sequence at a time: the H200's GLM-5.3-Flash, 4 tokens:
        34 layers x 16.8 MB)."""
        max_len = -(-max_len // cfg.kpool) * cfg.kpool

        def empty(*shape: int, d: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=d, device=device)

        layers: list[LayerCache] = []
        for kind in cfg.layer_kinds:
            if kind == "kda":
                state_shape = (cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim)
                history = None
                if verify_tokens:
                    history = KDAHistory(
                        empty(verify_tokens, *state_shape, d=torch.float32),
                        empty(cfg.conv_kernel - 1 + verify_tokens, 3 * cfg.kda_width),
                    )
                layers.append(
                    KDACache(
                        empty(max_batch, cfg.conv_kernel - 1, 3 * cfg.kda_width),
                        empty(max_batch, *state_shape, d=torch.float32),
                        history,
                    )
                )
            else:
                layers.append(
                    MLACache(
                        empty(max_batch, max_len, cfg.kv_rank),
                        empty(max_batch, max_len, cfg.index_dim),
                        empty(max_batch, max_len, cfg.index_dim),
                        empty(max_batch, max_len // cfg.kpool, cfg.index_dim),
                    )
                )
        return cls(tuple(layers), max_batch, max_len)

    def rows(self, start: int, stop: int, history: bool = False) -> tuple[LayerCache, ...]:
        """Every layer's cache restricted to slots [start, stop) (views: writes land in these caches); with
        `history` (one slot: a verify step) the KDA layers record it."""
        if history and stop - start != 1:
            raise ValueError(f"a verify step's KDA history is one sequence's, not slots {start}..{stop - 1}'s")
        out: list[LayerCache] = []
        for c in self.layers:
            if isinstance(c, KDACache):
                out.append(KDACache(c.conv[start:stop], c.state[start:stop], c.history if history else None))
            else:
                out.append(MLACache(*(getattr(c, f.name)[start:stop] for f in fields(c))))
        return tuple(out)

    def keep(self, slot: int, tokens: int) -> None:
        """After a verify step in `slot` of which only the first `tokens` stand: every KDA layer's state and conv
        inputs as they were after them (MLA positions past them need nothing: rewritten before they are read)."""
        for c in self.layers:
            if isinstance(c, KDACache):
                if c.history is None:
                    raise RuntimeError("the caches were allocated without a verify history (verify_tokens=0)")
                c.state[slot].copy_(c.history.states[tokens - 1])
                c.conv[slot].copy_(c.history.windows[tokens : tokens + c.conv.shape[1]])

    def reset(self, slot: int) -> None:
        """Start a new sequence in `slot`: recurrent state and conv inputs back to zero (MLA rows need no reset:
        a position is only read once it has been written)."""
        for c in self.layers:
            if isinstance(c, KDACache):
                c.conv[slot].zero_()
                c.state[slot].zero_()

    def copy_slot(self, source: int, targets: range) -> None:
        """Give slots `targets` the same history as `source` (a benchmark's batch of equal sequences)."""
        for t in self._tensors():
            t[targets.start : targets.stop].copy_(t[source : source + 1].expand(len(targets), *t.shape[1:]))

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every cache tensor (a benchmark replays the same history twice)."""
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._tensors(), saved, strict=True):
            t.copy_(s)

    def _tensors(self) -> list[torch.Tensor]:
        """The per-slot tensors (a verify history is scratch space)."""
        return [t for c in self.layers for f in fields(c) if isinstance(t := getattr(c, f.name), torch.Tensor)]
