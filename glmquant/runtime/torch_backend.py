"""The CPU/torch expert backend: decode only the experts a batch routes to, through a bounded LRU cache.

Each virtual expert is decoded with `glmquant.exl3.decode_weight` into the model dtype and applied with
the same operations as transformers' `Glm5NextTextExperts` (fused gate/up linear, clamped SwiGLU, down
linear, times the router weight); contributions are summed in float32 and cast once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from glmquant.exl3.decode import decode_weight
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.expert_cache import CacheStats, LRUCache
from glmquant.runtime.quantized_experts import register_backend


@dataclass(frozen=True)
class DecodedExpert:
    """One virtual expert in HF orientation: gate_up [2W, H] (gate rows first), down [H, W]."""

    gate_up: torch.Tensor
    down: torch.Tensor


class TorchExpertBackend:
    """`ExpertBackend` in plain torch; memory is bounded by `cache_size` decoded virtual experts."""

    def __init__(
        self, artifact: Artifact, cache_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.artifact = artifact
        self.dtype = dtype
        self.device = torch.device(device)
        self.swiglu_limit = artifact.spec.swiglu_limit
        self.cache: LRUCache[DecodedExpert] = LRUCache(cache_size)

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, H]
        for vid in torch.unique(expert_ids).tolist():
            token_idx, slot = torch.where(expert_ids == vid)
            expert = self.cache.get((layer, vid), partial(self._decode, layer, vid))
            gate, up = F.linear(hidden[token_idx], expert.gate_up).chunk(2, dim=-1)
            y = F.linear(self._swiglu(gate, up), expert.down) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.float())
        return out.to(hidden.dtype)

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return F.silu(gate) * up

    def _decode(self, layer: int, vid: int) -> DecodedExpert:
        w = {
            p: decode_weight(self.artifact.read_expert(layer, vid, p, self.device), self.dtype)
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        return DecodedExpert(torch.cat((w["gate_proj"], w["up_proj"])), w["down_proj"])


register_backend(
    "torch",
    lambda artifact, options: TorchExpertBackend(artifact, options.expert_cache, options.torch_dtype, options.device),
)
