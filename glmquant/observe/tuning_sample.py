"""A sample of one MoE layer's calibration tokens, kept for `encode --tune-scales`: each sampled token's MoE input
and the model's routing of it (its top-k experts and their weights).

`observe --tuning-tokens N` keeps every s-th token of the lanes that feed Hessians (s = their token count over N, so
the sample spans every lane), at most N. It lives in the layer's Hessians file (hessians.py) as
  tuning.inputs [n, H] (the model's dtype)   tuning.expert_ids I64 [n, k]   tuning.expert_weights F32 [n, k]
(GLM-5.3-Flash in BF16: 12 KiB per token plus the routing). The encoder reads it back whole, once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TENSORS = ("tuning.inputs", "tuning.expert_ids", "tuning.expert_weights")


@dataclass(frozen=True)
class RoutedSample:
    """Sampled tokens of one layer: MoE inputs [n, H], their routed experts [n, k] and routing weights [n, k]."""

    inputs: torch.Tensor
    expert_ids: torch.Tensor
    expert_weights: torch.Tensor

    def routed_to(self, experts: list[int]) -> RoutedSample:
        """The tokens routed to any of `experts` (source experts), in token order; their slots routed elsewhere get
        expert id -1 and weight 0, so the sample describes those experts' share of the MoE output."""
        mine = torch.isin(self.expert_ids, torch.tensor(experts, dtype=self.expert_ids.dtype))
        token = mine.any(1)
        return RoutedSample(
            self.inputs[token],
            torch.where(mine, self.expert_ids, -1)[token],
            torch.where(mine, self.expert_weights, 0.0)[token],
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(zip(TENSORS, (self.inputs, self.expert_ids, self.expert_weights)))


class TuningSampler:
    """Keeps every `stride`-th token the router hook sees, at most `limit`, in the order seen."""

    def __init__(self, limit: int, stride: int) -> None:
        if limit < 1 or stride < 1:
            raise ValueError(f"a tuning sample needs limit >= 1 and stride >= 1, got {limit} and {stride}")
        self.limit, self.stride = limit, stride
        self.seen = 0
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._kept = 0

    @classmethod
    def over(cls, limit: int, tokens: int) -> TuningSampler:
        """A sampler spreading `limit` tokens over `tokens` calibration tokens."""
        return cls(limit, max(1, tokens // limit))

    def add(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> None:
        """x [n, H]: a batch's MoE inputs; expert_ids / expert_weights [n, k]: the model's routing of them."""
        n = x.shape[0]
        first = (-self.seen) % self.stride  # the batch's first position on the stride grid
        self.seen += n
        room = self.limit - self._kept
        if room <= 0 or first >= n:
            return
        picked = torch.arange(first, n, self.stride, device=x.device)[:room]
        self._parts.append((x[picked], expert_ids[picked].long(), expert_weights[picked].float()))
        self._kept += picked.numel()

    @property
    def kept(self) -> int:
        """Tokens kept so far."""
        return self._kept

    def result(self) -> RoutedSample | None:
        if not self._parts:
            return None
        return RoutedSample(*(torch.cat(column) for column in zip(*self._parts)))
