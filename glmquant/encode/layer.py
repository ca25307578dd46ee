"""Encode a MoE layer's routed experts in work units: a fixed group of experts, all their EXL3 tensors encoded
together (one set of batched LDLQ stacks and Viterbi calls). Reading a unit's inputs is separate from encoding
them, so the runner can read the next unit while the device encodes this one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from glmquant.arch import ModelSpec, table_for
from glmquant.checkpoint.layouts import ArtifactPlan, ExpertSlice
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.hessians import ExpertHessians, LayerHessiansView
from glmquant.encode.scale_tuning import ExpertPart, UnitTuning, tune_unit_scales
from glmquant.encode.slices import slice_hessian, slice_weight
from glmquant.errors import UsageError
from glmquant.exl3 import Codebook, encode_linears
from glmquant.exl3.encode import EncodedLinear
from glmquant.exl3.refit import REFIT_ROUNDS
from glmquant.exl3.scale_search import DEFAULT_SEARCH, ScaleSearch


@dataclass(frozen=True)
class TensorReport:
    name: str
    proxy_error: float
    fallback: str | None


@dataclass(frozen=True)
class TuningReport:
    """`--tune-scales` on one unit: its experts' held-out output error (relative) with the encoded scales and with
    the kept step's, that step (0: the encoded scales kept) and every step's error, step 0 first."""

    experts: int  # the experts whose scales changed
    heldout_before: float
    heldout_after: float
    best_step: int
    heldout_by_step: tuple[float, ...]


@dataclass(frozen=True)
class EncodedLayer:
    tensors: dict[str, torch.Tensor]  # output tensor name -> stored EXL3 part
    reports: list[TensorReport]
    tuning: TuningReport | None = None  # with `--tune-scales`


@dataclass(frozen=True)
class UnitInputs:
    """What one unit encodes, read from the source and the observations (CPU tensors)."""

    names: list[str]  # output tensor prefix per EXL3 tensor
    items: list[tuple[torch.Tensor, torch.Tensor | None]]  # (HF weight, Hessian) per EXL3 tensor
    fallbacks: list[str | None]
    bits: list[int] | None = None  # K per EXL3 tensor (its expert's tier); None: all at encode_unit's `bits`
    slices: list[ExpertSlice] | None = None  # the routed-expert slice per EXL3 tensor (None: not routed experts)
    tuning: UnitTuning | None = None  # `--tune-scales`: the experts' scales tuned on their tokens after encoding


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
    plan: ArtifactPlan,
    layer: int,
    unit: list[ExpertSlice],
    source: SourceCheckpoint,
    hessians: LayerHessiansView,
    tune_steps: int = 0,
) -> UnitInputs:
    """Each slice's (finite) source weight and input Hessian; each expert's weights and Hessians read once. With
    `tune_steps`, also each expert's sampled tokens (UsageError when the observations hold none)."""
    inputs, weights = read_slices(plan.spec, layer, unit, source, hessians)
    tuning = None
    if tune_steps:
        sample = hessians.sample()
        if sample is None:
            raise UsageError(
                f"--tune-scales: the observations hold no tuning sample for layer {layer} "
                "(observe with --tuning-tokens N)"
            )
        tuning = UnitTuning(tune_steps, plan.spec.swiglu_limit, weights, sample.routed_to(list(weights)))
    return replace(inputs, bits=[plan.bits_of(layer, s.expert) for s in unit], tuning=tuning)


def read_slices(
    spec: ModelSpec, layer: int, unit: list[ExpertSlice], source: SourceCheckpoint, hessians: LayerHessiansView
) -> tuple[UnitInputs, dict[int, dict[str, torch.Tensor]]]:
    """The unit's inputs (no K: `encode_unit`'s `bits` applies) and each source expert's weights by projection."""
    prefix = table_for(spec).layer_prefix(layer)
    names, items, fallbacks = [], [], []
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for s, weight, h in _slice_inputs(unit, source, spec, layer, hessians):
        items.append((slice_weight(weight, s), slice_hessian(h.gate_up if s.proj != "down_proj" else h.down, s)))
        names.append(prefix + s.key)
        fallbacks.append(h.fallback)
        weights.setdefault(s.source_expert, {})[s.proj] = weight
    return UnitInputs(names, items, fallbacks, None, list(unit)), weights


def encode_unit(
    inputs: UnitInputs,
    bits: int | None,
    codebook: str,
    seed: int,
    device: str,
    search: ScaleSearch = DEFAULT_SEARCH,
    refit_rounds: int = REFIT_ROUNDS,
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
            encode_linears(
                [items[i] for i in batch],
                k,
                Codebook(codebook),
                seed,
                device=device,
                scale_search=search,
                refit_rounds=refit_rounds,
            ),
        ):
            encoded[i] = enc
    tuning = None
    if inputs.tuning is not None:
        assert inputs.slices is not None  # read_unit gives routed experts' slices with their tuning
        tuned, tuning = _tuned(inputs.tuning, inputs.slices, items, encoded, dev)
        encoded.update(tuned)
    tensors: dict[str, torch.Tensor] = {}
    reports: list[TensorReport] = []
    for name, enc, fallback in zip(inputs.names, (encoded[i] for i in range(len(items))), inputs.fallbacks):
        tensors.update(enc.tensor.tensors(name))
        reports.append(TensorReport(name, enc.proxy_error, fallback or enc.fallback))
    return EncodedLayer(tensors, reports, tuning)


def _tuned(
    tuning: UnitTuning,
    slices: list[ExpertSlice],
    items: list[tuple[torch.Tensor, torch.Tensor | None]],
    encoded: dict[int, EncodedLinear],
    device: torch.device,
) -> tuple[dict[int, EncodedLinear], TuningReport | None]:
    """The unit's tensors whose experts' scale tuning beat the encoded scales (scale_tuning.py), with their proxy
    errors measured again, and the tuning's report (None when no expert had the tokens to tune); an expert any of
    whose tuned tensors decodes to non-finite values keeps its encoded ones."""
    members: dict[int, list[int]] = {}
    for i, s in enumerate(slices):
        members.setdefault(s.source_expert, []).append(i)
    experts = {
        expert: [ExpertPart(slices[i].proj, slices[i].rank, encoded[i].tensor) for i in idx]
        for expert, idx in members.items()
    }
    out: dict[int, EncodedLinear] = {}
    outcome = tune_unit_scales(experts, tuning, device)
    changed = 0
    for expert, tensors in outcome.tensors.items():
        tuned = {i: encoded[i].with_tensor(t, *items[i], device) for i, t in zip(members[expert], tensors)}
        if all(enc is not None for enc in tuned.values()):
            out.update({i: enc for i, enc in tuned.items() if enc is not None})
            changed += 1
    if not outcome.heldout_by_step:  # no expert of the unit had enough sampled tokens: nothing was tuned
        return out, None
    report = TuningReport(
        changed, outcome.heldout_before, outcome.heldout_after, outcome.best_step, outcome.heldout_by_step
    )
    return out, report


def encode_units(
    plan: ArtifactPlan,
    units: list[tuple[int, list[ExpertSlice]]],
    source: SourceCheckpoint,
    hessians: Callable[[int], LayerHessiansView],
    seed: int,
    device: str,
    tune_steps: int = 0,
) -> Iterator[EncodedLayer]:
    """Encode (layer, unit) pairs in order; one reader thread reads unit i + 1 while unit i encodes (the source
    reader is safe from several threads). `tune_steps`: `--tune-scales`."""
    if not units:
        return
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode-read")

    def read(layer: int, unit: list[ExpertSlice]) -> Future[UnitInputs]:
        return reader.submit(read_unit, plan, layer, unit, source, hessians(layer), tune_steps)

    finished = False
    try:
        pending = read(*units[0])
        for i in range(len(units)):
            inputs = pending.result()
            if i + 1 < len(units):
                pending = read(*units[i + 1])
            yield encode_unit(inputs, plan.bits, plan.codebook, seed, device)
        finished = True
    finally:  # a failure or Ctrl-C does not wait here for the read under way (the process exit still does)
        reader.shutdown(wait=finished, cancel_futures=True)


def _slice_inputs(
    chunk: list[ExpertSlice], source: SourceCheckpoint, spec: ModelSpec, layer: int, hessians: LayerHessiansView
) -> Iterator[tuple[ExpertSlice, torch.Tensor, ExpertHessians]]:
    """Each slice with its (finite) source weight and its expert's Hessians, reading each only once."""
    table = table_for(spec)
    weights: dict[tuple[int, str], torch.Tensor] = {}
    expert_h: dict[int, ExpertHessians] = {}
    for s in chunk:
        key = (s.source_expert, s.proj)
        if key not in weights:
            weights[key] = source.read_finite_float(table.expert_name(layer, s.source_expert, s.proj))
        if s.source_expert not in expert_h:
            expert_h[s.source_expert] = hessians.expert(s.source_expert)
        yield s, weights[key], expert_h[s.source_expert]
