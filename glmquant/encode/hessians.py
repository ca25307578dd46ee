"""Which input Hessian each routed-expert projection is encoded with, and the documented fallbacks.

natural mode: an expert's gate/up Hessian from the tokens routed to it, its down Hessian from its own
activations. An expert that received no calibration token falls back to the all-token Hessians when the
observations hold them ("no_tokens:all"), else to uncalibrated encoding ("no_tokens:identity").
all mode: the layer's shared gate/up Hessian and each expert's all-token down Hessian.
blend (natural mode with a natural share s): s·natural + (1 - s)·all-token, each a mean E[x xᵀ], per expert;
an expert without routed tokens takes the all-token Hessians ("no_tokens:all").
No observations at all: every tensor is encoded uncalibrated ("uncalibrated").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.errors import UsageError
from glmquant.observe.hessian_reader import HeldHessians, LayerHessians, load_layer_hessians
from glmquant.observe.hessians import HessianMode
from glmquant.observe.tuning_sample import RoutedSample


@dataclass(frozen=True)
class ExpertHessians:
    gate_up: torch.Tensor | None  # E[x xᵀ] of the MoE input [H, H], None: encode uncalibrated
    down: torch.Tensor | None  # E[a aᵀ] of the expert's intermediate activation [I, I]
    fallback: str | None


class HessianSource:
    """Per-layer access to the observations, opened lazily (one expert's matrices in memory at a time)."""

    def __init__(self, observations: Path | None, mode: str, blend: float | None = None) -> None:
        self.observations = observations
        self.mode = mode
        self.blend = blend

    def layer(self, layer: int) -> LayerHessiansView:
        if self.observations is None:
            return LayerHessiansView(None, None)
        primary = load_layer_hessians(self.observations, layer, self.mode)
        backup = None
        if self.mode == "natural":
            try:
                backup = load_layer_hessians(self.observations, layer, "all")
            except UsageError:
                if self.blend is not None:
                    raise UsageError(
                        f"--blend mixes natural and all-token Hessians: {self.observations} has no "
                        f"all-token Hessians for layer {layer} (observe with --hessians both)"
                    ) from None
        return LayerHessiansView(primary, backup, self.blend)


class LayerHessiansView:
    """One layer's Hessians for the encoder. The all-token gate/up Hessian is one matrix shared by every expert:
    it is read once per layer and handed out as the same tensor object, so the codec factorizes it once."""

    def __init__(
        self,
        primary: LayerHessians | HeldHessians | None,
        backup: LayerHessians | HeldHessians | None,
        blend: float | None = None,
    ) -> None:
        if blend is not None and backup is None:
            raise UsageError("a Hessian blend needs the all-token Hessians beside the natural ones")
        self.primary = primary
        self.backup = backup  # all-token Hessians, the fallback of natural mode (and the other half of a blend)
        self.blend = blend  # natural share of a blend; None: the primary mode alone
        self._shared: dict[str, tuple[torch.Tensor | None, int]] = {}
        self._sample: dict[str, RoutedSample | None] = {}

    def expert(self, source_expert: int) -> ExpertHessians:
        if self.primary is None:
            return ExpertHessians(None, None, "uncalibrated")
        gate_up, tokens = self._gate_up("primary", self.primary, source_expert)
        down = self.primary.down(source_expert)
        if tokens and down.count and self.blend is None:
            return ExpertHessians(gate_up, down.mean(), None)
        if self.backup is None:
            return ExpertHessians(None, None, "no_tokens:identity")
        all_gate_up, all_tokens = self._gate_up("backup", self.backup, source_expert)
        all_down = self.backup.down(source_expert)
        natural_down, backup_down = down.mean(), all_down.mean()
        if tokens and down.count:  # a blend; an expert's natural tokens are among its all-token ones
            s = self.blend
            assert s is not None and gate_up is not None and natural_down is not None
            assert all_gate_up is not None and backup_down is not None
            return ExpertHessians(s * gate_up + (1 - s) * all_gate_up, s * natural_down + (1 - s) * backup_down, None)
        if all_tokens and all_down.count:
            return ExpertHessians(all_gate_up, backup_down, "no_tokens:all")
        return ExpertHessians(None, None, "no_tokens:identity")

    def sample(self) -> RoutedSample | None:
        """The layer's tuning sample (`observe --tuning-tokens`), read once; None when not observed."""
        if self.primary is None:
            return None
        if "sample" not in self._sample:
            self._sample["sample"] = self.primary.sample()
        return self._sample["sample"]

    def _gate_up(
        self, which: str, hessians: LayerHessians | HeldHessians, expert: int
    ) -> tuple[torch.Tensor | None, int]:
        """(E[x xᵀ] of the MoE input, token count) for `expert`; one shared object in all-token mode."""
        if hessians.mode is not HessianMode.ALL:
            h = hessians.gate_up(expert)
            return h.mean(), h.count
        if which not in self._shared:
            h = hessians.gate_up(expert)
            self._shared[which] = (h.mean(), h.count)
        return self._shared[which]
