"""Tensor tables: every tensor a checkpoint of a supported architecture holds, derived from its config alone.

An architecture is data: groups of (name suffix, role, shape rule, dtype) that apply to a layer depending
on its kind. `source_tensors` enumerates a whole checkpoint; `classify` checks real names against it and
fails closed on unknown or missing names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from math import prod

from glmquant.arch.roles import TensorRole
from glmquant.arch.spec import ModelSpec, load_model_spec
from glmquant.errors import TensorCensusError

DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

ShapeRule = Callable[[ModelSpec], tuple[int, ...]]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a source checkpoint, with what it is."""

    name: str
    role: TensorRole
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None  # gate_proj / up_proj / down_proj for MLP-shaped tensors
    mtp: bool = False

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Template:
    """A tensor every matching module has: `suffix` is appended to the module's prefix."""

    suffix: str
    role: TensorRole
    shape: ShapeRule
    dtype: str = "BF16"
    proj: str | None = None


def mlp_group(role: TensorRole, width: Callable[[ModelSpec], int], prefix: str) -> tuple[Template, ...]:
    """gate/up/down projections of a SwiGLU MLP of intermediate `width`."""
    return (
        Template(f"{prefix}gate_proj.weight", role, lambda s: (width(s), s.hidden_size), proj="gate_proj"),
        Template(f"{prefix}up_proj.weight", role, lambda s: (width(s), s.hidden_size), proj="up_proj"),
        Template(f"{prefix}down_proj.weight", role, lambda s: (s.hidden_size, width(s)), proj="down_proj"),
    )


@dataclass(frozen=True)
class ArchitectureTable:
    """How to enumerate one architecture's checkpoint."""

    family: str
    text_prefix: str  # e.g. "model.language_model."
    top_level: Callable[[ModelSpec], list[TensorInfo]]  # embeddings, final norm, lm_head, vision tower
    layer_groups: Callable[[ModelSpec, int], Sequence[tuple[Template, ...]]]  # non-expert tensors of layer i

    def layer_prefix(self, layer: int) -> str:
        return f"{self.text_prefix}layers.{layer}."

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.experts.{expert}.{proj}.weight"

    def routed_experts(self, spec: ModelSpec, layer: int) -> list[TensorInfo]:
        mtp = layer >= spec.num_hidden_layers
        h, w = spec.hidden_size, spec.moe_intermediate_size
        shapes = {"gate_proj": (w, h), "up_proj": (w, h), "down_proj": (h, w)}
        return [
            TensorInfo(self.expert_name(layer, e, p), TensorRole.ROUTED_EXPERT, shapes[p], "BF16", layer, e, p, mtp)
            for e in range(spec.n_routed_experts)
            for p in PROJECTIONS
        ]

    def layer_tensors(self, spec: ModelSpec, layer: int) -> list[TensorInfo]:
        mtp = layer >= spec.num_hidden_layers
        prefix = self.layer_prefix(layer)
        out = [
            TensorInfo(
                prefix + t.suffix,
                TensorRole.MTP if mtp and t.role is TensorRole.MTP else t.role,
                t.shape(spec),
                t.dtype,
                layer,
                None,
                t.proj,
                mtp,
            )
            for group in self.layer_groups(spec, layer)
            for t in group
        ]
        if is_moe_layer(spec, layer):
            out += self.routed_experts(spec, layer)
        return out

    def source_tensors(self, spec: ModelSpec) -> list[TensorInfo]:
        """Every tensor of the source checkpoint, in a stable order (top level, then layer by layer)."""
        out = self.top_level(spec)
        for layer in range(spec.num_hidden_layers + spec.num_mtp_layers):
            out += self.layer_tensors(spec, layer)
        return out


def is_moe_layer(spec: ModelSpec, layer: int) -> bool:
    """MTP layers are full MoE decoder layers; decoder layers follow mlp_layer_types."""
    return layer >= spec.num_hidden_layers or spec.mlp_layer_types[layer] == "sparse"


_TABLES: dict[str, ArchitectureTable] = {}


def register(table: ArchitectureTable) -> ArchitectureTable:
    _TABLES[table.family] = table
    return table


def table_for(spec: ModelSpec) -> ArchitectureTable:
    from glmquant.arch import glm4_moe, glm5_next  # noqa: F401  (registers the tables)

    return _TABLES[spec.family]


def source_tensors(spec: ModelSpec) -> list[TensorInfo]:
    return table_for(spec).source_tensors(spec)


def classify(spec: ModelSpec, names: Iterable[str], *, allow_missing: bool = False) -> dict[str, TensorInfo]:
    """Map real tensor names to their info; unknown names (and missing ones, unless allowed) fail closed."""
    expected = {t.name: t for t in source_tensors(spec)}
    names = list(names)
    unknown = sorted(n for n in names if n not in expected)
    missing = [] if allow_missing else sorted(set(expected) - set(names))
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"{len(unknown)} unknown tensor name(s): {_preview(unknown)}")
        if missing:
            parts.append(f"{len(missing)} missing tensor name(s): {_preview(missing)}")
        raise TensorCensusError(
            f"checkpoint does not match its {spec.family} config: " + "; ".join(parts), unknown, missing
        )
    return {n: expected[n] for n in names}


def _preview(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")


__all__ = [
    "ArchitectureTable",
    "TensorInfo",
    "Template",
    "classify",
    "is_moe_layer",
    "load_model_spec",
    "mlp_group",
    "register",
    "source_tensors",
    "table_for",
]
