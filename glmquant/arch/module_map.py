"""Checkpoint tensors -> transformers module state, for the glm5_next family.

Names and shapes are converted the way transformers' `glm5_next` conversion mapping does (renames; per-expert
gate/up/down merged into `experts.gate_up_proj` / `experts.down_proj`; q/k/v convolutions concatenated into
`conv1d`), driven by the arch table's list of a layer's tensors. Each parameter gets the dtype
`from_pretrained(dtype=bf16)` would give it: float32 where the model class keeps it in fp32
(`_keep_in_fp32_modules_strict`, which differs between transformers versions) or declares it so, the model
dtype otherwise. Both the observe stage (a source layer at a time) and the runtime (an artifact's retained
tensors) fill transformers' modules through this one plan.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from glmquant.arch.spec import ModelSpec
from glmquant.arch.table import table_for
from glmquant.errors import CheckpointFormatError, NumericalError

# transformers' glm5_next WeightRenaming entries (checkpoint name -> module name), applied in order.
RENAMES = (
    (r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
    (r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
    (r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
    (r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
    (r"hc_attn_fn", "attn_hc.fn"),
    (r"hc_attn_base", "attn_hc.base"),
    (r"hc_attn_scale", "attn_hc.scale"),
    (r"hc_ffn_fn", "ffn_hc.fn"),
    (r"hc_ffn_base", "ffn_hc.base"),
    (r"hc_ffn_scale", "ffn_hc.scale"),
)
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^self_attn\.([qkv])_conv1d\.weight$")
ATTN_IMPLEMENTATION = "sdpa"  # what from_pretrained picks for this model class when none is asked for
EXPERTS_IMPLEMENTATION = "grouped_mm"


@dataclass(frozen=True)
class Placement:
    """Where one source tensor goes: module parameter `target`, at index `where` (() = the whole tensor)."""

    source: str
    target: str
    where: tuple[int | slice, ...] = ()


@dataclass(frozen=True)
class LayerPlan:
    """The conversion of one layer's source tensors into its module state."""

    layer: int
    placements: tuple[Placement, ...]

    def source_of(self, target: str) -> str | None:
        """The checkpoint name of a module parameter loaded from exactly one whole tensor (None otherwise)."""
        hits = [p for p in self.placements if p.target == target]
        return hits[0].source if len(hits) == 1 and hits[0].where == () else None


def layer_plan(spec: ModelSpec, layer: int, moe_intermediate: int) -> LayerPlan:
    """Placements for every source tensor of decoder layer `layer` (routed experts merged, renames applied)."""
    table = table_for(spec)
    prefix = table.layer_prefix(layer)
    out: list[Placement] = []
    for info in table.layer_tensors(spec, layer):
        suffix = info.name[len(prefix) :]
        if m := _EXPERT.match(suffix):
            expert, proj = int(m.group(1)), m.group(2)
            if proj == "down_proj":
                out.append(Placement(info.name, "mlp.experts.down_proj", (expert,)))
            else:
                start = 0 if proj == "gate_proj" else moe_intermediate
                out.append(
                    Placement(info.name, "mlp.experts.gate_up_proj", (expert, slice(start, start + moe_intermediate)))
                )
        elif m := _CONV.match(suffix):
            width = info.shape[0]
            start = "qkv".index(m.group(1)) * width
            out.append(Placement(info.name, "self_attn.conv1d.weight", (slice(start, start + width),)))
        else:
            out.append(Placement(info.name, _rename(suffix)))
    return LayerPlan(layer, tuple(out))


def _rename(suffix: str) -> str:
    for pattern, repl in RENAMES:
        suffix = re.sub(pattern, repl, suffix)
    return suffix


def fp32_names(patterns: Iterable[str] | None) -> re.Pattern | None:
    """The regex transformers builds from `_keep_in_fp32_modules_strict` (globs, searched in the name)."""
    globs = sorted(patterns or [])
    return re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in globs)) if globs else None


class TensorSource(Protocol):
    """What filling a layer reads from a checkpoint: a source or artifact checkpoint, or the dummy one."""

    @property
    def directory(self) -> Path: ...

    def __contains__(self, name: str) -> bool: ...

    def read_tensor(self, name: str) -> torch.Tensor: ...

    def shard_of(self, name: str) -> str: ...


def check_finite(ckpt: TensorSource, name: str, tensor: torch.Tensor) -> None:
    """A NumericalError naming the file and the tensor when a floating tensor read from `ckpt` holds NaN or Inf
    (where it was placed: on the device when there is one)."""
    if not tensor.is_floating_point():
        return
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        raise NumericalError(
            f"{ckpt.directory / ckpt.shard_of(name)}: tensor {name} has {int((~finite).sum())} non-finite value(s) "
            f"(NaN/Inf) of {tensor.numel()}"
        )


def read_layer_state(
    ckpt: TensorSource,
    plan: LayerPlan,
    meta: Mapping[str, torch.Tensor],
    keep_fp32: re.Pattern | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The module state `plan` fills from `ckpt`: each tensor allocated once (fp32 where `keep_fp32` matches,
    else the dtype of `meta`'s entry) and filled from the source tensors placed into it; every entry of
    `meta` must be filled exactly, and with finite values (a NaN or Inf weight is named here, not later as
    non-finite activations or a router that disagrees with itself)."""
    targets = {p.target for p in plan.placements}
    if targets != set(meta):
        raise CheckpointFormatError(
            f"{ckpt.directory}: layer {plan.layer} tensors do not fill the transformers module: missing "
            f"{sorted(set(meta) - targets)[:5]}, unexpected {sorted(targets - set(meta))[:5]}"
        )
    state: dict[str, torch.Tensor] = {}
    for name, empty in meta.items():
        fp32 = keep_fp32 is not None and keep_fp32.search(name) is not None
        state[name] = torch.empty(empty.shape, dtype=torch.float32 if fp32 else empty.dtype, device=device)
    filled = dict.fromkeys(meta, 0)
    for p in plan.placements:
        if p.source not in ckpt:
            raise CheckpointFormatError(f"{ckpt.directory}: tensor {p.source} (layer {plan.layer}) is missing")
        value = ckpt.read_tensor(p.source)
        view = state[p.target][p.where] if p.where else state[p.target]
        if tuple(view.shape) != tuple(value.shape):
            raise CheckpointFormatError(
                f"{ckpt.directory}: tensor {p.source} has shape {list(value.shape)}, "
                f"expected {list(view.shape)} for {p.target}"
            )
        view.copy_(value)
        check_finite(ckpt, p.source, view)
        filled[p.target] += value.numel()
    short = [n for n, count in filled.items() if count != state[n].numel()]
    if short:
        raise CheckpointFormatError(f"{ckpt.directory}: layer {plan.layer} leaves {short[:3]} partly unfilled")
    return state


def layer_source_tensors(plan: LayerPlan, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `read_layer_state`: the checkpoint tensors (source names) a module state holds, each a copy
    of its placement's slice (merged experts split, renames undone); `state` must be exactly the plan's targets."""
    targets = {p.target for p in plan.placements}
    if targets != set(state):
        raise CheckpointFormatError(
            f"layer {plan.layer}: module state and tensor plan disagree: missing {sorted(targets - set(state))[:5]}, "
            f"unexpected {sorted(set(state) - targets)[:5]}"
        )
    out: dict[str, torch.Tensor] = {}
    covered = dict.fromkeys(state, 0)
    for p in plan.placements:
        value = state[p.target][p.where] if p.where else state[p.target]
        out[p.source] = value.detach().clone()
        covered[p.target] += value.numel()
    short = [n for n, count in covered.items() if count != state[n].numel()]
    if short:
        raise CheckpointFormatError(f"layer {plan.layer}: the plan leaves {short[:3]} partly unwritten")
    return out
