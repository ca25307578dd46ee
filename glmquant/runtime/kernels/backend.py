"""GPU expert backends for the runtime: `TritonExpertBackend` ("triton"; "triton-eager" without graphs) and
`ExllamaV3ExpertBackend` ("exllamav3", registered when the package is installed) for side-by-side runs.

Both keep every quantized layer's experts resident on the GPU as stacked EXL3 tensors (read one layer at a
time from the artifact); the Triton backend replays decode steps of up to `GRAPH_TOKENS` tokens from
captured CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from rich.progress import track

from glmquant.arch import PROJECTIONS
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.expert_cache import CacheStats
from glmquant.runtime.kernels.availability import EXLLAMAV3_AVAILABLE, interpreter_requested
from glmquant.runtime.kernels.cuda_graphs import StepGraphs
from glmquant.runtime.kernels.exl3_jobs import WeightStack
from glmquant.runtime.kernels.fused_moe import MoEWeights, fused_moe
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import register_backend

GRAPH_TOKENS = 16  # decode batches up to this size replay a graph; larger (prefill) batches run eagerly
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TierGroup:
    """The virtual experts of one MoE layer that share a bit width, stacked, and where each virtual expert of the
    layer sits in the stack (-1: in another group)."""

    weights: MoEWeights
    local_id: torch.Tensor  # int64 [virtual experts of the layer]


def load_layer(artifact: Artifact, layer: int, device: torch.device) -> MoEWeights:
    """Every virtual expert of a one-K MoE layer, stacked on `device` (gate and up as one P = 2 stack); a layer
    with tiers (several K) is refused: `load_tier_groups` loads those."""
    groups = load_tier_groups(artifact, layer, device)
    if len(groups) > 1:
        raise CheckpointFormatError(
            f"{artifact.path}: layer {layer} routed experts have several bit widths (tiers); "
            "load them with load_tier_groups and run them with tiered_step"
        )
    return groups[0].weights


def load_tier_groups(artifact: Artifact, layer: int, device: torch.device) -> list[TierGroup]:
    """Every virtual expert of one MoE layer on `device`, one stack per bit width (gate and up as one P = 2
    stack): a layer of one K is one group; tiers (per-expert K) give one group per K."""
    experts = {p: [artifact.read_expert(layer, v, p) for v in range(artifact.virtual_experts)] for p in PROJECTIONS}
    widths = [t.bits for t in experts["down_proj"]]
    groups = []
    try:
        for k in sorted(set(widths)):
            members = [v for v, w in enumerate(widths) if w == k]
            picked = {proj: [experts[proj][v] for v in members] for proj in PROJECTIONS}
            gate_up = WeightStack.from_tensors([picked["gate_proj"], picked["up_proj"]], device)
            down = WeightStack.from_tensors([picked["down_proj"]], device)
            local = torch.full((len(widths),), -1, dtype=torch.int64)
            local[members] = torch.arange(len(members))
            groups.append(TierGroup(MoEWeights(gate_up, down, artifact.spec.swiglu_limit), local.to(device)))
    except ValueError as exc:
        raise CheckpointFormatError(f"{artifact.path}: layer {layer} routed experts: {exc}") from None
    return groups


def tiered_step(groups: list[TierGroup], make_step: Callable[[MoEWeights], Step]) -> Step:
    """One MoE step over a layer's tier groups. One group: its step as it is. Several: every group's step runs
    over all routes, a route of another group mapped to local expert 0 with router weight 0 (so it adds exactly
    0), and the outputs are summed in fp32: static shapes and no host sync, so it still graph-captures, at the
    cost of one pass per bit width."""
    steps = [make_step(g.weights) for g in groups]
    if len(groups) == 1:
        return steps[0]

    def step(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for group, run in zip(groups, steps):
            local = group.local_id[expert_ids]
            mine = local >= 0
            out += run(hidden, local.clamp(min=0), torch.where(mine, weights, 0.0)).float()
        return out.to(hidden.dtype)

    return step


class GraphedExperts:
    """`ExpertBackend` over per-layer step functions; decode-sized batches replay CUDA graphs."""

    def __init__(
        self, artifact: Artifact, device: torch.device, make_step: Callable[[MoEWeights], Step], cuda_graphs: bool
    ) -> None:
        layers = track(artifact.quantized_layers, description="experts to GPU", transient=True)
        self.steps = {layer: tiered_step(load_tier_groups(artifact, layer, device), make_step) for layer in layers}
        self.graphs = StepGraphs() if cuda_graphs and device.type == "cuda" else None
        self.capacity = len(self.steps) * artifact.virtual_experts
        self.uses = 0

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.uses += expert_ids.numel()
        step = self.steps[layer]
        if self.graphs is not None and hidden.shape[0] <= GRAPH_TOKENS:
            return self.graphs(layer, step, hidden.contiguous(), expert_ids, weights)
        return step(hidden.contiguous(), expert_ids, weights)

    def stats(self) -> CacheStats:
        """Every expert is resident: each use is a hit."""
        return CacheStats(self.capacity, self.capacity, self.uses, 0, 0)


class ExllamaV3MoE:
    """One MoE layer through ExLlamaV3 1.6.5's fused `exl3_moe` kernel, on the same device tensors as ours.

    Tokens go through in chunks of at most `max_tokens` (the kernel's per-expert row buffers).
    """

    def __init__(self, w: MoEWeights, max_tokens: int = 64) -> None:
        from exllamav3.ext import exllamav3_ext as ext  # lazy: builds or loads the CUDA extension

        gu, d = w.gate_up, w.down
        if gu.codebook not in (1, 2) or d.codebook != gu.codebook or gu.bits != d.bits:
            raise UsageError("ExLlamaV3's fused MoE kernel needs one bit width and the mcg or mul1 codebook throughout")
        if gu.in_features % 128 or gu.out_features % 128:
            raise UsageError("ExLlamaV3's fused MoE kernel needs hidden and intermediate sizes divisible by 128")
        self.ext, self.w, self.max_tokens = ext, w, max_tokens
        self.ptrs = [
            self._pointers(stack, p, part)
            for stack, p in ((gu, 0), (gu, 1), (d, 0))
            for part in ("trellis", "suh", "svh")
        ]
        device = gu.trellis.device
        groups = ext.exl3_moe_max_concurrency(device.index if device.index is not None else torch.cuda.current_device())
        h, i = gu.in_features, gu.out_features
        self.temp = [torch.empty((groups, max_tokens, n), dtype=torch.float16, device=device) for n in (h, h, i, i)]

    @staticmethod
    def _pointers(stack: WeightStack, p: int, part: str) -> torch.Tensor:
        t = getattr(stack, part)[p]  # [V, ...] contiguous
        step = t[0].numel() * t.element_size()
        return (t.data_ptr() + step * torch.arange(t.shape[0], dtype=torch.int64)).to(t.device)

    def __call__(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((hidden.shape[0], self.w.down.out_features), dtype=torch.float32, device=hidden.device)
        for t0 in range(0, hidden.shape[0], self.max_tokens):
            self._chunk(
                hidden[t0 : t0 + self.max_tokens],
                expert_ids[t0 : t0 + self.max_tokens],
                weights[t0 : t0 + self.max_tokens],
                out[t0 : t0 + self.max_tokens],
            )
        return out.to(hidden.dtype)

    def _chunk(self, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
        n = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        count = torch.zeros(self.w.experts + 1, dtype=torch.int64, device=flat.device)
        count.scatter_add_(0, flat, torch.ones_like(flat))
        cb = self.w.gate_up.codebook
        k = float(self.w.gate_up.bits)
        limit = float(self.w.swiglu_limit or 0.0)  # 0: no clamp
        self.ext.exl3_moe(
            hidden.half().contiguous(),
            out,
            count,
            order // n,
            weights.reshape(-1)[order].half(),
            *self.temp,
            0,
            k,
            k,
            k,
            *self.ptrs,
            cb == 1,
            cb == 2,
            cb == 1,
            cb == 2,
            cb == 1,
            cb == 2,
            limit,
            -1,
            None,
            None,
            1,
            self.max_tokens,
            16,
        )


def _device(options: RuntimeOptions, name: str) -> torch.device:
    """A CUDA device, or the CPU under Triton's interpreter (TRITON_INTERPRET=1, for tests)."""
    device = torch.device(options.device)
    interpreted = interpreter_requested() and name.startswith("triton")
    if device.type != "cuda" and not interpreted:
        raise UsageError(
            f"expert backend {name!r} runs on a CUDA device (--device cuda); use --backend torch on {device}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"expert backend {name!r}: no CUDA device is visible")
    return device


class TritonExpertBackend(GraphedExperts):
    """The runtime's GPU experts: `fused_moe` on Triton kernels, decode batches replayed from CUDA graphs."""

    def __init__(self, artifact: Artifact, options: RuntimeOptions, cuda_graphs: bool = True) -> None:
        name = "triton" if cuda_graphs else "triton-eager"
        super().__init__(artifact, _device(options, name), lambda w: partial(fused_moe, w=w), cuda_graphs)


class ExllamaV3ExpertBackend(GraphedExperts):
    """ExLlamaV3's fused MoE kernel on the same resident tensors, for side-by-side runs (eager by default:
    its capture under graphs has not been verified here)."""

    def __init__(self, artifact: Artifact, options: RuntimeOptions, cuda_graphs: bool = False) -> None:
        super().__init__(artifact, _device(options, "exllamav3"), ExllamaV3MoE, cuda_graphs)


register_backend("triton", TritonExpertBackend)
register_backend("triton-eager", lambda artifact, options: TritonExpertBackend(artifact, options, cuda_graphs=False))
if EXLLAMAV3_AVAILABLE:
    register_backend("exllamav3", ExllamaV3ExpertBackend)
