"""Static caches for `max_batch` sequences of up to `max_len` tokens, allocated once at fixed addresses so a
captured decode graph keeps reading and writing the same memory.

MLA/DSA layers keep the normalized KV latent of every position (the absorbed attention never expands keys or
values), the indexer's key and k-pool gate score of every position, and each k-pool's compressed key. KDA layers
keep the last kernel-1 conv inputs and the fp32 recurrent state. Row b of every tensor is sequence slot b.
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
class KDACache:
    conv: torch.Tensor  # [B, kernel - 1, 3 P] the last conv inputs, oldest first
    state: torch.Tensor  # fp32 [B, heads, head_dim, head_dim]


LayerCache = MLACache | KDACache


@dataclass(frozen=True)
class Caches:
    layers: tuple[LayerCache, ...]
    max_batch: int
    max_len: int

    @classmethod
    def allocate(
        cls, cfg: EngineConfig, max_batch: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> Caches:
        """Zeroed caches; max_len is rounded up to whole k-pools."""
        max_len = -(-max_len // cfg.kpool) * cfg.kpool

        def empty(*shape: int, d: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=d, device=device)

        layers: list[LayerCache] = []
        for kind in cfg.layer_kinds:
            if kind == "kda":
                layers.append(
                    KDACache(
                        empty(max_batch, cfg.conv_kernel - 1, 3 * cfg.kda_width),
                        empty(max_batch, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim, d=torch.float32),
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

    def rows(self, start: int, stop: int) -> tuple[LayerCache, ...]:
        """Every layer's cache restricted to slots [start, stop) (views: writes land in these caches)."""
        return tuple(type(c)(*(getattr(c, f.name)[start:stop] for f in fields(c))) for c in self.layers)

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
        return [getattr(c, f.name) for c in self.layers for f in fields(c)]
