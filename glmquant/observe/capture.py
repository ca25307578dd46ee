"""Hooks on one loaded decoder layer that feed the REAP statistics and the Hessian accumulators.

The router hook sees the MoE input h [N, H] and the router's own logits; `routing.route` turns them into
the model's exact selection and weights (checked against what the router handed to the experts). Each
expert's output f_j and intermediate activation are recomputed with the layer's own weights and its own
SwiGLU gate (`experts._apply_gate`), i.e. the eager-path math of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glmquant.arch.module_map import LayerPlan
from glmquant.errors import CheckpointFormatError, NumericalError
from glmquant.observe.hessians import HessianAccumulator, HessianWeighting
from glmquant.observe.routing import Routing, RoutingParams, route
from glmquant.observe.stats import ExpertStats


@dataclass(frozen=True)
class CaptureTargets:
    """What the current batch feeds (None = nothing); switched per calibration lane."""

    stats: ExpertStats | None = None
    hessians: HessianAccumulator | None = None
    dense: bool = False


class LayerCapture:
    """Context manager: installs the hooks on `module` (decoder layer `plan.layer`), removes them on exit."""

    def __init__(self, module: nn.Module, plan: LayerPlan, params: RoutingParams) -> None:
        self.module, self.plan, self.params = module, plan, params
        self.targets = CaptureTargets()
        self._handles: list = []
        self._block_input: torch.Tensor | None = None  # the MoE block's input before its norm (the residual stream)
        self._routed_output: torch.Tensor | None = None

    def __enter__(self) -> LayerCapture:
        mlp: Any = self.module.mlp  # transformers' MoE block (router `gate`, `experts`) or a dense MLP
        if hasattr(mlp, "experts"):
            norm: Any = self.module.post_attention_layernorm  # the MoE block's input norm
            self._handles += [
                mlp.gate.register_forward_hook(self._on_router),
                norm.register_forward_pre_hook(self._on_block_input),
                mlp.experts.register_forward_hook(self._on_routed_output),
                mlp.register_forward_hook(self._on_block_output),
            ]
        for name, sub in self.module.named_modules():
            if isinstance(sub, nn.Linear):
                source = self.plan.source_of(f"{name}.weight")
                if source is None:
                    raise CheckpointFormatError(f"layer {self.plan.layer}: linear {name} has no single source tensor")
                self._handles.append(sub.register_forward_pre_hook(self._dense_hook(source)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _dense_hook(self, weight_name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            if self.targets.dense and self.targets.hessians is not None:
                self.targets.hessians.add_dense(weight_name, args[0])

        return hook

    def _on_block_input(self, _norm: nn.Module, args: tuple) -> None:
        if self.targets.stats is not None:
            self._block_input = args[0]

    def _on_routed_output(self, _experts: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        if self.targets.stats is not None:
            self._routed_output = output

    def _on_block_output(self, _mlp: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        """The layer's routed-output and residual energies (stats.py), from the block's input, routed output and
        output of the batch."""
        stats, residual, routed = self.targets.stats, self._block_input, self._routed_output
        self._block_input = self._routed_output = None
        if stats is None:
            return
        if residual is None or routed is None:
            raise CheckpointFormatError(
                f"layer {self.plan.layer}: the MoE block ran without its norm's input or its experts' output "
                "(transformers changed the decoder layer?)"
            )
        width = output.shape[-1]
        stats.update_energies(routed.reshape(-1, width), (residual + output).reshape(-1, width))

    def _on_router(self, gate: Any, args: tuple, output: tuple) -> None:
        t = self.targets
        if t.stats is None and t.hessians is None:
            return
        x = args[0].reshape(-1, args[0].shape[-1])  # [N, H], the experts' input
        routing = route(output[0], gate.e_score_correction_bias, self.params)
        check_same_routing(routing, output[2], output[1], self.plan.layer)
        if t.stats is not None:
            t.stats.update_router(routing)
        if t.hessians is not None and t.hessians.sampler is not None:
            t.hessians.sampler.add(x, routing.indices, routing.weights)
        mlp: Any = self.module.mlp
        experts = mlp.experts  # transformers' stacked experts: gate_up_proj, down_proj, _apply_gate
        if t.hessians is not None and t.hessians.mode.all_tokens:
            t.hessians.add_all_gate_up(x)
            for j in range(self.params.n_experts):
                t.hessians.add_all_down(j, experts._apply_gate(F.linear(x, experts.gate_up_proj[j])))
        natural = t.hessians if t.hessians is not None and t.hessians.mode.natural else None
        if t.stats is not None or natural is not None:
            self._routed(x, routing, experts, natural)

    def _routed(self, x: torch.Tensor, routing: Routing, experts: Any, natural: HessianAccumulator | None) -> None:
        """Each expert on its own routed tokens: REAP statistics and natural-mode Hessians.

        The (token, slot) pairs are grouped by expert with one stable sort, in the (token, slot) order a per-expert
        `torch.where` gives, and the group sizes cross to the host once per batch (not once per expert), so on a
        GPU the per-expert kernels queue up without waiting. Per expert only its own work runs (gather, its two
        GEMMs, the norm, the partial sums of its statistics, its Hessian GEMMs); the token counts, the running
        sums and maxima of the statistics are updated once per batch (bit-identical: one addition per expert).
        `natural`: where natural-mode Hessians go (None: none)."""
        top_k = routing.indices.shape[1]
        flat = routing.indices.reshape(-1)  # [N*k]
        pairs = torch.argsort(flat, stable=True)
        tokens, slots = pairs // top_k, pairs % top_k
        counts = torch.bincount(flat, minlength=self.params.n_experts)
        stats = self.targets.stats
        hit, gates, norms = [], [], []
        relative = None  # ĝ: each routing weight over the mean weight of its token's top-k, for gate weighting
        if natural is not None and natural.weighting is HessianWeighting.GATE:
            relative = routing.weights / routing.weights.mean(dim=-1, keepdim=True).clamp_min(1e-30)
        start = 0
        for j, count in enumerate(counts.tolist()):
            token, slot, start = tokens[start : start + count], slots[start : start + count], start + count
            if count == 0:
                continue
            xj = x[token]
            act = experts._apply_gate(F.linear(xj, experts.gate_up_proj[j]))  # [n, I]
            if stats is not None:
                out = F.linear(act, experts.down_proj[j])  # [n, H], f_j before gating
                hit.append(j)
                gates.append(routing.weights[token, slot])
                norms.append(out.float().norm(dim=-1))
            if natural is not None:
                natural.add_natural(j, xj, act, False, None if relative is None else relative[token, slot])
        if stats is not None:
            stats.update_experts(torch.tensor(hit, dtype=torch.int64, device=counts.device), counts, gates, norms)
        if natural is not None:
            natural.add_natural_counts(counts)


def check_same_routing(routing: Routing, indices: torch.Tensor, weights: torch.Tensor, layer: int) -> None:
    """routing.py must agree with the model's router, or every statistic would describe another model."""
    mine, order = routing.indices.sort(dim=-1)
    theirs, their_order = indices.sort(dim=-1)
    same = torch.equal(mine, theirs) and torch.allclose(
        routing.weights.gather(1, order), weights.float().gather(1, their_order), rtol=1e-6, atol=0
    )
    if not same:
        raise NumericalError(
            f"layer {layer}: routing.route disagrees with the model's router (transformers changed its routing?)"
        )
