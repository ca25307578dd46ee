"""Artifact layouts: which output tensor goes into which file, predicted from a config alone.

The same plan drives `glmquant plan` (prediction) and the artifact writer (files on disk), so the two
cannot drift. Two layouts:
- `tr3`: every routed expert projection split into 4 rank slices (gate/up along the output dim, down along
  the input dim), each an independent EXL3 tensor; experts in `layer-LL-part-tail-{0,1}.safetensors` (even
  experts in part 0, odd in part 1); every other tensor in `retained-NNNNN-of-MMMMM.safetensors` named after
  the source shard that held it (without the source's index, the sharding it was saved with is predicted).
- `exllamav3`: one EXL3 tensor per expert projection; `model-NNNNN-of-MMMMM.safetensors` filled a whole
  module at a time up to a size cap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from typing import NamedTuple

from glmquant.arch import DTYPE_BYTES, PROJECTIONS, ModelSpec, TensorInfo, TensorRole, source_tensors, table_for
from glmquant.checkpoint.safetensors_format import TensorSpec, file_size
from glmquant.errors import UsageError

LAYOUTS = ("tr3", "exllamav3")
TR3_RANKS = 4
MARKER_PARTS = {"mcg": "mcg", "mul1": "mul1", "3inst": None}
EXL3_PARTS = ("trellis", "suh", "svh", "mcg", "mul1")  # every part an EXL3 tensor may store
SOURCE_SHARD_BYTES = 5 * 1024**3  # how the BF16 source was saved (see predicted_source_shards)
DEFAULT_EXL3_SHARD_BYTES = 8192 * 1024**2
_SOURCE_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def pad128(n: int) -> int:
    return -(-n // 128) * 128


@dataclass(frozen=True)
class ExpertSlice:
    """Which routed-expert weight an EXL3 part belongs to (rank None: the whole projection)."""

    layer: int
    expert: int  # expert index in the output (after pruning renumbering)
    source_expert: int  # expert index in the source checkpoint
    proj: str
    rank: int | None
    in_features: int
    out_features: int

    @property
    def key(self) -> str:
        """Output tensor prefix without the part suffix."""
        base = f"mlp.experts.{self.expert}.{self.proj}"
        return base if self.rank is None else f"{base}.rank{self.rank}"


# Roles whose 2-D `.weight` tensors in the decoder layers are linear layers that `encode --retained-bits` EXL3-encodes
# (the linears `observe --dense-hessians` captures). Norms, routers, embeddings, hyper-connections, the vision tower,
# the MTP layer and every F32 tensor stay exact; lm_head is encoded only with `--head-bits`.
QUANTIZABLE_RETAINED_ROLES = frozenset(
    {
        TensorRole.ATTENTION,
        TensorRole.MLA_ATTENTION,
        TensorRole.DSA_INDEXER,
        TensorRole.KDA_ATTENTION,
        TensorRole.SHARED_EXPERT,
        TensorRole.DENSE_MLP,
    }
)
RETAINED_BITS = range(2, 9)  # K of `--retained-bits` and `--head-bits` (4..6 is the intended speed tier)


@dataclass(frozen=True)
class RetainedLinear:
    """A linear layer outside the routed experts stored as one EXL3 tensor at K `bits` (`encode --retained-bits`
    for the decoder layers' linears, `--head-bits` for lm_head): its source weight, whose name without `.weight` is
    the EXL3 key, and its dimensions."""

    layer: int | None  # its decoder layer; None for lm_head, which reads the final norm's output after the last one
    source: str  # the source `.weight` tensor (HF orientation: out x in)
    in_features: int
    out_features: int
    bits: int
    role: TensorRole

    @classmethod
    def of(cls, info: TensorInfo, bits: int) -> RetainedLinear:
        return cls(info.layer, info.name, info.shape[1], info.shape[0], bits, info.role)

    @property
    def key(self) -> str:
        return self.source.removesuffix(".weight")

    @property
    def option(self) -> str:
        """The encode options that ask for it (errors name them)."""
        return "--head-bits" if self.layer is None else "--retained-bits/--retained-layer-bits"


def _bf16_matrix(t: TensorInfo) -> bool:
    """A linear's weight the EXL3 codec takes: a 2-D BF16 `.weight` (biases, norms and F32 tensors stay exact)."""
    return t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype == "BF16"


def quantizable_retained(spec: ModelSpec) -> list[TensorInfo]:
    """The source tensors `--retained-bits` encodes: 2-D BF16 `.weight`s of the decoder layers' attention, shared
    experts and dense MLPs, in source order."""
    return [
        t
        for t in source_tensors(spec)
        if t.role in QUANTIZABLE_RETAINED_ROLES
        and t.layer is not None
        and t.layer < spec.num_hidden_layers
        and _bf16_matrix(t)
    ]


def quantizable_mtp(spec: ModelSpec) -> list[TensorInfo]:
    """The MTP layer's linears a draft file encodes (`draft-head --mtp-bits`): the 2-D BF16 `.weight`s of its attention
    and shared expert, as the retained linears, and its `eh_proj`, in source order (its routed experts are encoded
    as experts)."""
    return [
        t
        for t in source_tensors(spec)
        if t.layer in spec.mtp_layers
        and (t.role in QUANTIZABLE_RETAINED_ROLES or t.role is TensorRole.MTP)
        and _bf16_matrix(t)
    ]


def quantizable_head(spec: ModelSpec) -> TensorInfo:
    """The source tensor `--head-bits` encodes: lm_head's 2-D BF16 weight. UsageError for a model whose head is tied
    to its embedding (there is no head weight of its own: encoding it would quantize the embedding too) or whose
    tensor table has no such weight (naming the lm_head tensors it has)."""
    if spec.tie_word_embeddings:
        raise UsageError(
            f"--head-bits: {spec.architecture} ties lm_head to the input embedding (tie_word_embeddings): the head "
            "is the embedding, which stays exact"
        )
    heads = [t for t in source_tensors(spec) if t.role is TensorRole.LM_HEAD]
    found = [t for t in heads if _bf16_matrix(t)]
    if len(found) != 1:
        named = ", ".join(f"{t.name} ({t.dtype} {list(t.shape)})" for t in heads) or "none"
        raise UsageError(
            f"--head-bits: {spec.architecture} has {len(found)} 2-D BF16 lm_head weights, not one, to encode "
            f"(its lm_head tensors: {named})"
        )
    return found[0]


def exl3_linears(
    spec: ModelSpec,
    retained_bits: int | None,
    head_bits: int | None,
    exact_layers: int = 0,
    layer_bits: Sequence[int | None] | None = None,
) -> dict[str, RetainedLinear]:
    """The linears outside the routed experts stored as EXL3, by source weight name: the retained linears at
    `retained_bits` but those of the first `exact_layers` decoder layers, or each decoder layer's at its entry of
    `layer_bits` (None: exact), and lm_head at `head_bits` (None: those stay exact)."""
    found: dict[str, RetainedLinear] = {}
    check_exact_layers(retained_bits, exact_layers, spec)
    check_layer_bits(retained_bits, exact_layers, layer_bits, spec)
    if retained_bits is not None:
        check_linear_bits("--retained-bits", retained_bits)
        layer_bits = [None] * exact_layers + [retained_bits] * (spec.num_hidden_layers - exact_layers)
    if layer_bits is not None:
        found.update(
            (t.name, RetainedLinear.of(t, k))
            for t in quantizable_retained(spec)
            if t.layer is not None and (k := layer_bits[t.layer]) is not None
        )
    if head_bits is not None:
        check_linear_bits("--head-bits", head_bits)
        head = quantizable_head(spec)
        found[head.name] = RetainedLinear.of(head, head_bits)
    return found


def check_exact_layers(retained_bits: int | None, exact_layers: int, spec: ModelSpec | None = None) -> None:
    """`--retained-exact-layers`: how many first decoder layers keep their retained linears exact while the rest
    are EXL3 (the first layers carry most of the speed tier's KL cost: docs/fidelity.md). UsageError unless it is
    0 or more, comes with --retained-bits and, given the model's `spec`, leaves at least one layer encoded."""
    if exact_layers < 0:
        raise UsageError(f"--retained-exact-layers must be 0 or more layers, got {exact_layers}")
    if exact_layers == 0:
        return
    if retained_bits is None:
        raise UsageError(
            "--retained-exact-layers keeps some of the --retained-bits linears exact: it needs --retained-bits"
        )
    if spec is not None and exact_layers >= spec.num_hidden_layers:
        raise UsageError(
            f"--retained-exact-layers must be 0..{spec.num_hidden_layers - 1} ({spec.architecture} has "
            f"{spec.num_hidden_layers} decoder layers), got {exact_layers}"
        )


def parse_layer_bits(text: str, option: str = "--retained-layer-bits") -> tuple[int | None, ...]:
    """`--retained-layer-bits K6,K6,exact,K4,...`: K of each decoder layer's retained linears, the first layer first
    (`exact`: that layer's stay exact); an entry `WxN` is width W for N layers in a row (`K5x11,K3x7,K2x27`: 45
    layers). `option` names another list of widths. UsageError naming the entry that is neither."""
    widths: list[int | None] = []
    for i, entry in enumerate(part.strip() for part in text.split(",")):
        name, count = entry, 1
        repeat = re.fullmatch(r"(.+?)[xX](\d+)", entry)
        if repeat is not None:
            name, count = repeat.group(1), int(repeat.group(2))
        try:
            width = width_of(name)
        except ValueError:
            raise UsageError(
                f"{option}: entry {i} ({entry!r}) is neither K<bits> nor exact, alone or as WxN for N layers "
                "(e.g. K6,K6,K3,exact or K5x11,K2x34)"
            ) from None
        if count < 1:
            raise UsageError(f"{option}: entry {i} ({entry!r}) repeats its width {count} times: N must be >= 1")
        widths += [width] * count
    return tuple(widths)


def width_name(bits: int | None) -> str:
    """A retained width as `--retained-layer-bits` names it: K<bits>, or exact (None)."""
    return "exact" if bits is None else f"K{bits}"


def width_of(name: str) -> int | None:
    """`width_name`'s inverse (K<bits> or exact, any case, spaces around allowed); ValueError for anything else."""
    name = name.strip()
    if name.lower() == "exact":
        return None
    match = re.fullmatch(r"[Kk](\d+)", name)
    if match is None:
        raise ValueError(f"{name!r} is neither K<bits> nor exact")
    return int(match.group(1))


def layer_bits_text(widths: Iterable[int | None]) -> str:
    """The `--retained-layer-bits` text of each decoder layer's K, the first layer first (`parse_layer_bits`'s
    inverse)."""
    return ",".join(width_name(k) for k in widths)


def check_layer_bits(
    retained_bits: int | None,
    exact_layers: int,
    layer_bits: Sequence[int | None] | None,
    spec: ModelSpec | None = None,
) -> None:
    """`--retained-layer-bits`: one entry per decoder layer (given the model's `spec`), each a K the codec takes for a
    linear or exact, at least one encoded; it replaces --retained-bits and --retained-exact-layers (UsageError)."""
    if layer_bits is None:
        return
    if retained_bits is not None or exact_layers:
        raise UsageError(
            "--retained-layer-bits names every layer's K: it replaces --retained-bits and --retained-exact-layers"
        )
    for i, k in enumerate(layer_bits):
        if k is not None:
            check_linear_bits(f"--retained-layer-bits entry {i}", k)
    if all(k is None for k in layer_bits):
        raise UsageError("--retained-layer-bits keeps every layer exact: name a K for at least one layer")
    if spec is not None and len(layer_bits) != spec.num_hidden_layers:
        raise UsageError(
            f"--retained-layer-bits names {len(layer_bits)} layers; {spec.architecture} has {spec.num_hidden_layers} "
            "decoder layers (one entry each, the first layer first)"
        )


def check_linear_bits(option: str, bits: int) -> None:
    """K of a linear outside the routed experts: what the codec accepts for one (UsageError naming the option)."""
    if bits not in RETAINED_BITS:
        hint = " (4..6 is the speed tier)" if option.startswith("--retained") else ""
        raise UsageError(f"{option} must be {RETAINED_BITS.start}..{RETAINED_BITS.stop - 1}{hint}, got {bits}")


class OutputTensor(NamedTuple):
    """One tensor of the artifact (a NamedTuple, like TensorSpec: a plan makes one per output tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    role: TensorRole
    source: str | None = None  # retained: the source tensor copied byte-for-byte
    rows: tuple[int, ...] | None = None  # retained with pruning: the source rows kept (router weight and bias)
    expert: ExpertSlice | None = None
    part: str | None = None  # trellis / suh / svh / mcg / mul1 for EXL3 parts
    linear: RetainedLinear | None = None  # EXL3 part of a retained linear (`--retained-bits`, `--head-bits`)

    @property
    def origin(self) -> str:
        """The source tensor this output comes from: the copied tensor, or the retained linear's weight (ValueError
        for a routed-expert EXL3 part)."""
        if self.linear is not None:
            return self.linear.source
        return self.source_name

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]

    @property
    def expert_slice(self) -> ExpertSlice:
        """The expert slice an EXL3 part belongs to (ValueError for a retained tensor, which has none)."""
        if self.expert is None:
            raise ValueError(f"{self.name} is not an EXL3 part: it belongs to no expert slice")
        return self.expert

    @property
    def source_name(self) -> str:
        """The source tensor a retained tensor copies (ValueError for an EXL3 part, which copies none)."""
        if self.source is None:
            raise ValueError(f"{self.name} is not a retained tensor: it copies no source tensor")
        return self.source


@dataclass(frozen=True)
class PlannedFile:
    path: str
    kind: str  # "expert" | "retained" | "model"
    tensors: tuple[OutputTensor, ...]
    layer: int | None = None
    gpu: int | None = None  # tr3 part number
    source_shard: str | None = None

    @cached_property
    def size(self) -> int:
        return file_size(self.tensors)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ArtifactPlan:
    spec: ModelSpec
    layout: str
    bits: int
    codebook: str
    files: tuple[PlannedFile, ...]
    kept_experts: Mapping[int, tuple[int, ...]] | None = field(default=None)
    # per quantized layer, the bits of each output expert (tiers); None: every expert has `bits`
    expert_bits: Mapping[int, tuple[int, ...]] | None = field(default=None)
    retained_bits: int | None = None  # K of the retained linears stored as EXL3 (None: all retained exact)
    head_bits: int | None = None  # K of lm_head stored as EXL3 (None: exact)
    retained_exact_layers: int = 0  # first decoder layers whose retained linears stay exact despite retained_bits
    # K of each decoder layer's retained linears (None: exact), instead of retained_bits and retained_exact_layers
    retained_layer_bits: tuple[int | None, ...] | None = None

    @property
    def quantized_layers(self) -> list[int]:
        return self.spec.moe_layers

    @property
    def retained_widths(self) -> str | None:
        """The retained linears' K for messages (K4; K4 after 2 exact layers; K6,K6,exact,... by layer); None: exact."""
        if self.retained_layer_bits is not None:
            return layer_bits_text(self.retained_layer_bits) + " by layer"
        if self.retained_bits is None:
            return None
        exact = f" after {self.retained_exact_layers} exact layers" if self.retained_exact_layers else ""
        return f"K{self.retained_bits}{exact}"

    def bits_of(self, layer: int, expert: int) -> int:
        """K of one output expert."""
        return self.bits if self.expert_bits is None else self.expert_bits[layer][expert]

    @property
    def tier_bits(self) -> tuple[int, ...]:
        """The bit widths the routed experts use, ascending."""
        return (
            (self.bits,)
            if self.expert_bits is None
            else tuple(sorted({b for v in self.expert_bits.values() for b in v}))
        )

    def expert_files(self, layer: int) -> list[PlannedFile]:
        """Files holding EXL3 parts of `layer` (an exllamav3-layout file may hold several layers)."""
        return [f for f in self.files if any(t.expert is not None and t.expert.layer == layer for t in f.tensors)]


def exl3_parts(slice_: ExpertSlice, prefix: str, bits: int, codebook: str) -> list[OutputTensor]:
    """The stored tensors of one EXL3 linear: trellis, suh, svh and the codebook marker."""
    i, o = pad128(slice_.in_features), pad128(slice_.out_features)
    name = prefix + slice_.key
    parts = [
        OutputTensor(
            f"{name}.trellis",
            "I16",
            (i // 16, o // 16, 16 * bits),
            TensorRole.ROUTED_EXPERT,
            expert=slice_,
            part="trellis",
        ),
        OutputTensor(f"{name}.suh", "F16", (i,), TensorRole.ROUTED_EXPERT, expert=slice_, part="suh"),
        OutputTensor(f"{name}.svh", "F16", (o,), TensorRole.ROUTED_EXPERT, expert=slice_, part="svh"),
    ]
    marker = MARKER_PARTS[codebook]
    if marker:
        parts.append(OutputTensor(f"{name}.{marker}", "I32", (), TensorRole.ROUTED_EXPERT, expert=slice_, part=marker))
    return parts


def expert_slices(spec: ModelSpec, layer: int, expert: int, source_expert: int, ranks: int | None) -> list[ExpertSlice]:
    """Rank slices (tr3) or whole projections (ranks None) of one expert, in file order."""
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    out = []
    for proj in PROJECTIONS:
        if ranks is None:
            i, o = (inter, h) if proj == "down_proj" else (h, inter)
            out.append(ExpertSlice(layer, expert, source_expert, proj, None, i, o))
            continue
        if inter % ranks:
            raise UsageError(f"moe_intermediate_size {inter} does not split into {ranks} rank slices")
        w = inter // ranks
        i, o = (w, h) if proj == "down_proj" else (h, w)
        out += [ExpertSlice(layer, expert, source_expert, proj, r, i, o) for r in range(ranks)]
    return out


def plan_artifact(
    spec: ModelSpec,
    layout: str,
    bits: int = 2,
    codebook: str = "mcg",
    source_shards: Mapping[str, str] | None = None,
    keep: Mapping[int, Sequence[int]] | None = None,
    shard_bytes: int | None = None,
    expert_bits: Mapping[int, Sequence[int]] | None = None,
    retained_bits: int | None = None,
    head_bits: int | None = None,
    retained_exact_layers: int = 0,
    retained_layer_bits: Sequence[int | None] | None = None,
) -> ArtifactPlan:
    """Every output file with its tensors. `source_shards` maps source tensor names to their shard file
    (default: `predicted_source_shards` with `shard_bytes`, tr3 only); `keep` maps a MoE layer (MTP included)
    to the source experts it keeps, in output order; `shard_bytes` caps an exllamav3 shard; `expert_bits` maps
    each quantized layer to the bits of its output experts (tiers; default `bits` for all); `retained_bits` stores the
    retained linears (`quantizable_retained`) but those of the first `retained_exact_layers` decoder layers (or each
    layer's at its `retained_layer_bits` entry), and `head_bits` lm_head, as EXL3 tensors of that K, in the files
    that would hold them exact."""
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if codebook not in MARKER_PARTS or not 1 <= bits <= 8:
        raise UsageError(f"bits must be 1..8 and codebook one of {sorted(MARKER_PARTS)}")
    kept = _kept_experts(spec, keep)
    tiers = _expert_bits(spec, kept, expert_bits)
    retained = _retained_tensors(spec, kept)
    ranks = TR3_RANKS if layout == "tr3" else None
    experts = {
        layer: _expert_parts(spec, layer, kept, tiers[layer] if tiers else (bits,) * len(kept[layer]), codebook, ranks)
        for layer in spec.moe_layers
    }
    linears = exl3_linears(spec, retained_bits, head_bits, retained_exact_layers, retained_layer_bits)
    retained = _encode_retained(retained, linears, codebook)
    if layout == "tr3":
        shards = source_shards or predicted_source_shards(spec, shard_bytes or SOURCE_SHARD_BYTES)
        files = _tr3_expert_files(experts) + _retained_files(retained, shards)
    else:
        files = _module_files(spec, retained, experts, shard_bytes or DEFAULT_EXL3_SHARD_BYTES)
    return ArtifactPlan(
        spec,
        layout,
        bits,
        codebook,
        tuple(sorted(files, key=lambda f: f.path)),
        {k: tuple(v) for k, v in kept.items()} if keep else None,
        tiers,
        retained_bits,
        head_bits,
        retained_exact_layers,
        None if retained_layer_bits is None else tuple(retained_layer_bits),
    )


def retained_linear_parts(linear: RetainedLinear, codebook: str) -> list[OutputTensor]:
    """The stored tensors of one retained linear as EXL3 at its K: trellis, suh, svh and the codebook marker."""
    i, o = pad128(linear.in_features), pad128(linear.out_features)
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {
        "trellis": ("I16", (i // 16, o // 16, 16 * linear.bits)),
        "suh": ("F16", (i,)),
        "svh": ("F16", (o,)),
    }
    marker = MARKER_PARTS[codebook]
    if marker:
        shapes[marker] = ("I32", ())
    return [
        OutputTensor(f"{linear.key}.{part}", dtype, shape, linear.role, part=part, linear=linear)
        for part, (dtype, shape) in shapes.items()
    ]


def _encode_retained(
    retained: list[OutputTensor], linears: Mapping[str, RetainedLinear], codebook: str
) -> list[OutputTensor]:
    """`retained` with each linear of `linears` (by source name) replaced by its EXL3 parts (same place in the
    order)."""
    out = []
    for t in retained:
        linear = linears.get(t.source) if t.source is not None and t.rows is None else None
        if linear is None:
            out.append(t)
            continue
        out += retained_linear_parts(linear, codebook)
    return out


def _expert_bits(
    spec: ModelSpec, kept: Mapping[int, tuple[int, ...]], expert_bits: Mapping[int, Sequence[int]] | None
) -> dict[int, tuple[int, ...]] | None:
    """Tiers checked against the plan: every quantized layer, one width of 1..8 per kept expert; None if uniform."""
    if expert_bits is None:
        return None
    if sorted(expert_bits) != spec.moe_layers:
        raise UsageError(f"tiers name layers {sorted(expert_bits)}, the quantized layers are {spec.moe_layers}")
    for layer, bits in expert_bits.items():
        if len(bits) != len(kept[layer]) or not all(1 <= b <= 8 for b in bits):
            raise UsageError(f"tiers of layer {layer} must give 1..8 bits to each of its {len(kept[layer])} experts")
    return {layer: tuple(expert_bits[layer]) for layer in spec.moe_layers}


def _kept_experts(spec: ModelSpec, keep: Mapping[int, Sequence[int]] | None) -> dict[int, tuple[int, ...]]:
    layers = spec.moe_layers + spec.mtp_layers
    if not keep:
        return {layer: tuple(range(spec.n_routed_experts)) for layer in layers}
    counts = {len(v) for v in keep.values()}
    if set(keep) != set(layers) or len(counts) != 1:
        raise UsageError(f"a pruning plan must keep the same number of experts in every MoE layer {layers}")
    for layer, experts in keep.items():
        if len(set(experts)) != len(experts) or not all(0 <= e < spec.n_routed_experts for e in experts):
            raise UsageError(f"pruning plan for layer {layer} has duplicate or out-of-range experts")
    return {layer: tuple(keep[layer]) for layer in layers}


def _retained_tensors(spec: ModelSpec, kept: Mapping[int, tuple[int, ...]]) -> list[OutputTensor]:
    """Every source tensor that is not a quantized routed expert, renamed and row-sliced where pruned."""
    table = table_for(spec)
    quantized = set(spec.moe_layers)
    out = []
    for t in source_tensors(spec):
        if t.role is TensorRole.ROUTED_EXPERT:
            assert (
                t.layer is not None and t.expert is not None and t.proj is not None
            )  # the table sets them for experts
            if t.layer in quantized:
                continue
            new_id = kept[t.layer].index(t.expert) if t.expert in kept[t.layer] else None
            if new_id is not None:
                out.append(OutputTensor(table.expert_name(t.layer, new_id, t.proj), t.dtype, t.shape, t.role, t.name))
            continue
        router = t.role in (TensorRole.ROUTER_WEIGHT, TensorRole.ROUTER_BIAS)
        if router and t.layer is not None and len(kept[t.layer]) != spec.n_routed_experts:
            rows = kept[t.layer]
            out.append(OutputTensor(t.name, t.dtype, (len(rows), *t.shape[1:]), t.role, t.name, rows))
            continue
        out.append(OutputTensor(t.name, t.dtype, t.shape, t.role, t.name))
    return out


def _expert_parts(
    spec: ModelSpec,
    layer: int,
    kept: Mapping[int, tuple[int, ...]],
    bits: Sequence[int],
    codebook: str,
    ranks: int | None,
) -> dict[int, list[OutputTensor]]:
    prefix = table_for(spec).layer_prefix(layer)
    return {
        new_id: [
            part
            for s in expert_slices(spec, layer, new_id, src, ranks)
            for part in exl3_parts(s, prefix, bits[new_id], codebook)
        ]
        for new_id, src in enumerate(kept[layer])
    }


def _tr3_expert_files(experts: Mapping[int, Mapping[int, list[OutputTensor]]]) -> list[PlannedFile]:
    files = []
    for layer, by_expert in experts.items():
        for part in (0, 1):
            tensors = tuple(t for e, parts in by_expert.items() if e % 2 == part for t in parts)
            files.append(PlannedFile(f"layer-{layer:02d}-part-tail-{part}.safetensors", "expert", tensors, layer, part))
    return files


def predicted_source_shards(spec: ModelSpec, shard_bytes: int = SOURCE_SHARD_BYTES) -> dict[str, str]:
    """tensor name -> shard file, as the BF16 source was saved: names sorted, a new shard whenever the next
    tensor would take the current one past `shard_bytes` (5 GiB reproduces GLM-5.3-Flash-BF16's 120 shards)."""
    shards: list[list[str]] = [[]]
    size = 0
    for t in sorted(source_tensors(spec), key=lambda t: t.name):
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t.name)
        size += t.nbytes
    return {
        name: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, names in enumerate(shards, 1) for name in names
    }


def _retained_files(retained: list[OutputTensor], source_shards: Mapping[str, str]) -> list[PlannedFile]:
    """Group retained tensors by the source shard that held them."""
    missing = [t.origin for t in retained if t.origin not in source_shards]
    if missing:
        raise UsageError(f"source index lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    groups: dict[str, list[OutputTensor]] = {}
    for t in retained:
        groups.setdefault(source_shards[t.origin], []).append(t)
    names = _retained_names(sorted(set(source_shards.values())))
    return [PlannedFile(names[shard], "retained", tuple(ts), source_shard=shard) for shard, ts in groups.items()]


def _retained_names(shards: list[str]) -> dict[str, str]:
    matches = [m for s in shards if (m := _SOURCE_SHARD.match(s))]
    if len(matches) == len(shards):
        return {s: f"retained-{m.group(1)}-of-{m.group(2)}.safetensors" for s, m in zip(shards, matches)}
    return {s: f"retained-{i:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards, 1)}


def _module_key(spec: ModelSpec, t: OutputTensor) -> tuple[int, int, str]:
    """Model order of ExLlamaV3 modules: embedding, vision, (attention, mlp) per layer, norm, head, MTP."""
    n = spec.num_hidden_layers
    if t.role is TensorRole.VISION:
        return (1, 0, "vision")
    if t.role is TensorRole.EMBEDDING:
        return (0, 0, "embed")
    m = re.search(r"\.layers\.(\d+)\.(mlp\.)?", t.name)
    if m is None:
        return (3, 0, "norm") if t.role is TensorRole.NORM else (4, 0, "head")
    layer = int(m.group(1))
    return (2 if layer < n else 5, layer, "mlp" if m.group(2) else "attn")


def _module_files(
    spec: ModelSpec, retained: list[OutputTensor], experts: Mapping[int, Mapping[int, list[OutputTensor]]], cap: int
) -> list[PlannedFile]:
    modules: dict[tuple[int, int, str], list[OutputTensor]] = {}
    for t in retained + [p for by_e in experts.values() for parts in by_e.values() for p in parts]:
        modules.setdefault(_module_key(spec, t), []).append(t)
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for key in sorted(modules):
        nbytes = sum(t.spec.nbytes for t in modules[key])
        if shards[-1] and size + nbytes > cap:
            shards.append([])
            size = 0
        shards[-1] += modules[key]
        size += nbytes
    return [
        PlannedFile(f"model-{i:05d}-of-{len(shards):05d}.safetensors", "model", tuple(ts), layer=_single_layer(ts))
        for i, ts in enumerate(shards, 1)
    ]


def _single_layer(tensors: Sequence[OutputTensor]) -> int | None:
    layers = {t.expert.layer for t in tensors if t.expert}
    return layers.pop() if len(layers) == 1 else None
