"""The draft-head file (`glmquant draft-head`): one safetensors file holding an EXL3 copy of a model's lm_head that
only the MTP drafter reads, described by its metadata (format, EXL3 key, K, codebook, lm_head's shape); with
`--mtp-bits` also an EXL3 copy of the MTP layer's linears and routed experts (metadata `mtp_*`), which the drafts
then read instead of the artifact's BF16 MTP layer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.arch import ModelSpec, table_for
from glmquant.checkpoint.layouts import EXL3_PARTS, expert_slices, quantizable_mtp
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import ParsedHeader, TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import write_safetensors
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3 import EXL3Tensor

DRAFT_HEAD_FORMAT = "glmquant.draft_head.v1"


@dataclass(frozen=True)
class DraftMtp:
    """The MTP layer's copy in a draft-head file: its layer index, the K of its linears and of its routed experts,
    and how many experts it holds."""

    layer: int
    bits: int
    expert_bits: int
    experts: int


@dataclass(frozen=True)
class DraftHead:
    """What a draft-head file holds: the EXL3 key of its head tensor, its K and codebook, lm_head's shape, and the
    MTP layer's copy where it has one."""

    key: str
    bits: int
    codebook: str
    in_features: int  # hidden size
    out_features: int  # vocabulary
    mtp: DraftMtp | None = None

    def metadata(self) -> dict[str, str]:
        meta = {
            "format": DRAFT_HEAD_FORMAT,
            "key": self.key,
            "bits": str(self.bits),
            "codebook": self.codebook,
            "in_features": str(self.in_features),
            "out_features": str(self.out_features),
        }
        if self.mtp is not None:
            m = self.mtp
            meta |= {"mtp_layer": str(m.layer), "mtp_bits": str(m.bits), "mtp_expert_bits": str(m.expert_bits)}
            meta["mtp_experts"] = str(m.experts)
        return meta

    @classmethod
    def of_header(cls, header: ParsedHeader) -> DraftHead:
        """A file's description from its safetensors metadata; CheckpointFormatError naming the file for one that
        is not a draft-head file."""
        path, meta = header.path, header.metadata or {}
        if meta.get("format") != DRAFT_HEAD_FORMAT:
            raise CheckpointFormatError(
                f"{path}: not a draft-head file (its metadata format is {meta.get('format')!r}, not "
                f"{DRAFT_HEAD_FORMAT!r}); build one with `glmquant draft-head`"
            )
        try:
            mtp = None
            if "mtp_layer" in meta:
                mtp = DraftMtp(
                    int(meta["mtp_layer"]),
                    int(meta["mtp_bits"]),
                    int(meta["mtp_expert_bits"]),
                    int(meta["mtp_experts"]),
                )
            return cls(
                meta["key"],
                int(meta["bits"]),
                meta["codebook"],
                int(meta["in_features"]),
                int(meta["out_features"]),
                mtp,
            )
        except (KeyError, ValueError) as exc:
            raise CheckpointFormatError(f"{path}: draft-head metadata is incomplete or malformed ({exc})") from None


def write_draft_head(path: Path, head: DraftHead, tensors: dict[str, torch.Tensor]) -> None:
    """The EXL3 parts `tensors` (by name) with `head`'s metadata, written whole or not at all."""
    specs = [TensorSpec(name, dtype_name(t), tuple(t.shape)) for name, t in sorted(tensors.items())]
    write_safetensors(path, specs, lambda s: tensors[s.name], head.metadata())


def read_draft_head(path: str | Path, hidden_size: int, vocab_size: int, device: torch.device | str) -> EXL3Tensor:
    """The EXL3 head of a draft-head file on `device`, after checking it fits the model it drafts for (UsageError
    naming the file and both shapes otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"draft_head {path}: no such file (build one with `glmquant draft-head`)")
    with SourceCheckpoint.open(path) as ckpt:
        head = DraftHead.of_header(ckpt.headers[path.name])
        if (head.in_features, head.out_features) != (hidden_size, vocab_size):
            raise UsageError(
                f"draft_head {path}: an lm_head of {head.out_features} x {head.in_features} (vocabulary x hidden), "
                f"the model's is {vocab_size} x {hidden_size}: it was built from another model"
            )
        tensors = {name: ckpt.read_tensor(name).to(device) for name in ckpt.names()}
    return _exl3(path, tensors, head.key, head.in_features, head.out_features)


@dataclass(frozen=True)
class DraftMtpTensors:
    """The MTP layer's EXL3 copy, read from a draft-head file."""

    layer: int
    linears: dict[str, EXL3Tensor]  # by EXL3 key: the source weight's name without `.weight`
    experts: list[dict[str, EXL3Tensor]]  # per routed expert, by projection (gate_proj, up_proj, down_proj)


@dataclass(frozen=True)
class MtpCopyTensor:
    """One EXL3 tensor of the MTP layer's copy: its key (the source weight's name without `.weight`), its shape, and
    the routed expert and projection it is (None for a linear of the layer)."""

    key: str
    in_features: int
    out_features: int
    expert: int | None = None
    proj: str | None = None


def mtp_copy_tensors(spec: ModelSpec, layer: int) -> list[MtpCopyTensor]:
    """Every EXL3 tensor a draft file's copy of MTP layer `layer` holds: its linears (`quantizable_mtp`), then each
    routed expert's whole projections, named as the artifact names its experts."""
    prefix = table_for(spec).layer_prefix(layer)
    linears = [MtpCopyTensor(t.name.removesuffix(".weight"), t.shape[1], t.shape[0]) for t in quantizable_mtp(spec)]
    experts = [
        MtpCopyTensor(prefix + s.key, s.in_features, s.out_features, e, s.proj)
        for e in range(spec.n_routed_experts)
        for s in expert_slices(spec, layer, e, e, None)
    ]
    return linears + experts


def read_draft_mtp(path: str | Path, spec: ModelSpec, device: torch.device | str) -> DraftMtpTensors | None:
    """The MTP layer's EXL3 copy in a draft-head file (None for a file of the head alone), checked against the
    model's MTP layer (UsageError naming the file for another model's, CheckpointFormatError for a missing tensor)."""
    path = Path(path)
    with SourceCheckpoint.open(path) as ckpt:
        mtp = DraftHead.of_header(ckpt.headers[path.name]).mtp
        if mtp is None:
            return None
        if mtp.layer not in spec.mtp_layers or mtp.experts != spec.n_routed_experts:
            raise UsageError(
                f"draft_head {path}: holds MTP layer {mtp.layer} with {mtp.experts} routed experts, the model's MTP "
                f"layers are {spec.mtp_layers} with {spec.n_routed_experts}: it was built from another model, or the "
                "artifact pruned its experts (`--keep`; the copy keeps every one of the source's); serve the "
                "artifact's own MTP layer with a draft head built without --mtp-bits"
            )
        linears: dict[str, EXL3Tensor] = {}
        experts: list[dict[str, EXL3Tensor]] = [{} for _ in range(mtp.experts)]
        for t in mtp_copy_tensors(spec, mtp.layer):
            names = [f"{t.key}.{part}" for part in EXL3_PARTS if f"{t.key}.{part}" in ckpt]
            if not names:
                raise CheckpointFormatError(f"{path}: the MTP layer's EXL3 tensor {t.key} is missing")
            tensor = _exl3(
                path, {n: ckpt.read_tensor(n).to(device) for n in names}, t.key, t.in_features, t.out_features
            )
            if t.expert is None or t.proj is None:
                linears[t.key] = tensor
            else:
                experts[t.expert][t.proj] = tensor
    return DraftMtpTensors(mtp.layer, linears, experts)


def _exl3(path: Path, tensors: dict[str, torch.Tensor], key: str, in_features: int, out_features: int) -> EXL3Tensor:
    try:
        return EXL3Tensor.from_tensors(tensors, key, in_features, out_features)
    except ValueError as exc:
        raise CheckpointFormatError(f"{path}: {exc}") from None
