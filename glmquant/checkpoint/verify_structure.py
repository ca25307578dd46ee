"""The verifier's structural checks, from headers, the index and the config (no tensor data is read):
index closure, no original routed weights for quantized layers, well-formed EXL3 groups, config geometry and
quantization block against the files, retained tensor and byte totals."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmquant.arch import ModelSpec, load_model_spec, table_for
from glmquant.checkpoint.artifact_config import (
    HEAD_BITS_KEY,
    K1_TIER_KEY,
    LAYER_TIERS_KEY,
    LINEAR_BITS_KEYS,
    TR3_KEYS,
    TR3_TIER_KEYS,
    UNQUANTIZED_BITS,
    DeclaredLinearBits,
    declared_linear_bits,
    tensor_storage,
)
from glmquant.checkpoint.exl3_groups import Exl3Group, exl3_groups, is_exl3_tensor
from glmquant.checkpoint.index import INDEX_NAME, read_index
from glmquant.checkpoint.layouts import TR3_RANKS, exl3_linears, exl3_parts, expert_slices, retained_linear_parts
from glmquant.checkpoint.manifest import (
    ROUTED_EXPERT_KEY,
    geometry,
    retained_manifest_sha256,
    routed_bpw_of,
    written_by_glmquant,
)
from glmquant.checkpoint.manifest_schema import entry_kind
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tiers import tier_bitmap_sha256, tier_counts, tiers_by_layer, tiers_differ_by_layer
from glmquant.checkpoint.verify_report import ArtifactState, CheckResult, check
from glmquant.errors import GlmquantError

_ROUTED_WEIGHT = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_EXPERT_KEY = ROUTED_EXPERT_KEY


@dataclass(frozen=True)
class Structure:
    """Everything the structural checks compare, read once."""

    files: Mapping[str, list[TensorSpec]]  # weight file -> its header's tensors
    groups: Mapping[str, Exl3Group]
    layout: Mapping[str, Any]
    config: Mapping[str, Any] | None
    spec: ModelSpec | None
    config_error: str | None

    @classmethod
    def read(cls, state: ArtifactState) -> Structure:
        files = {path: header.specs for path, header in state.headers.items()}
        groups = exl3_groups(s for specs in files.values() for s in specs)
        declared = state.manifest.get("layout")
        layout = declared if isinstance(declared, dict) else {}
        try:
            config = json.loads((state.root / "config.json").read_text(encoding="utf-8"))
            return cls(files, groups, layout, config, load_model_spec(config), None)
        except (OSError, ValueError, GlmquantError) as exc:
            return cls(files, groups, layout, None, None, f"config.json: {exc}")

    @property
    def quantized_layers(self) -> list[int]:
        return self.spec.moe_layers if self.spec else list(self.layout.get("quantized_layers", []))

    @property
    def linear_bits(self) -> DeclaredLinearBits:
        """The EXL3 linears outside the routed experts the manifest's layout records (none: they are exact);
        ValueError or TypeError for values of the wrong type."""
        return declared_linear_bits(self.layout)

    def quantization(self, key: str, default: Any = None) -> Any:
        """A quantization fact (bits, codebook) from the manifest's layout, else from the config's block (the
        release's manifest leaves them to the config)."""
        if key in self.layout:
            return self.layout[key]
        qc = self.config.get("quantization_config") if self.config else None
        return qc.get(key, default) if isinstance(qc, dict) else default


def structure_checks(state: ArtifactState) -> list[CheckResult]:
    s = Structure.read(state)
    n_tensors = sum(len(v) for v in s.files.values())
    return [
        check("index closure", _index_problems(state, s), f"{n_tensors:,} tensors, each in exactly one file"),
        check(
            "no routed .weight names",
            _routed_weight_problems(s),
            f"none for quantized layers {_span(s.quantized_layers)}",
        ),
        check("exl3 tensors", _exl3_problems(s), f"{len(s.groups):,} EXL3 tensors well-formed"),
        check("config geometry", _config_problems(state, s), "config, quantization block and files agree"),
        check(
            "retained totals",
            _retained_problems(state, s),
            "retained tensor and byte totals match"
            + (
                ""
                if written_by_glmquant(state.manifest)
                else " (retained_manifest_sha256 not recomputed: how this manifest's writer hashed it is not published)"
            ),
        ),
    ]


def _index_problems(state: ArtifactState, s: Structure) -> list[str]:
    problems = list(state.header_errors)
    try:
        index = read_index(state.root / INDEX_NAME)
    except GlmquantError as exc:
        return problems + [str(exc)]
    owners: dict[str, list[str]] = {}
    for path, specs in s.files.items():
        for spec in specs:
            owners.setdefault(spec.name, []).append(path)
    listed = {e["path"] for e in state.weight_entries}
    for name, shard in index.weight_map.items():
        holders = owners.get(name, [])
        if shard not in listed:
            problems.append(f"{INDEX_NAME} maps {name} to {shard}, which the manifest does not list")
        elif holders and shard not in holders:
            problems.append(f"{INDEX_NAME} maps {name} to {shard}, but it is in {holders[0]}")
        if not holders:
            problems.append(f"{INDEX_NAME} lists {name} but no file header has it")
    problems += [
        f"{name} is in {len(paths)} file headers: {', '.join(paths)}"
        for name, paths in owners.items()
        if len(paths) > 1
    ]
    problems += [
        f"{name} (in {paths[0]}) is missing from {INDEX_NAME}"
        for name, paths in owners.items()
        if name not in index.weight_map
    ]
    count = state.manifest.get("indexed_tensor_count")
    if len(index.weight_map) != count:
        problems.append(f"{INDEX_NAME} has {len(index.weight_map):,} tensors, manifest says {count}")
    data = sum(spec.nbytes for specs in s.files.values() for spec in specs)
    if index.total_size != data:
        problems.append(f"{INDEX_NAME} total_size {index.total_size:,} != {data:,} tensor bytes in the files")
    return problems


def _routed_weight_problems(s: Structure) -> list[str]:
    quantized = set(s.quantized_layers)
    return [
        f"{t.name} ({path}): original routed weight of quantized layer {m.group(1)}"
        for path, specs in s.files.items()
        for t in specs
        if (m := _ROUTED_WEIGHT.search(t.name)) and int(m.group(1)) in quantized
    ]


def _exl3_problems(s: Structure) -> list[str]:
    codebook = str(s.quantization("codebook", "mcg"))
    problems = [p for g in s.groups.values() for p in g.problems(codebook)]
    if not s.groups and s.quantized_layers:
        problems.append("no EXL3 tensors found, but the model has quantized MoE layers")
    return problems


def expected_exl3(
    spec: ModelSpec,
    layout_type: str,
    bits: int,
    codebook: str,
    expert_bits: Mapping[int, Sequence[int]] | None = None,
    retained_bits: int | None = None,
    head_bits: int | None = None,
    retained_exact_layers: int = 0,
    retained_layer_bits: Sequence[int | None] | None = None,
) -> dict[str, TensorSpec]:
    """Every EXL3 part the config implies: quantized layers x routed experts x projections (x rank slices), each
    expert at its tier's K when `expert_bits` gives them; with `retained_bits`, also every retained linear after the
    first `retained_exact_layers` decoder layers (or each layer's at its `retained_layer_bits` K), and with
    `head_bits` lm_head."""
    ranks = TR3_RANKS if layout_type == "tr3" else None
    table = table_for(spec)
    expected = {
        t.name: t.spec
        for layer in spec.moe_layers
        for e in range(spec.n_routed_experts)
        for sl in expert_slices(spec, layer, e, e, ranks)
        for t in exl3_parts(sl, table.layer_prefix(layer), expert_bits[layer][e] if expert_bits else bits, codebook)
    }
    for linear in exl3_linears(spec, retained_bits, head_bits, retained_exact_layers, retained_layer_bits).values():
        expected.update((t.name, t.spec) for t in retained_linear_parts(linear, codebook))
    return expected


def files_expert_bits(s: Structure, spec: ModelSpec) -> tuple[dict[int, tuple[int, ...]], list[str]]:
    """K of every routed expert of the quantized layers, read from its trellis shapes (an expert with no EXL3
    tensor counts at the block's bits, and is reported missing elsewhere); problems for experts whose tensors
    disagree on K."""
    found: dict[tuple[int, int], set[int]] = {}
    for key, group in s.groups.items():
        m = _EXPERT_KEY.search(key + ".")
        if m and group.bits is not None:
            found.setdefault((int(m[1]), int(m[2])), set()).add(group.bits)
    base = int(s.quantization("bits", 0) or 0)
    problems = [
        f"layer {layer} expert {e}: its EXL3 tensors mix K {sorted(k)}" for (layer, e), k in found.items() if len(k) > 1
    ]
    bits = {
        layer: tuple(min(found.get((layer, e), {base})) for e in range(spec.n_routed_experts))
        for layer in spec.moe_layers
    }
    return bits, problems


def _config_problems(state: ArtifactState, s: Structure) -> list[str]:
    if s.spec is None or s.config is None:
        return [s.config_error or "config.json unreadable"]
    spec, stated = s.spec, state.manifest.get("geometry")  # geometry and quantized_layers: glmquant's manifests
    stated = stated if isinstance(stated, dict) else None
    problems = (
        [
            f"geometry {k}: config {v}, manifest {stated.get(k)}"
            for k, v in geometry(spec, spec.n_routed_experts).items()
            if stated.get(k) != v
        ]
        if stated
        else []
    )
    if "quantized_layers" in s.layout and spec.moe_layers != list(s.layout["quantized_layers"]):
        problems.append(f"config's MoE layers {_span(spec.moe_layers)} != manifest's quantized layers")
    expert_bits, mixed = files_expert_bits(s, spec)
    problems += mixed + _tier_bitmap_problems(state, expert_bits)
    try:
        linears = s.linear_bits
        expected = expected_exl3(
            spec,
            str(s.layout.get("type")),
            int(s.quantization("bits", 0)),
            str(s.quantization("codebook")),
            expert_bits,
            linears.retained_bits,
            linears.head_bits,
            linears.retained_exact_layers,
            linears.retained_layer_bits,
        )
    except (GlmquantError, KeyError, ValueError, TypeError) as exc:
        return problems + [f"cannot derive the expected EXL3 tensors: {exc}"]
    actual = {p.name: p for g in s.groups.values() for p in g.parts.values()}
    problems += [f"{n}: expected by the config, missing from the files" for n in sorted(set(expected) - set(actual))]
    problems += [f"{n}: EXL3 tensor the config does not call for" for n in sorted(set(actual) - set(expected))]
    problems += [
        f"{n}: {actual[n].dtype} {list(actual[n].shape)}, config implies {e.dtype} {list(e.shape)}"
        for n, e in expected.items()
        if n in actual and actual[n] != e
    ]
    problems += _router_problems(s, spec)
    return problems + _block_problems(state, s, spec, expert_bits)


def _tier_bitmap_problems(state: ArtifactState, expert_bits: Mapping[int, Sequence[int]]) -> list[str]:
    """A glmquant manifest's `tier_bitmap_sha256` against the experts' K in the files (null: one K for all)."""
    if not written_by_glmquant(state.manifest) or not expert_bits:
        return []
    recorded = state.manifest.get("tier_bitmap_sha256")
    mixed = len({b for bits in expert_bits.values() for b in bits}) > 1
    if recorded is None:
        return (
            ["the routed experts have several bit widths but the manifest has no tier_bitmap_sha256"] if mixed else []
        )
    actual = tier_bitmap_sha256(expert_bits)
    return [] if recorded == actual else [f"manifest tier_bitmap_sha256 {recorded} != {actual} from the files"]


def _router_problems(s: Structure, spec: ModelSpec) -> list[str]:
    table = table_for(spec)
    routers = {table.layer_prefix(layer) + "mlp.gate.weight" for layer in spec.moe_layers + spec.mtp_layers}
    return [
        f"{t.name}: {t.shape[0]} router rows, config has {spec.n_routed_experts} experts"
        for specs in s.files.values()
        for t in specs
        if t.name in routers and t.shape[0] != spec.n_routed_experts
    ]


def _block_problems(
    state: ArtifactState, s: Structure, spec: ModelSpec, expert_bits: Mapping[int, Sequence[int]]
) -> list[str]:
    """The quantization block against the layout and the files; quantization_config.json against the block."""
    qc = s.config.get("quantization_config") if s.config else None
    if not isinstance(qc, dict):
        return ["config.json has no quantization_config block"]
    expect = {"quant_method": "exl3", "codebook": s.quantization("codebook")}
    problems = [
        f"quantization_config.{k} is {qc.get(k)!r}, expected {v!r}" for k, v in expect.items() if qc.get(k) != v
    ]
    bpw = routed_bpw_of(s.groups, spec.hidden_size, spec.moe_intermediate_size)
    recorded = state.manifest.get("effective_routed_tier_bpw")
    if recorded != bpw:
        problems.append(f"manifest effective_routed_tier_bpw {recorded} != {bpw} from the files")
    try:
        qjson = json.loads((state.root / "quantization_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return problems + [f"quantization_config.json: {exc}"]
    if s.layout.get("type") == "tr3":
        return problems + _tr3_block_problems(qc, qjson, s, expert_bits, bpw)
    return problems + _exllamav3_block_problems(qc, qjson, s)


def _tr3_block_problems(
    qc: Mapping[str, Any], qjson: Any, s: Structure, expert_bits: Mapping[int, Sequence[int]], bpw: float
) -> list[str]:
    problems = []
    counts = tier_counts(expert_bits)
    by_layer = {LAYER_TIERS_KEY: tiers_by_layer(expert_bits)} if tiers_differ_by_layer(expert_bits) else {}
    linear_bits = {k: s.layout[k] for k in LINEAR_BITS_KEYS if k in s.layout}
    keys = TR3_KEYS | ({K1_TIER_KEY} if 1 in counts else set()) | set(linear_bits) | set(by_layer)
    if set(qc) != keys:
        problems.append(
            f"quantization_config keys differ from the tr3 block: missing {sorted(keys - set(qc))}, "
            f"extra {sorted(set(qc) - keys)}"
        )
    problems += [f"K{b} routed experts: the tr3 layout's tiers are K1 to K4" for b in counts if b not in TR3_TIER_KEYS]
    expect = {
        "bits": s.quantization("bits"),
        "archive_tensor_parallel_size": TR3_RANKS,
        "rank_stacked_tp": TR3_RANKS,
        "effective_routed_tier_bpw": bpw,
        **{key: counts.get(b, 0) for b, key in TR3_TIER_KEYS.items() if key in keys},
        **linear_bits,
        **by_layer,
    }
    problems += [
        f"quantization_config.{k} is {qc.get(k)!r}, files imply {v!r}" for k, v in expect.items() if qc.get(k) != v
    ]
    if qjson != qc:
        problems.append("quantization_config.json differs from config.json's quantization_config")
    return problems


def _exllamav3_block_problems(qc: Mapping[str, Any], qjson: Any, s: Structure) -> list[str]:
    missing = [k for k in ("quant_method", "version", "bits", HEAD_BITS_KEY, "codebook") if k not in qc]
    problems = [f"quantization_config lacks ExLlamaV3 key(s) {missing}"] if missing else []
    head_bits = s.linear_bits.head_bits or UNQUANTIZED_BITS
    if HEAD_BITS_KEY in qc and qc[HEAD_BITS_KEY] != head_bits:
        problems.append(f"quantization_config.{HEAD_BITS_KEY} is {qc[HEAD_BITS_KEY]!r}, files imply {head_bits!r}")
    if not isinstance(qjson, dict) or {k: v for k, v in qjson.items() if k != "tensor_storage"} != qc:
        return problems + ["quantization_config.json differs from config.json's quantization_config"]
    if qjson.get("tensor_storage") != tensor_storage(t for specs in s.files.values() for t in specs):
        problems.append("quantization_config.json tensor_storage does not match the files' headers")
    return problems


def _retained_problems(state: ArtifactState, s: Structure) -> list[str]:
    problems: list[str] = []
    retained: list[tuple[str, TensorSpec]] = []
    for entry in state.weight_entries:
        path, specs = entry["path"], s.files.get(entry["path"])
        if specs is None:
            continue
        kept = [t for t in specs if not is_exl3_tensor(t.name, s.groups)]
        retained += [(path, t) for t in kept]
        experts = {m.groups() for t in specs if is_exl3_tensor(t.name, s.groups) and (m := _EXPERT_KEY.search(t.name))}
        facts = {
            "tensor_count": len(specs),
            "tensor_bytes": sum(t.nbytes for t in specs),
            "logical_expert_count": len(experts),
            "retained_tensor_count": len(kept),
            "retained_tensor_bytes": sum(t.nbytes for t in kept),
        }
        kind = entry_kind(entry)
        if kind == "expert" and kept:
            problems.append(f"{path}: {len(kept)} non-EXL3 tensor(s) in an expert file, e.g. {kept[0].name}")
        linears = {t.name.rpartition(".")[0] for t in specs if is_exl3_tensor(t.name, s.groups)}
        if kind == "retained" and len(kept) != len(specs) and "exl3_linear_count" not in entry:
            problems.append(f"{path}: {len(specs) - len(kept)} EXL3 tensor(s) in a retained file")
        if kind == "retained" and experts:
            problems.append(f"{path}: routed-expert EXL3 tensors in a retained file")
        if kind == "retained" and "exl3_linear_count" in entry:
            facts["exl3_linear_count"] = len(linears)
        problems += [
            f"{path}: manifest {k} {entry[k]}, file has {v}" for k, v in facts.items() if k in entry and entry[k] != v
        ]
    if len(s.files) != len(state.weight_entries):  # totals are only meaningful when every header was read
        return problems
    manifest = state.manifest
    totals: dict[str, int | str] = {
        "retained_tensor_count": len(retained),
        "retained_tensor_bytes": sum(t.nbytes for _, t in retained),
    }
    if written_by_glmquant(manifest):  # the release does not publish how it hashed its retained tensor list
        totals["retained_manifest_sha256"] = retained_manifest_sha256(retained)
    return problems + [
        f"manifest {k} {manifest.get(k)}, files give {v}"
        for k, v in totals.items()
        if k in manifest and manifest[k] != v
    ]


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "(none)"
