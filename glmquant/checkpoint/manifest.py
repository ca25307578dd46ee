"""EXL3_MANIFEST.json (schema_version 2): the structural manifest of an artifact.

Serialized as `json.dumps(obj, indent=2, sort_keys=True) + "\\n"`; the artifact's structural SHA-256 is the
SHA-256 of exactly those bytes. Built from the files actually written (their headers and hashes) plus the plan
(file kinds, expert parts) and the build's provenance, so it describes what is on disk, not what was meant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from glmquant.arch import ModelSpec
from glmquant.checkpoint.artifact_config import (
    LAYER_TIERS_KEY,
    experts_per_layer,
    linear_bits_keys,
    plan_tier_counts,
    routed_tier_bpw,
    target_bits,
)
from glmquant.checkpoint.exl3_groups import Exl3Group, exl3_groups, is_exl3_tensor
from glmquant.checkpoint.hashing import sha256_bytes, sha256_files
from glmquant.checkpoint.layouts import TR3_RANKS, ArtifactPlan, PlannedFile
from glmquant.checkpoint.provenance import Provenance
from glmquant.checkpoint.safetensors_format import ParsedHeader, TensorSpec, parse_header
from glmquant.checkpoint.tiers import tiers_by_layer, tiers_differ_by_layer
from glmquant.checkpoint.writer import atomic_write_text

MANIFEST_NAME = "EXL3_MANIFEST.json"
SCHEMA_VERSION = 2
STRUCTURAL_PASS = "STRUCTURAL_PASS"
ROUTED_EXPERT_KEY = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def written_by_glmquant(manifest: Mapping[str, Any]) -> bool:
    """Whether glmquant wrote the manifest (its own fields and hash recipes apply), from method.implementation."""
    method = manifest.get("method")
    return isinstance(method, Mapping) and str(method.get("implementation", "")).startswith("glmquant ")


def manifest_text(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def write_manifest(artifact_dir: str | Path, manifest: Mapping[str, Any]) -> str:
    """Write the manifest atomically; returns its SHA-256 (the artifact's structural hash)."""
    text = manifest_text(manifest)
    atomic_write_text(Path(artifact_dir) / MANIFEST_NAME, text)
    return sha256_bytes(text.encode("utf-8"))


def retained_manifest_sha256(entries: Iterable[tuple[str, TensorSpec]]) -> str:
    """Hash of the sorted (name, dtype, shape, file) list of every retained (non-EXL3) tensor."""
    rows = sorted([spec.name, spec.dtype, list(spec.shape), file] for file, spec in entries)
    return sha256_bytes(json.dumps(rows, separators=(",", ":")).encode("utf-8"))


def routed_bpw_of(groups: Mapping[str, Exl3Group], hidden: int, moe_inter: int) -> float:
    """Effective routed bpw from headers: trellis bits over the weights of the (unsliced) routed projections (EXL3
    retained linears and head, `--retained-bits` and `--head-bits`, are not routed)."""
    routed = {key: g for key, g in groups.items() if ROUTED_EXPERT_KEY.search(key + ".")}
    projections = {key.split(".rank")[0] for key in routed}
    trellis = sum(g.parts["trellis"].nbytes for g in routed.values() if "trellis" in g.parts)
    return routed_tier_bpw(trellis, len(projections), hidden, moe_inter)


def build_manifest(
    plan: ArtifactPlan,
    artifact_dir: str | Path,
    provenance: Provenance,
    verified_at: str,
    metadata_files: Sequence[str],
    workers: int = 4,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The manifest of the files in `artifact_dir` written from `plan`; hashes every file (parallel, streamed)."""
    root = Path(artifact_dir)
    headers = {f.path: parse_header(root / f.path) for f in plan.files}
    paths = [f.path for f in plan.files] + list(metadata_files)
    digests = sha256_files([root / p for p in paths], workers, on_bytes)
    sha = {p: digests[root / p] for p in paths}
    all_specs = [(path, s) for path, h in headers.items() for s in h.specs]
    groups = exl3_groups(s for _, s in all_specs)
    retained = [(path, s) for path, s in all_specs if not is_exl3_tensor(s.name, groups)]
    n = experts_per_layer(plan)
    return {
        "schema_version": SCHEMA_VERSION,
        "state": STRUCTURAL_PASS,
        "structurally_verified_at": verified_at,
        "files": [_file_entry(f, headers[f.path], sha[f.path], plan) for f in sorted(plan.files, key=lambda f: f.path)],
        "metadata_files": [
            {"path": p, "bytes": (root / p).stat().st_size, "sha256": sha[p]} for p in sorted(metadata_files)
        ],
        "indexed_tensor_count": len(all_specs),
        "physical_tensor_bytes": sum(h.file_size for h in headers.values()),
        "retained_tensor_count": len(retained),
        "retained_tensor_bytes": sum(s.nbytes for _, s in retained),
        "retained_manifest_sha256": retained_manifest_sha256(retained),
        "target_bpw": target_bits(plan),
        "effective_routed_tier_bpw": routed_bpw_of(groups, plan.spec.hidden_size, plan.spec.moe_intermediate_size),
        "layout": _layout(plan, n),
        "geometry": geometry(plan.spec, n),
        **provenance_fields(provenance),
    }


def with_metadata_files(manifest: Mapping[str, Any], artifact_dir: str | Path, names: Sequence[str]) -> dict[str, Any]:
    """The manifest with more small files hashed into `metadata_files` (the model card, written from the
    manifest's own facts once they are known)."""
    root = Path(artifact_dir)
    digests = sha256_files([root / n for n in names], 1)
    added = [{"path": n, "bytes": (root / n).stat().st_size, "sha256": digests[root / n]} for n in names]
    return {**manifest, "metadata_files": sorted([*manifest["metadata_files"], *added], key=lambda e: e["path"])}


def geometry(spec: ModelSpec, n_routed_experts: int) -> dict[str, int]:
    """The model dimensions a loader relies on, as the artifact's config must state them."""
    return {
        "num_hidden_layers": spec.num_hidden_layers,
        "hidden_size": spec.hidden_size,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "n_group": spec.n_group,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_mtp_layers": spec.num_mtp_layers,
    }


def _layout(plan: ArtifactPlan, n: int) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "type": plan.layout,
        "bits": plan.bits,
        "codebook": plan.codebook,
        "experts_per_layer": n,
        "quantized_layers": plan.quantized_layers,
    }
    layout.update(linear_bits_keys(plan))
    if plan.expert_bits is not None:
        layout["tier_experts_per_layer"] = {f"k{b}": c for b, c in sorted(plan_tier_counts(plan).items())}
        if tiers_differ_by_layer(plan.expert_bits):
            layout[LAYER_TIERS_KEY] = tiers_by_layer(plan.expert_bits)
    if plan.layout == "tr3":
        layout.update(
            {
                "archive_tensor_parallel_size": TR3_RANKS,
                "rank_stacked_tp": TR3_RANKS,
                "tail_experts_per_layer": n,
                "expert_parts_per_layer": 2,
            }
        )
    return layout


def file_tier(bits: Iterable[int]) -> str:
    """An expert file's `tier`: its experts' bit widths, e.g. "k2" or "k1-k2-k3"."""
    return "-".join(f"k{b}" for b in sorted(set(bits)))


def _file_entry(f: PlannedFile, header: ParsedHeader, sha256: str, plan: ArtifactPlan) -> dict[str, Any]:
    specs = header.specs
    entry: dict[str, Any] = {
        "path": f.path,
        "kind": f.kind,
        "bytes": header.file_size,
        "sha256": sha256,
        "tensor_count": len(specs),
        "tensor_bytes": sum(s.nbytes for s in specs),
    }
    groups = exl3_groups(specs)
    experts = {(t.expert.layer, t.expert.expert) for t in f.tensors if t.expert}
    if f.kind == "expert":
        entry.update(
            {
                "layer": f.layer,
                "gpu": f.gpu,
                "logical_expert_count": len(experts),
                "shadow_expert_count": 0,
                "tier": file_tier(plan.bits_of(layer, e) for layer, e in experts),
            }
        )
    elif f.kind == "retained":
        entry["source_shard"] = f.source_shard
        if groups:  # EXL3 retained linears (`--retained-bits`) or lm_head (`--head-bits`)
            kept = [s for s in specs if not is_exl3_tensor(s.name, groups)]
            entry.update(
                {
                    "exl3_linear_count": len(groups),
                    "retained_tensor_count": len(kept),
                    "retained_tensor_bytes": sum(s.nbytes for s in kept),
                }
            )
    else:
        kept = [s for s in specs if not is_exl3_tensor(s.name, groups)]
        entry.update(
            {
                "exl3_linear_count": len(groups),
                "logical_expert_count": len(experts),
                "retained_tensor_count": len(kept),
                "retained_tensor_bytes": sum(s.nbytes for s in kept),
            }
        )
    return entry


def provenance_fields(p: Provenance) -> dict[str, Any]:
    c, m = p.calibration, p.method
    return {
        "source": {
            "repo_id": p.source_repo,
            "revision": p.source_revision,
            "format": p.source_format,
            "manifest": p.source_manifest,
            "manifest_sha256": p.source_manifest_sha256,
        },
        "calibration": {
            "manifest": c.manifest,
            "manifest_sha256": c.manifest_sha256,
            "token_rows_sha256": c.token_rows_sha256,
            "verification_sha256": c.verification_sha256,
            "rows": c.rows,
            "cols": c.cols,
            "routing": c.routing,
        },
        "method": {
            "claim": m.claim,
            "upstream_repo": m.upstream_repo,
            "upstream_commit": m.upstream_commit,
            "implementation": m.implementation,
            "out_scales": m.out_scales,
        },
        "selection_sha256": p.selection_sha256,
        "tier_bitmap_sha256": p.tier_bitmap_sha256,
        "raw_private_content_included": p.raw_private_content_included,
        "runtime": {"cuda_graphs_required": p.cuda_graphs_required, "status": p.runtime_status},
    }
