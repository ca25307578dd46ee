"""GLM's exact expert routing as a pure function of the router logits (shared with the runtime).

scores = sigmoid(logits) in fp32; selection ranks `scores + e_score_correction_bias` (group-limited top-k:
the best `topk_group` of `n_group` groups, each group scored by its top-2 sum; one group = plain top-k);
the weights are the *unbiased* scores of the selected experts, divided by their sum when norm_topk_prob,
times routed_scaling_factor. The operations and their order are those of transformers'
`Glm5NextTextTopkRouter`, so on one device the result is bit-identical to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmquant.arch import ModelSpec


@dataclass(frozen=True)
class RoutingParams:
    n_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> RoutingParams:
        return cls(
            spec.n_routed_experts,
            spec.num_experts_per_tok,
            spec.n_group,
            spec.topk_group,
            spec.norm_topk_prob,
            spec.routed_scaling_factor,
        )


@dataclass(frozen=True)
class Routing:
    indices: torch.Tensor  # [N, k] int64, selected experts (in torch.topk's unsorted order)
    weights: torch.Tensor  # [N, k] fp32, what multiplies each selected expert's output
    scores: torch.Tensor  # [N, E] fp32, sigmoid(logits) without the bias

    def dense_weights(self) -> torch.Tensor:
        """[N, E] routing weight of every expert for every token (0 where not selected)."""
        out = torch.zeros_like(self.scores)
        return out.scatter_(1, self.indices, self.weights)


def route(logits: torch.Tensor, bias: torch.Tensor, params: RoutingParams) -> Routing:
    """Route tokens given router logits [N, E] (fp32) and the correction bias [E]."""
    logits = logits.reshape(-1, params.n_experts).float()
    scores = logits.sigmoid()
    choice = scores + bias.float()
    per_group = params.n_experts // params.n_group
    group_scores = choice.view(-1, params.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=params.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, params.n_group, per_group).reshape(-1, params.n_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=params.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if params.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(indices, weights * params.routed_scaling_factor, scores)
