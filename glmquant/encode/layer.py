"""Encode a MoE layer's routed experts in work units: a fixed group of experts, all their EXL3 tensors encoded
together (one set of batched LDLQ stacks and Viterbi calls). Reading a unit's inputs is separate from encoding
them, so the runner can read the next unit while the device encodes this one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from glmquant.arch import table_for
from glmquant.checkpoint.layouts import ArtifactPlan, ExpertSlice
from glmquant.checkpoint.reader import SourceCheckpoint, assert_finite
from glmquant.encode.hessians import ExpertHessians, LayerHessiansView
from glmquant.encode.slices import slice_hessian, slice_weight
from glmquant.errors import NumericalError
from glmquant.exl3 import Codebook, encode_linears
from glmquant.exl3.encode import EncodedLinear
from glmquant.exl3.scale_search import DEFAULT_SEARCH, ScaleSearch


@dataclass(frozen=True)
class TensorReport:
    name: str
    proxy_error: float
    fallback: str | None


@dataclass(frozen=True)
class EncodedLayer:
    tensors: dict[str, torch.Tensor]  # output tensor name -> stored EXL3 part
    reports: list[TensorReport]


@dataclass(frozen=True)
class UnitInputs:
    """What one unit encodes, read from the source and the observations (CPU tensors)."""

    names: list[str]  # output tensor prefix per EXL3 tensor
    items: list[tuple[torch.Tensor, torch.Tensor | None]]  # (HF weight, Hessian) per EXL3 tensor
    fallbacks: list[str | None]
    bits: list[int] | None = None  # K per EXL3 tensor (its expert's tier); None: all at encode_unit's `bits`


def layer_slices(plan: ArtifactPlan, layer: int) -> list[ExpertSlice]:
    """The distinct EXL3 tensors of a layer, in plan order."""
    seen: dict[ExpertSlice, None] = {}
    for f in plan.expert_files(layer):
        for t in f.tensors:
            if t.expert is not None and t.expert.layer == layer:
                seen.setdefault(t.expert)
    return list(seen)


def layer_units(plan: ArtifactPlan, layer: int, experts_per_unit: int) -> list[list[ExpertSlice]]:
    """The layer's EXL3 tensors grouped by expert, `experts_per_unit` experts (in plan order) per unit."""
    by_expert: dict[int, list[ExpertSlice]] = {}
    for s in layer_slices(plan, layer):
        by_expert.setdefault(s.expert, []).append(s)
    experts = list(by_expert.values())
    return [
        [s for group in experts[i : i + experts_per_unit] for s in group]
        for i in range(0, len(experts), experts_per_unit)
    ]


def read_unit(
    plan: ArtifactPlan, layer: int, unit: list[ExpertSlice], source: SourceCheckpoint, hessians: LayerHessiansView
) -> UnitInputs:
    """Each slice's (finite) source weight and input Hessian; each expert's weights and Hessians read once."""
    prefix = table_for(plan.spec).layer_prefix(layer)
    names, items, fallbacks = [], [], []
    for s, weight, h in _slice_inputs(unit, source, plan, layer, hessians):
        items.append((slice_weight(weight, s), slice_hessian(h.gate_up if s.proj != "down_proj" else h.down, s)))
        names.append(prefix + s.key)
        fallbacks.append(h.fallback)
    return UnitInputs(names, items, fallbacks, [plan.bits_of(layer, s.expert) for s in unit])


def encode_unit(
    inputs: UnitInputs, bits: int | None, codebook: str, seed: int, device: str, search: ScaleSearch = DEFAULT_SEARCH
) -> EncodedLayer:
    """Encode every tensor of a unit on `device`: one batched call per bit width (tiers), results in unit order.
    `bits` is the K of tensors whose inputs carry none; None when every tensor's K is in the inputs (ValueError
    otherwise)."""
    if inputs.bits is not None:
        widths = inputs.bits
    elif bits is not None:
        widths = [bits] * len(inputs.items)
    else:
        raise ValueError(f"encode_unit: no K for {', '.join(inputs.names)} (the inputs carry none, no default given)")
    dev = torch.device(device)
    moved: dict[int, torch.Tensor] = {}  # one device copy per distinct Hessian (shared ones stay shared)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if t.device == dev:
            return t
        if id(t) not in moved:
            moved[id(t)] = t.to(dev, non_blocking=True)
        return moved[id(t)]

    items = [(to_device(w), None if h is None else to_device(h)) for w, h in inputs.items]
    encoded: dict[int, EncodedLinear] = {}
    for k in sorted(set(widths)):
        batch = [i for i, w in enumerate(widths) if w == k]
        for i, enc in zip(
            batch,
            encode_linears([items[i] for i in batch], k, Codebook(codebook), seed, device=device, scale_search=search),
        ):
            encoded[i] = enc
    tensors: dict[str, torch.Tensor] = {}
    reports: list[TensorReport] = []
    for name, enc, fallback in zip(inputs.names, (encoded[i] for i in range(len(items))), inputs.fallbacks):
        tensors.update(enc.tensor.tensors(name))
        reports.append(TensorReport(name, enc.proxy_error, fallback or enc.fallback))
    return EncodedLayer(tensors, reports)


def encode_units(
    plan: ArtifactPlan,
    units: list[tuple[int, list[ExpertSlice]]],
    source: SourceCheckpoint,
    hessians: Callable[[int], LayerHessiansView],
    seed: int,
    device: str,
) -> Iterator[EncodedLayer]:
    """Encode (layer, unit) pairs in order; one reader thread reads unit i + 1 while unit i encodes (the source
    reader is safe from several threads)."""
    if not units:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-read") as reader:
        pending = reader.submit(read_unit, plan, units[0][0], units[0][1], source, hessians(units[0][0]))
        for i in range(len(units)):
            inputs = pending.result()
            if i + 1 < len(units):
                nxt_layer, nxt = units[i + 1]
                pending = reader.submit(read_unit, plan, nxt_layer, nxt, source, hessians(nxt_layer))
            yield encode_unit(inputs, plan.bits, plan.codebook, seed, device)


def _slice_inputs(
    chunk: list[ExpertSlice], source: SourceCheckpoint, plan: ArtifactPlan, layer: int, hessians: LayerHessiansView
) -> Iterator[tuple[ExpertSlice, torch.Tensor, ExpertHessians]]:
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
