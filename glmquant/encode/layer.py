"""Encode one MoE layer's routed experts into the EXL3 parts of its planned files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from glmquant.checkpoint.layouts import ArtifactPlan, ExpertSlice
from glmquant.checkpoint.reader import SourceCheckpoint, assert_finite
from glmquant.arch import table_for
from glmquant.encode.hessians import ExpertHessians, LayerHessiansView
from glmquant.encode.slices import slice_hessian, slice_weight
from glmquant.errors import NumericalError
from glmquant.exl3 import Codebook, encode_linears


@dataclass(frozen=True)
class TensorReport:
    name: str
    proxy_error: float
    fallback: str | None


@dataclass(frozen=True)
class EncodedLayer:
    tensors: dict[str, torch.Tensor]  # output tensor name -> stored EXL3 part
    reports: list[TensorReport]


def layer_slices(plan: ArtifactPlan, layer: int) -> list[ExpertSlice]:
    """The distinct EXL3 tensors of a layer, in plan order."""
    seen: dict[ExpertSlice, None] = {}
    for f in plan.expert_files(layer):
        for t in f.tensors:
            if t.expert is not None and t.expert.layer == layer:
                seen.setdefault(t.expert)
    return list(seen)


def encode_layer(
    plan: ArtifactPlan, layer: int, source: SourceCheckpoint, hessians: LayerHessiansView, seed: int,
    device: str, batch: int, on_tensor: Callable[[int], None] = lambda n: None,
) -> EncodedLayer:
    prefix = table_for(plan.spec).layer_prefix(layer)
    tensors: dict[str, torch.Tensor] = {}
    reports: list[TensorReport] = []
    for chunk in _chunks(layer_slices(plan, layer), batch):
        items, names, fallbacks = [], [], []
        for s, weight, h in _slice_inputs(chunk, source, plan, layer, hessians):
            items.append((slice_weight(weight, s), slice_hessian(h.gate_up if s.proj != "down_proj" else h.down, s)))
            names.append(prefix + s.key)
            fallbacks.append(h.fallback)
        encoded = encode_linears(items, plan.bits, Codebook(plan.codebook), seed, device=device)
        for name, enc, fallback in zip(names, encoded, fallbacks):
            tensors.update(enc.tensor.tensors(name))
            reports.append(TensorReport(name, enc.proxy_error, fallback or enc.fallback))
        on_tensor(len(chunk))
    return EncodedLayer(tensors, reports)


def _slice_inputs(chunk: list[ExpertSlice], source: SourceCheckpoint, plan: ArtifactPlan, layer: int,
                  hessians: LayerHessiansView) -> Iterator[tuple[ExpertSlice, torch.Tensor, ExpertHessians]]:
    """Each slice with its (finite) source weight and its expert's Hessians, reading each only once."""
    table = table_for(plan.spec)
    weights: dict[tuple[int, str], torch.Tensor] = {}
    expert_h: dict[int, ExpertHessians] = {}
    for s in chunk:
        key = (s.source_expert, s.proj)
        if key not in weights:
            name = table.expert_name(layer, s.source_expert, s.proj)
            weights[key] = source.read_tensor(name).float()
            try:
                assert_finite(name, weights[key])
            except NumericalError as exc:
                raise NumericalError(f"{source.shard_of(name)}: {exc}") from None
        if s.source_expert not in expert_h:
            expert_h[s.source_expert] = hessians.expert(s.source_expert)
        yield s, weights[key], expert_h[s.source_expert]


def _chunks(items: list[ExpertSlice], size: int) -> Iterator[list[ExpertSlice]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
