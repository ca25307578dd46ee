"""One observation of the tiny model (both Hessian modes, dense Hessians, a prune plan) and the same rows
through transformers' full model with hooks, shared by the observe tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from observe_helpers import BATCH, observe_config

from glmquant.calibration import TokenRows
from glmquant.observe.run import observe


@pytest.fixture(scope="session")
def observed(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("observed")
    observe(observe_config(tiny_source, out))
    return out


@dataclass
class MoECapture:
    """What the full model's MoE block of one layer saw: its input and its router's outputs."""

    x: list[torch.Tensor] = field(default_factory=list)  # [n, H] bf16 per batch
    weights: list[torch.Tensor] = field(default_factory=list)  # [n, k]
    indices: list[torch.Tensor] = field(default_factory=list)  # [n, k]
    q_proj_in: list[torch.Tensor] = field(default_factory=list)  # layer 1 only: KDA q_proj input
    block_in: list[torch.Tensor] = field(default_factory=list)  # the MoE block's input before its norm
    block_out: list[torch.Tensor] = field(default_factory=list)  # the MoE block's output (routed + shared)
    routed_out: list[torch.Tensor] = field(default_factory=list)  # the routed experts' output

    def router(self, output: tuple) -> None:
        self.weights.append(output[1])
        self.indices.append(output[2])


@dataclass
class Reference:
    model: torch.nn.Module
    layers: dict[int, MoECapture]


@pytest.fixture(scope="session")
def reference(tiny_source: Path, observed: Path) -> Reference:
    """transformers' full model over the observed token rows, in the same row batches, with hooks."""
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(str(tiny_source), dtype=torch.bfloat16).eval()
    text = model.model.language_model
    layers: dict[int, MoECapture] = {}
    for i, layer in enumerate(text.layers):
        if not hasattr(layer.mlp, "experts"):
            continue
        cap = layers[i] = MoECapture()
        layer.mlp.register_forward_pre_hook(lambda m, a, cap=cap: cap.x.append(a[0].reshape(-1, a[0].shape[-1])))
        layer.mlp.gate.register_forward_hook(lambda m, a, out, cap=cap: cap.router(out))
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, cap=cap: cap.block_in.append(a[0]))
        layer.mlp.register_forward_hook(lambda m, a, out, cap=cap: cap.block_out.append(out))
        layer.mlp.experts.register_forward_hook(lambda m, a, out, cap=cap: cap.routed_out.append(out))
        if i == 1:
            layer.self_attn.q_proj.register_forward_pre_hook(
                lambda m, a, cap=cap: cap.q_proj_in.append(a[0].reshape(-1, a[0].shape[-1]))
            )
    ids = TokenRows.load(observed).lanes[0].ids.long()
    with torch.no_grad():
        for batch in ids.split(BATCH):
            model.model(input_ids=batch)
    return Reference(model, layers)
