"""The draft-head file (`glmquant draft-head`): one safetensors file holding an EXL3 copy of a model's lm_head that
only the MTP drafter reads, described by its metadata (format, EXL3 key, K, codebook, lm_head's shape)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import ParsedHeader, TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import write_safetensors
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3 import EXL3Tensor

DRAFT_HEAD_FORMAT = "glmquant.draft_head.v1"


@dataclass(frozen=True)
class DraftHead:
    """What a draft-head file holds: the EXL3 key of its one tensor, its K and codebook, and lm_head's shape."""

    key: str
    bits: int
    codebook: str
    in_features: int  # hidden size
    out_features: int  # vocabulary

    def metadata(self) -> dict[str, str]:
        return {
            "format": DRAFT_HEAD_FORMAT,
            "key": self.key,
            "bits": str(self.bits),
            "codebook": self.codebook,
            "in_features": str(self.in_features),
            "out_features": str(self.out_features),
        }

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
            return cls(
                meta["key"],
                int(meta["bits"]),
                meta["codebook"],
                int(meta["in_features"]),
                int(meta["out_features"]),
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
    try:
        return EXL3Tensor.from_tensors(tensors, head.key, head.in_features, head.out_features)
    except ValueError as exc:
        raise CheckpointFormatError(f"{path}: {exc}") from None
