"""Routed experts for the runtime's own forward: resident per-layer EXL3 stacks run by `fused_moe` on CUDA (or
Triton's interpreter), called directly so that a whole decode step's CUDA graph captures them; elsewhere the
torch backend. A dummy artifact's stacks are generated on the device in one pass per projection."""

from __future__ import annotations

import torch
from rich.progress import track

from glmquant.checkpoint.dummy import DummyCheckpoint
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3.codebooks import MARKER_VALUES, Codebook
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.expert_cache import CacheStats
from glmquant.runtime.loader import make_backend
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.quantized_experts import ExpertBackend

GPU_BACKENDS = ("triton", "triton-eager")  # resident stacks; "triton" replays whole decode steps as CUDA graphs


def engine_experts(artifact: Artifact, options: RuntimeOptions) -> ExpertBackend:
    """The expert backend `options.backend` names, as the runtime's own forward runs it."""
    if options.backend == "torch":
        return make_backend(artifact, options)
    if options.backend not in GPU_BACKENDS:
        raise UsageError(
            f"the runtime's own forward runs experts with {', '.join(('torch', *GPU_BACKENDS))}, "
            f"not {options.backend!r}"
        )
    from glmquant.runtime.kernels.backend import _device

    return ResidentExperts(artifact, _device(options, options.backend))


class ResidentExperts:
    """Every quantized layer's experts resident on the device; each call is one `fused_moe` step."""

    def __init__(self, artifact: Artifact, device: torch.device) -> None:
        from glmquant.runtime.kernels.fused_moe import fused_moe

        self.fused_moe = fused_moe
        layers = track(artifact.quantized_layers, description="experts to device", transient=True)
        self.weights = {layer: resident_layer(artifact, layer, device) for layer in layers}
        self.capacity = len(self.weights) * artifact.virtual_experts
        self.uses = 0

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.uses += expert_ids.numel()
        return self.fused_moe(hidden.contiguous(), expert_ids, weights, self.weights[layer])

    def stats(self) -> CacheStats:
        """Every expert is resident: each use is a hit."""
        return CacheStats(self.capacity, self.capacity, self.uses, 0, 0)


class LayerExperts:
    """One layer's experts resident on the device (the MTP layer's from a draft file); each call is one `fused_moe`
    step, whatever layer index it is given."""

    def __init__(self, weights) -> None:  # MoEWeights (triton imported lazily)
        from glmquant.runtime.kernels.fused_moe import fused_moe

        self.fused_moe, self.weights = fused_moe, weights
        self.uses = 0

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.uses += expert_ids.numel()
        return self.fused_moe(hidden.contiguous(), expert_ids, weights, self.weights)

    def stats(self) -> CacheStats:
        n = self.weights.down.trellis.shape[1]
        return CacheStats(n, n, self.uses, 0, 0)

    @property
    def expert_bytes(self) -> int:
        """The bytes one routed expert's use reads: its EXL3 tensors in both stacks."""
        stacks = (self.weights.gate_up, self.weights.down)
        return sum(t[:, 0].nbytes for s in stacks for t in (s.trellis, s.suh, s.svh))


def resident_layer(artifact: Artifact, layer: int, device: torch.device):  # -> MoEWeights (triton imported lazily)
    """One MoE layer's expert stacks on `device`: read from the artifact's files, or generated for a dummy one."""
    from glmquant.runtime.kernels.backend import load_layer

    if not isinstance(artifact.checkpoint, DummyCheckpoint):
        return load_layer(artifact, layer, device)
    from glmquant.runtime.kernels.exl3_decode import codebook_id
    from glmquant.runtime.kernels.exl3_jobs import WeightStack
    from glmquant.runtime.kernels.fused_moe import MoEWeights

    ckpt = artifact.checkpoint
    codebook = Codebook(ckpt.plan.codebook)

    def stack(projections: tuple[str, ...]) -> WeightStack:
        prefixes = [artifact.expert_prefix(layer, v, p) for p in projections for v in range(artifact.virtual_experts)]
        trellis, suh, svh = (
            ckpt.read_stack([f"{x}.{part}" for x in prefixes]).to(device) for part in ("trellis", "suh", "svh")
        )
        if codebook in MARKER_VALUES:  # read like every other planned tensor, and checked
            markers = ckpt.read_stack([f"{x}.{codebook.value}" for x in prefixes])
            if not bool((markers == MARKER_VALUES[codebook]).all()):
                raise CheckpointFormatError(f"{ckpt.directory}: layer {layer} {codebook.value} markers are wrong")
        p, v = len(projections), artifact.virtual_experts
        in_features, out_features = artifact.features(projections[0])
        return WeightStack(
            trellis.view(p, v, *trellis.shape[1:]),
            suh.view(p, v, *suh.shape[1:]),
            svh.view(p, v, *svh.shape[1:]),
            codebook_id(codebook),
            in_features,
            out_features,
        )

    return MoEWeights(stack(("gate_proj", "up_proj")), stack(("down_proj",)), artifact.spec.swiglu_limit)
