"""The artifact's `config.json` and `quantization_config.json`, for both layouts.

tr3 writes exactly the keys of the reference release's block (`../shared/reference/glm-5.3-flash`);
exllamav3 writes what ExLlamaV3 1.6.5's converter writes (`conversion/compile.py`: quant_method, version,
bits, head_bits, calibration, out_scales, codebook; `quant_config.py`: per-module `tensor_storage`).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from glmquant.arch.spec import text_block
from glmquant.checkpoint.exl3_groups import MARKER_MULTIPLIERS, exl3_groups
from glmquant.checkpoint.layouts import ArtifactPlan
from glmquant.checkpoint.provenance import Provenance
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import TORCH_DTYPES
from glmquant.checkpoint.tiers import mean_bits, tier_counts, tiers_by_layer, tiers_differ_by_layer
from glmquant.checkpoint.writer import atomic_file
from glmquant.errors import UsageError

TR3_FORMAT = "glm53-brandon-style-k2-k3-tail-k4-retained-v1"
RELEASE_TIER_KEYS = {2: "k2_experts_per_layer", 3: "k3_experts_per_layer", 4: "k4_retained_experts_per_layer"}
K1_TIER_KEY = "k1_experts_per_layer"  # glmquant's, written only when a K1 tier is used (the release has none)
# glmquant's, written only when tiers differ by layer (`--tiers depth:...`, `share:...`, `layers:...`):
# {"<layer>": {"k<K>": experts}}; the k<K>_experts_per_layer keys then hold null for a K whose count differs between
# layers
LAYER_TIERS_KEY = "tier_experts_by_layer"
TR3_TIER_KEYS = {1: K1_TIER_KEY, **RELEASE_TIER_KEYS}
RETAINED_BITS_KEY = (
    "retained_bits"  # glmquant's, written only with `encode --retained-bits`: K of the EXL3 retained linears
)
# glmquant's, written only with `encode --retained-exact-layers`: the first decoder layers whose retained linears stay
# exact beside the EXL3 ones
RETAINED_EXACT_LAYERS_KEY = "retained_exact_layers"
# glmquant's, written only with `encode --retained-layer-bits`: K of each decoder layer's retained linears (null: exact)
RETAINED_LAYER_BITS_KEY = "retained_layer_bits"
# K of an EXL3 lm_head (`encode --head-bits`): ExLlamaV3's own key, in its block always (UNQUANTIZED_BITS for an exact
# head); in the tr3 block glmquant's, written only with --head-bits
HEAD_BITS_KEY = "head_bits"
TR3_TIER_BITS = tuple(TR3_TIER_KEYS)
TR3_KEYS = frozenset(
    {
        "archive_tensor_parallel_size",
        "bits",
        "codebook",
        "effective_routed_tier_bpw",
        "format",
        "quant_method",
        "rank_stacked_tp",
        "raw_private_content_included",
        "requires_custom_loader",
        "runtime_tensor_parallel_size",
        "selection",
        "session_calibration_manifest_sha256",
        "session_calibration_tokens_sha256",
        "session_calibration_verification_sha256",
        "source_manifest_sha256",
        "tail_experts_per_layer",
        "target_routed_tier_bpw",
        *RELEASE_TIER_KEYS.values(),
    }
)
EXLLAMAV3_VERSION = "1.6.5"  # the converter whose output format the exllamav3 layout reproduces
SMALL_FILE_LIMIT = 64 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
# files the artifact writes itself; a source that has them (a re-quantization) must not overwrite ours
NOT_COPIED = frozenset({"config.json", "quantization_config.json", "EXL3_MANIFEST.json", "MODEL_CARD.md"})
UNQUANTIZED_BITS = 16  # ExLlamaV3's value for "stored unquantized" (the MTP layer, and the head without --head-bits)


def routed_tier_bpw(trellis_bytes: int, projections: int, hidden: int, moe_inter: int) -> float:
    """Stored trellis bits per routed weight (above K only when padding to 128 adds rows or columns)."""
    weights = projections * hidden * moe_inter
    return round(8 * trellis_bytes / weights, 4) if weights else 0.0


def plan_routed_bpw(plan: ArtifactPlan) -> float:
    trellis = [t for f in plan.files for t in f.tensors if t.part == "trellis" and t.expert is not None]
    projections = {(t.expert.layer, t.expert.expert, t.expert.proj) for t in trellis if t.expert}
    return routed_tier_bpw(
        sum(t.spec.nbytes for t in trellis), len(projections), plan.spec.hidden_size, plan.spec.moe_intermediate_size
    )


def experts_per_layer(plan: ArtifactPlan) -> int:
    kept = plan.kept_experts
    return len(next(iter(kept.values()))) if kept else plan.spec.n_routed_experts


def plan_tier_counts(plan: ArtifactPlan) -> dict[int, int | None]:
    """Experts per bit width in every quantized layer (None: the count differs between layers)."""
    return tier_counts(plan.expert_bits) if plan.expert_bits else {plan.bits: experts_per_layer(plan)}


def target_bits(plan: ArtifactPlan) -> float:
    """The routed experts' mean bits per weight as planned (K, or the tiers' mean)."""
    return round(mean_bits(plan.expert_bits), 4) if plan.expert_bits else float(plan.bits)


def selection_text(counts: Mapping[int, int | None]) -> str:
    """The block's `selection`: how the experts of a layer are split over bit widths."""
    if len(counts) == 1:
        return f"all routed experts use K{next(iter(counts))}"
    if None in counts.values():
        return f"per-layer tiers ({LAYER_TIERS_KEY}): " + ", ".join(f"K{b}" for b in sorted(counts, reverse=True))
    return "per-expert tiers by REAP saliency: " + ", ".join(
        f"K{b} for {n}" for b, n in sorted(counts.items(), reverse=True)
    )


def quantization_block(plan: ArtifactPlan, provenance: Provenance) -> dict[str, Any]:
    """The `quantization_config` of config.json for the plan's layout."""
    if plan.layout == "tr3":
        return _tr3_block(plan, provenance)
    block: dict[str, Any] = {
        "quant_method": "exl3",
        "version": EXLLAMAV3_VERSION,
        "bits": round(target_bits(plan), 2),
        HEAD_BITS_KEY: plan.head_bits or UNQUANTIZED_BITS,
    }
    cal = provenance.calibration
    if cal.rows is not None and cal.cols is not None:
        block["calibration"] = {"rows": cal.rows, "cols": cal.cols}
    block["out_scales"] = provenance.method.out_scales
    block["codebook"] = plan.codebook
    if plan.spec.mtp_layers:
        block["mtp_bits"] = UNQUANTIZED_BITS
    return block


def _tr3_block(plan: ArtifactPlan, provenance: Provenance) -> dict[str, Any]:
    counts = plan_tier_counts(plan)
    if not set(counts) <= set(TR3_TIER_KEYS):
        raise UsageError(f"the tr3 layout has K1 to K4 tiers only; got K{sorted(counts)}")
    n = experts_per_layer(plan)
    cal = provenance.calibration
    block: dict[str, Any] = dict.fromkeys(RELEASE_TIER_KEYS.values(), 0)
    block.update({TR3_TIER_KEYS[b]: c for b, c in counts.items()})
    block.update(
        {
            "archive_tensor_parallel_size": 4,
            "rank_stacked_tp": 4,
            "runtime_tensor_parallel_size": 1,
            "bits": plan.bits,
            "codebook": plan.codebook,
            "quant_method": "exl3",
            "format": TR3_FORMAT,
            "effective_routed_tier_bpw": plan_routed_bpw(plan),
            "target_routed_tier_bpw": target_bits(plan),
            "raw_private_content_included": provenance.raw_private_content_included,
            "requires_custom_loader": True,
            "selection": selection_text(counts),
            "tail_experts_per_layer": n,
            "session_calibration_manifest_sha256": cal.manifest_sha256,
            "session_calibration_tokens_sha256": cal.token_rows_sha256,
            "session_calibration_verification_sha256": cal.verification_sha256,
            "source_manifest_sha256": provenance.source_manifest_sha256,
        }
    )
    if plan.expert_bits and tiers_differ_by_layer(plan.expert_bits):
        block[LAYER_TIERS_KEY] = tiers_by_layer(plan.expert_bits)
    block.update(linear_bits_keys(plan))
    return block


def linear_bits_keys(plan: ArtifactPlan) -> dict[str, Any]:
    """The keys a tr3 quantization block, the manifest's layout and `plan --json` give the EXL3 linears outside the
    routed experts (the speed tier); none for an artifact that keeps them exact."""
    keys: dict[str, Any] = {}
    if plan.retained_bits is not None:
        keys[RETAINED_BITS_KEY] = plan.retained_bits
    if plan.retained_exact_layers:
        keys[RETAINED_EXACT_LAYERS_KEY] = plan.retained_exact_layers
    if plan.retained_layer_bits is not None:
        keys[RETAINED_LAYER_BITS_KEY] = list(plan.retained_layer_bits)
    if plan.head_bits is not None:
        keys[HEAD_BITS_KEY] = plan.head_bits
    return keys


LINEAR_BITS_KEYS = (RETAINED_BITS_KEY, RETAINED_EXACT_LAYERS_KEY, RETAINED_LAYER_BITS_KEY, HEAD_BITS_KEY)


class DeclaredLinearBits(NamedTuple):
    """The EXL3 linears outside the routed experts that a quantization block or a manifest's layout declares."""

    retained_bits: int | None  # None: the retained linears are exact (or retained_layer_bits names each layer's)
    head_bits: int | None  # None: lm_head is exact
    retained_exact_layers: int
    retained_layer_bits: tuple[int | None, ...] | None


def declared_linear_bits(block: Mapping[str, Any]) -> DeclaredLinearBits:
    """What a quantization block (or a manifest's layout, which has the same keys) declares; None for linears it
    keeps exact (an ExLlamaV3 block's head_bits of UNQUANTIZED_BITS included). ValueError or TypeError for values that
    are not integers (or null in retained_layer_bits)."""
    retained, head, layers = (block.get(k) for k in (RETAINED_BITS_KEY, HEAD_BITS_KEY, RETAINED_LAYER_BITS_KEY))
    if layers is not None and not isinstance(layers, list):
        raise TypeError(f"{RETAINED_LAYER_BITS_KEY} must be a list of K or null per decoder layer, got {layers!r}")
    return DeclaredLinearBits(
        None if retained is None else int(retained),
        None if head is None or int(head) == UNQUANTIZED_BITS else int(head),
        int(block.get(RETAINED_EXACT_LAYERS_KEY, 0)),
        None if layers is None else tuple(None if k is None else int(k) for k in layers),
    )


def output_config(source_config: Mapping[str, Any], plan: ArtifactPlan, block: Mapping[str, Any]) -> dict[str, Any]:
    """The source config with the quantization block, and the pruned expert count when experts were dropped."""
    config = copy.deepcopy(dict(source_config))
    text = text_block(config)
    text["n_routed_experts"] = experts_per_layer(plan)
    config["quantization_config"] = dict(block)
    return config


def tensor_storage(specs: Iterable[TensorSpec]) -> dict[str, Any]:
    """ExLlamaV3's per-module storage map: stored tensors (shape, bytes, torch dtype) and EXL3 format facts."""
    specs = list(specs)
    groups = exl3_groups(specs)
    modules: dict[str, dict[str, Any]] = {}
    for spec in sorted(specs, key=lambda s: s.name):
        key = spec.name.rpartition(".")[0] or spec.name
        entry = modules.setdefault(key, {"stored_tensors": {}})
        entry["stored_tensors"][spec.name] = {
            "shape": list(spec.shape),
            "n_bytes": spec.nbytes,
            "dtype": str(TORCH_DTYPES[spec.dtype]),
        }
    for key, group in groups.items():
        entry = modules[key]
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = group.bits
        for marker, multiplier in MARKER_MULTIPLIERS.items():
            if marker in group.parts:
                entry[f"{marker}_multiplier"] = multiplier
    return modules


def config_text(config: Mapping[str, Any], layout: str) -> str:
    """tr3 files match the reference release (indent 2, sorted); exllamav3 files match ExLlamaV3 (indent 4)."""
    if layout == "tr3":
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    return json.dumps(config, indent=4)


def quantization_config_file(block: Mapping[str, Any], layout: str, specs: Iterable[TensorSpec]) -> dict[str, Any]:
    """`quantization_config.json`: the block itself (tr3) or the block plus `tensor_storage` (exllamav3)."""
    if layout == "tr3":
        return dict(block)
    return {**block, "tensor_storage": tensor_storage(specs)}


def copy_small_files(source_dir: str | Path, out_dir: str | Path, limit: int = SMALL_FILE_LIMIT) -> list[str]:
    """Copy the source's tokenizer, chat template, generation and processor configs and other small files:
    every top-level file that is not a weight file, an index, a config we rewrite, or over `limit` bytes."""
    copied = []
    for path in sorted(Path(source_dir).iterdir()):
        name = path.name
        if (
            not path.is_file()
            or name.startswith(".")
            or name in NOT_COPIED
            or name.endswith(".index.json")
            or name.endswith(WEIGHT_SUFFIXES)
            or path.stat().st_size > limit
        ):
            continue
        with open(path, "rb") as src, atomic_file(Path(out_dir) / name) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        copied.append(name)
    return copied
