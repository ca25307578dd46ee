"""`glmquant plan`: predict an artifact's exact structure (files, tensors, sizes) from a config alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from glmquant.arch import ModelSpec, TensorRole, table_for
from glmquant.checkpoint.artifact_config import linear_bits_keys
from glmquant.checkpoint.index import read_index
from glmquant.checkpoint.layouts import ArtifactPlan, OutputTensor
from glmquant.checkpoint.tiers import tier_bitmap_sha256

_DECODE_SKIPPED = (TensorRole.VISION, TensorRole.EMBEDDING)


@dataclass(frozen=True)
class RoleTotal:
    role: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class PlanSummary:
    layout: str
    bits: int
    codebook: str
    file_count: int
    expert_file_count: int
    indexed_tensor_count: int
    physical_bytes: int
    roles: tuple[RoleTotal, ...]
    mtp_tensors: int
    mtp_bytes: int
    decode_bytes_per_token: int  # weights one decode token reads: top-k experts per MoE layer + all dense text weights


def summarize(plan: ArtifactPlan) -> PlanSummary:
    tensors = [t for f in plan.files for t in f.tensors]
    counts: Counter[TensorRole] = Counter()
    sizes: Counter[TensorRole] = Counter()
    mtp_tensors = mtp_bytes = 0
    mtp = _mtp_prefixes(plan.spec)
    for t in tensors:
        nbytes = t.nbytes
        counts[t.role] += 1
        sizes[t.role] += nbytes
        if t.name.startswith(mtp):
            mtp_tensors += 1
            mtp_bytes += nbytes
    return PlanSummary(
        layout=plan.layout,
        bits=plan.bits,
        codebook=plan.codebook,
        file_count=len(plan.files),
        expert_file_count=sum(f.kind == "expert" for f in plan.files),
        indexed_tensor_count=len(tensors),
        physical_bytes=sum(f.size for f in plan.files),
        roles=tuple(sorted((RoleTotal(r.value, counts[r], sizes[r]) for r in counts), key=lambda r: r.role)),
        mtp_tensors=mtp_tensors,
        mtp_bytes=mtp_bytes,
        decode_bytes_per_token=decode_bytes_per_token(plan.spec, tensors),
    )


def decode_bytes_per_token(spec: ModelSpec, tensors: list[OutputTensor]) -> int:
    """Active experts (k of them per MoE layer) + every dense text-model weight + one embedding row."""
    expert_bytes: Counter[tuple[int, int]] = Counter()
    dense = 0
    mtp = _mtp_prefixes(spec)
    for t in tensors:
        if t.role in _DECODE_SKIPPED or t.name.startswith(mtp):
            continue
        if t.expert is not None:
            expert_bytes[(t.expert.layer, t.expert.expert)] += t.nbytes
        else:
            dense += t.nbytes
    per_layer: dict[int, list[int]] = {}
    for (layer, _), nbytes in expert_bytes.items():
        per_layer.setdefault(layer, []).append(nbytes)
    active = sum(sum(sorted(v, reverse=True)[: spec.num_experts_per_tok]) for v in per_layer.values())
    embed_row = spec.hidden_size * 2
    return active + dense + embed_row


def _mtp_prefixes(spec: ModelSpec) -> tuple[str, ...]:
    """Name prefixes of the MTP layers' tensors (for str.startswith)."""
    table = table_for(spec)
    return tuple(table.layer_prefix(layer) for layer in spec.mtp_layers)


def load_source_shards(index_path: str | Path) -> dict[str, str]:
    """tensor name -> shard file, from a source `model.safetensors.index.json`."""
    return dict(read_index(index_path).weight_map)


def plan_to_json(plan: ArtifactPlan, summary: PlanSummary, with_tensors: bool = True) -> dict:
    files = []
    for f in plan.files:
        entry = {"path": f.path, "kind": f.kind, "bytes": f.size, "tensor_count": len(f.tensors)}
        if with_tensors:
            entry["tensors"] = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in f.tensors]
        files.append(entry)
    tiers: dict[str, object] = {"tier_bitmap_sha256": tier_bitmap_sha256(plan.expert_bits)} if plan.expert_bits else {}
    tiers.update(linear_bits_keys(plan))
    return {
        "layout": summary.layout,
        "bits": summary.bits,
        "codebook": summary.codebook,
        "file_count": summary.file_count,
        "expert_file_count": summary.expert_file_count,
        "indexed_tensor_count": summary.indexed_tensor_count,
        "physical_tensor_bytes": summary.physical_bytes,
        "roles": [r.__dict__ for r in summary.roles],
        "mtp": {"tensors": summary.mtp_tensors, "bytes": summary.mtp_bytes},
        "decode_bytes_per_token": summary.decode_bytes_per_token,
        "files": files,
        **tiers,
    }
