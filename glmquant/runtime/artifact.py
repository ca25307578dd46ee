"""Open a quantized artifact (tr3 or exllamav3 layout): which layers are quantized and where each expert lives.

The layout is read from the tensor names alone: `...experts.E.proj.rankR.trellis` means tr3 (every expert
projection stored as R rank slices), `...experts.E.proj.trellis` the plain ExLlamaV3 layout (R = 1). The
runtime addresses rank slices as *virtual experts* `virtual_id = expert * R + rank`, each a SwiGLU MLP of
width moe_intermediate_size / R; the MTP layer is not part of the served model (see `Artifact.retained_names`): only
speculative decoding reads it (`runtime.mtp`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from glmquant.arch import PROJECTIONS, ModelSpec, load_model_spec, read_config, table_for
from glmquant.arch.module_map import layer_plan
from glmquant.checkpoint.dummy import DummyCheckpoint
from glmquant.checkpoint.layouts import EXL3_PARTS, RetainedLinear, quantizable_head, quantizable_retained
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.errors import CheckpointFormatError
from glmquant.exl3.decode import decode_weight
from glmquant.exl3.tensor import EXL3Tensor


@dataclass(frozen=True)
class Artifact:
    """A quantized checkpoint ready to serve: its config, layout and lazily read tensors."""

    path: Path
    config: Mapping[str, Any] = field(repr=False)  # config.json as stored (with quantization_config)
    spec: ModelSpec = field(repr=False)
    layout: str  # "tr3" | "exllamav3"
    ranks: int  # rank slices per expert projection: virtual experts per logical expert
    quantized_layers: tuple[int, ...]
    checkpoint: SourceCheckpoint | DummyCheckpoint = field(repr=False, compare=False)  # the dummy: --load-format dummy

    @property
    def virtual_experts(self) -> int:
        return self.spec.n_routed_experts * self.ranks

    @property
    def slice_width(self) -> int:
        """Intermediate width of one virtual expert."""
        return self.spec.moe_intermediate_size // self.ranks

    def expert_prefix(self, layer: int, virtual_id: int, proj: str) -> str:
        """Tensor prefix (without `.trellis` etc.) of one virtual expert's projection."""
        expert, rank = divmod(virtual_id, self.ranks)
        base = table_for(self.spec).expert_name(layer, expert, proj).removesuffix(".weight")
        return f"{base}.rank{rank}" if self.layout == "tr3" else base

    def features(self, proj: str) -> tuple[int, int]:
        """(in_features, out_features) of a virtual expert's projection."""
        h, w = self.spec.hidden_size, self.slice_width
        return (w, h) if proj == "down_proj" else (h, w)

    def read_expert(self, layer: int, virtual_id: int, proj: str, device: torch.device | str = "cpu") -> EXL3Tensor:
        """The EXL3 tensor of one virtual expert projection, read from disk (only its own bytes)."""
        prefix = self.expert_prefix(layer, virtual_id, proj)
        names = [f"{prefix}.{part}" for part in EXL3_PARTS if f"{prefix}.{part}" in self.checkpoint]
        tensors = {n: self.checkpoint.read_tensor(n).to(device) for n in names}
        try:
            return EXL3Tensor.from_tensors(tensors, prefix, *self.features(proj))
        except ValueError as exc:
            raise CheckpointFormatError(f"{self.path}: {exc}") from None

    def decode_expert(
        self,
        layer: int,
        expert: int,
        proj: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """One logical expert's projection as its HF (out, in) weight, decoded on `device`: the rank slices decoded
        and concatenated (gate/up along the output dim, down along the input dim)."""
        parts = [
            decode_weight(self.read_expert(layer, expert * self.ranks + r, proj, device), dtype)
            for r in range(self.ranks)
        ]
        return torch.cat(parts, dim=1 if proj == "down_proj" else 0)

    def retained_names(self) -> list[str]:
        """Tensors loaded as they are: everything but the quantized routed experts, the retained linears stored as
        EXL3 (`retained_linears`) and the MTP layer.

        The MTP layer (speculative next-token head) is skipped: transformers' model has no module for it
        and plain decoding never runs it (`runtime.mtp.load_mtp` reads it for speculative decoding).
        """
        table = table_for(self.spec)
        skipped = tuple(table.layer_prefix(layer) for layer in self.spec.mtp_layers)
        experts = tuple(f"{table.layer_prefix(layer)}mlp.experts." for layer in self.quantized_layers)
        linears = self.retained_linears
        return [
            n
            for n in self.checkpoint.names()
            if not n.startswith(skipped + experts) and n.rpartition(".")[0] not in linears
        ]

    @cached_property
    def retained_linears(self) -> dict[str, RetainedLinear]:
        """The retained linears and head stored as EXL3 (the speed tier, `encode --retained-bits`, `--head-bits`), by
        EXL3 key (the source weight's name without `.weight`); empty for an artifact whose retained tensors are all
        exact."""
        return _retained_linears(self.path, self.spec, self.checkpoint)

    def retained_linear_modules(self) -> dict[str, RetainedLinear]:
        """The EXL3 retained linears by the path of the `nn.Linear` that holds each in transformers' model;
        CheckpointFormatError for one no module holds."""
        try:
            return linear_module_paths(self.spec, self.retained_linears.values())
        except KeyError as exc:
            raise CheckpointFormatError(f"{self.path}: EXL3 linear {exc.args[0]} has no module") from None

    def read_linear(self, linear: RetainedLinear, device: torch.device | str = "cpu") -> EXL3Tensor:
        """The EXL3 tensor of one retained linear, read from disk."""
        names = [f"{linear.key}.{part}" for part in EXL3_PARTS if f"{linear.key}.{part}" in self.checkpoint]
        tensors = {n: self.checkpoint.read_tensor(n).to(device) for n in names}
        try:
            return EXL3Tensor.from_tensors(tensors, linear.key, linear.in_features, linear.out_features)
        except ValueError as exc:
            raise CheckpointFormatError(f"{self.path}: {exc}") from None


def linear_module_paths(spec: ModelSpec, linears: Iterable[RetainedLinear]) -> dict[str, RetainedLinear]:
    """Linears outside the routed experts by the path of the `nn.Linear` that holds each in transformers' model (the
    layer's placement of its source weight; lm_head's is its own name); KeyError (the linear's key) for one no module
    holds."""
    table, linears = table_for(spec), list(linears)
    out: dict[str, RetainedLinear] = {lin.key: lin for lin in linears if lin.layer is None}
    for layer in sorted({lin.layer for lin in linears if lin.layer is not None}):
        targets = {p.source: p.target for p in layer_plan(spec, layer, spec.moe_intermediate_size).placements}
        for linear in (lin for lin in linears if lin.layer == layer):
            target = targets.get(linear.source)
            if target is None or not target.endswith(".weight"):
                raise KeyError(f"{linear.key} (layer {layer})")
            out[table.layer_prefix(layer) + target.removesuffix(".weight")] = linear
    return out


def open_artifact(path: str | Path) -> Artifact:
    """Open an artifact directory, detect its layout and check every quantized layer is complete."""
    path = Path(path)
    config = read_config(path)
    spec = load_model_spec(config)
    checkpoint = SourceCheckpoint.open(path)
    found = _expert_parts(spec, checkpoint.names())
    if not found:
        raise CheckpointFormatError(f"{path}: no EXL3 routed-expert tensors (…experts.E.proj[.rankR].trellis) found")
    rank_sets = {rank for keys in found.values() for (_, _, rank) in keys}
    layout = "exllamav3" if rank_sets == {None} else "tr3"
    if layout == "tr3" and None in rank_sets:
        raise CheckpointFormatError(f"{path}: mixes rank-sliced (tr3) and whole (exllamav3) expert tensors")
    ranks = 1 if layout == "exllamav3" else len(rank_sets)
    _check_ranks(path, config, ranks)
    for layer in spec.moe_layers:
        _check_layer(path, spec, layer, found.get(layer, set()), ranks if layout == "tr3" else None)
    return Artifact(path, config, spec, layout, ranks, tuple(spec.moe_layers), checkpoint)


def _expert_parts(spec: ModelSpec, names: list[str]) -> dict[int, set[tuple[int, str, int | None]]]:
    """(expert, proj, rank) of every routed-expert trellis, per decoder layer."""
    prefix = re.escape(table_for(spec).text_prefix)
    projections = "|".join(PROJECTIONS)
    pattern = re.compile(rf"^{prefix}layers\.(\d+)\.mlp\.experts\.(\d+)\.({projections})(?:\.rank(\d+))?\.trellis$")
    found: dict[int, set[tuple[int, str, int | None]]] = defaultdict(set)
    for name in names:
        m = pattern.match(name)
        if m and int(m[1]) < spec.num_hidden_layers:
            found[int(m[1])].add((int(m[2]), m[3], None if m[4] is None else int(m[4])))
    return found


def _retained_linears(
    path: Path, spec: ModelSpec, checkpoint: SourceCheckpoint | DummyCheckpoint
) -> dict[str, RetainedLinear]:
    """Every EXL3 trellis that is not a routed expert's must be a retained linear or the head the architecture
    names; its K is its trellis's."""
    known = {t.name.removesuffix(".weight"): t for t in quantizable_retained(spec)}
    if not spec.tie_word_embeddings:
        head = quantizable_head(spec)
        known[head.name.removesuffix(".weight")] = head
    routed = re.compile(r"\.layers\.\d+\.mlp\.experts\.\d+\.")
    found: dict[str, RetainedLinear] = {}
    for name in checkpoint.names():
        key, _, part = name.rpartition(".")
        if part != "trellis" or routed.search(key + "."):
            continue
        info = known.get(key)
        if info is None:
            raise CheckpointFormatError(
                f"{path}: EXL3 tensor {key} is neither a routed expert nor a retained linear or lm_head"
            )
        found[key] = RetainedLinear.of(info, checkpoint.spec(name).shape[-1] // 16)
    return found


def _check_ranks(path: Path, config: Mapping[str, Any], ranks: int) -> None:
    declared = (config.get("quantization_config") or {}).get("rank_stacked_tp")
    if declared is not None and int(declared) != ranks:
        raise CheckpointFormatError(
            f"{path}/config.json: rank_stacked_tp is {declared} but the tensors hold {ranks} rank slices"
        )


def _check_layer(
    path: Path, spec: ModelSpec, layer: int, have: set[tuple[int, str, int | None]], ranks: int | None
) -> None:
    """Every expert x projection x rank of a MoE layer must be present, and nothing else."""
    rank_ids = [None] if ranks is None else list(range(ranks))
    want = {(e, p, r) for e in range(spec.n_routed_experts) for p in PROJECTIONS for r in rank_ids}
    if have != want:
        missing, extra = sorted(want - have, key=str), sorted(have - want, key=str)
        detail = f"missing {len(missing)} e.g. {missing[0]}" if missing else f"unexpected {len(extra)} e.g. {extra[0]}"
        raise CheckpointFormatError(
            f"{path}: layer {layer} routed experts are incomplete ({detail} as (expert, proj, rank)); "
            f"expected {spec.n_routed_experts} experts x {len(PROJECTIONS)} projections x {len(rank_ids)} slices"
        )
