"""Input Hessians H = Σ x xᵀ of the routed experts (and optionally the dense linears) of one MoE layer.

Two coverage modes (docs/observations.md):
  natural  expert j's gate/up Hessian from the tokens routed to j (its input: the MoE input h, H×H), its
           down Hessian from its own intermediate activations on those tokens (I×I). Rare experts see few
           tokens, or none (count 0).
  all      every calibration token through every expert: gate/up of all experts share one H×H Hessian
           (the MoE input of all tokens); each expert's down Hessian comes from its activations on all
           tokens.
Weighting of the natural sums (`HessianWeighting`): "token" counts every routed token once; "gate" scales each
routed token's rows by its routing weight over the mean weight of its token's top-k, so the sums are Σ ĝ² x xᵀ.
An expert's output enters the layer's output multiplied by its gate, so ĝ² is the weight of its error in the
layer's output (MoEQuant's affinity-guided calibration); normalising by the token's mean keeps the sums near the
scale of the unweighted ones (each expert's by its mean ĝ², ~1), so they blend with all-token Hessians as they are.
All-token and dense sums and all counts stay unweighted.
Dense (optional): every nn.Linear of the layer other than the routed experts (attention, shared experts,
dense MLP), keyed by its checkpoint weight name, over all tokens; and lm_head's input (the final norm's output) in
`head.hessians.safetensors`.

On disk, `layer-LL.hessians.safetensors` (metadata format=glmquant.hessians.v1) holds raw sums and counts:
  natural.gate_up.sum F32 [E,H,H]   natural.gate_up.count I64 [E]
  natural.down.sum    F32 [E,I,I]   natural.down.count    I64 [E]
  all.gate_up.sum     F32 [H,H]     all.gate_up.count     I64 []
  all.down.sum        F32 [E,I,I]   all.down.count        I64 [E]
  dense.<checkpoint weight name>.sum F32 [in,in]   dense.<name>.count I64 []
  tuning.*  a sample of the layer's tokens for `encode --tune-scales` (`observe --tuning-tokens`: tuning_sample.py)
The encoder takes the mean E[xxᵀ] = sum / count.

Accumulation is float32: the inputs are BF16 (8-bit mantissa), so f32's 24 bits add no visible error per
product; each batch is one f32 GEMM (blocked sums) and the running sum sees only one addition per batch,
a relative error ~1e-7·√batches, far below the encoder's damping. float64 would double the largest
accumulator (E·H² ≈ 19 GB per GLM-5.3-Flash layer) and run GEMMs 30-60x slower on GPUs.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from pathlib import Path

import torch

from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import write_safetensors
from glmquant.observe.tensor_file import chunk_streamer
from glmquant.observe.tuning_sample import TuningSampler

FORMAT = "glmquant.hessians.v1"


class HessianMode(str, Enum):
    NONE = "none"
    NATURAL = "natural"
    ALL = "all"
    BOTH = "both"

    @property
    def natural(self) -> bool:
        return self in (HessianMode.NATURAL, HessianMode.BOTH)

    @property
    def all_tokens(self) -> bool:
        return self in (HessianMode.ALL, HessianMode.BOTH)


class HessianWeighting(str, Enum):
    TOKEN = "token"
    GATE = "gate"


class _Sum:
    """One running Σ x xᵀ (optionally stacked per expert) with its token counts."""

    def __init__(self, stack: int | None, width: int, device: torch.device | str) -> None:
        shape = (width, width) if stack is None else (stack, width, width)
        self.sum = torch.zeros(shape, dtype=torch.float32, device=device)
        self.count = torch.zeros(() if stack is None else (stack,), dtype=torch.int64, device=device)

    def add(self, x: torch.Tensor, index: int | None = None, counted: bool = True) -> None:
        """x: [n, width] inputs (any float dtype); adds xᵀx in float32 (and n to the count unless `counted` is
        False: the caller adds a whole batch's counts at once with `add_counts`)."""
        x = x.reshape(-1, x.shape[-1]).float()
        target = self.sum if index is None else self.sum[index]
        target.addmm_(x.t(), x)
        if not counted:
            return
        if index is None:
            self.count += x.shape[0]
        else:
            self.count[index] += x.shape[0]

    def add_counts(self, counts: torch.Tensor) -> None:
        self.count += counts

    def chunks(self) -> Iterator[torch.Tensor]:
        """The sum one expert at a time, so writing never copies the whole stack to the CPU."""
        yield from (self.sum if self.sum.dim() == 3 else [self.sum])


class HessianAccumulator:
    """Accumulators of one layer for the chosen mode (plus dense linears when asked)."""

    def __init__(
        self,
        mode: HessianMode,
        n_experts: int,
        hidden: int,
        intermediate: int,
        device: torch.device | str = "cpu",
        weighting: HessianWeighting = HessianWeighting.TOKEN,
    ) -> None:
        self.mode = mode
        self.weighting = weighting
        self.device = device
        self.sums: dict[str, _Sum] = {}
        self.sampler: TuningSampler | None = None  # the tokens kept for `encode --tune-scales`, when asked
        if mode.natural:
            self.sums["natural.gate_up"] = _Sum(n_experts, hidden, device)
            self.sums["natural.down"] = _Sum(n_experts, intermediate, device)
        if mode.all_tokens:
            self.sums["all.gate_up"] = _Sum(None, hidden, device)
            self.sums["all.down"] = _Sum(n_experts, intermediate, device)

    def add_natural(
        self,
        expert: int,
        x: torch.Tensor,
        act: torch.Tensor,
        counted: bool = True,
        gates: torch.Tensor | None = None,
    ) -> None:
        """x: [n, H] MoE inputs routed to `expert`; act: [n, I] its intermediate activations (down's input).
        `counted` False: the token counts come later, a batch at once, from `add_natural_counts`. gates: [n] the
        tokens' normalised routing weights ĝ, which gate weighting needs."""
        if self.weighting is HessianWeighting.GATE:
            if gates is None:
                raise ValueError("gate-weighted Hessians need the routed tokens' gates")
            scale = gates.to(torch.float32).unsqueeze(-1)
            x, act = x.float() * scale, act.float() * scale
        self.sums["natural.gate_up"].add(x, expert, counted)
        self.sums["natural.down"].add(act, expert, counted)

    def add_natural_counts(self, counts: torch.Tensor) -> None:
        """counts: [E] int64 tokens per expert of a batch whose sums `add_natural(..., counted=False)` added."""
        self.sums["natural.gate_up"].add_counts(counts)
        self.sums["natural.down"].add_counts(counts)

    def add_all_gate_up(self, x: torch.Tensor) -> None:
        self.sums["all.gate_up"].add(x)

    def add_all_down(self, expert: int, act: torch.Tensor) -> None:
        self.sums["all.down"].add(act, expert)

    def add_dense(self, name: str, x: torch.Tensor) -> None:
        key = f"dense.{name}"
        if key not in self.sums:
            self.sums[key] = _Sum(None, x.shape[-1], self.device)
        self.sums[key].add(x)

    def save(self, path: Path, layer: int | None) -> None:
        """Write the sums and counts atomically; `layer` None for lm_head's (metadata layer "head")."""
        specs, providers = [], {}
        for key, acc in sorted(self.sums.items()):
            for part, value in (("sum", acc.sum), ("count", acc.count)):
                spec = TensorSpec(f"{key}.{part}", "F32" if part == "sum" else "I64", tuple(value.shape))
                specs.append(spec)
                providers[spec.name] = chunk_streamer(acc.chunks()) if part == "sum" else value
        sample = None if self.sampler is None else self.sampler.result()
        for name, value in (sample.tensors() if sample is not None else {}).items():
            specs.append(TensorSpec(name, dtype_name(value), tuple(value.shape)))
            providers[name] = value.cpu()
        write_safetensors(
            path,
            specs,
            lambda s: providers[s.name],
            {
                "format": FORMAT,
                "layer": "head" if layer is None else str(layer),
                "mode": self.mode.value,
                "weighting": self.weighting.value,
            },
        )

    @property
    def empty(self) -> bool:
        return not self.sums and (self.sampler is None or not self.sampler.kept)
