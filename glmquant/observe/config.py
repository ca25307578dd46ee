"""The one typed config of an observation run, built at the CLI edge.

Which options may change when an unfinished run is resumed (the rest are part of its fingerprint and
must match, see checkpointing.py):

    may change:  keep and tiers (the prune and tier plans are recomputed from the finished statistics),
                 stream_budget_gb (chunk outputs
                 are the same whichever pass writes them), progress display
    must match:  source model, token rows (recipe, rows, tokens, tokenizer), hessians, hessian_weighting,
                 dense_hessians, tuning_tokens,
                 whether lm_head's Hessian is captured (runs from before it was are refused:
                 they would resume as done without it; a run from before the MTP layer's Hessians resumes
                 without them),
                 device type, batch_rows, model dtype, torch and transformers versions, where the streams
                 live (disk or device; the checkpoint interval of device streams may change)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import glmquant
from glmquant.devices import require_visible
from glmquant.errors import UsageError
from glmquant.observe.checkpointing import MTP_HESSIANS_KEY, SOURCE_VECTORS_KEY
from glmquant.observe.hessians import HessianMode, HessianWeighting
from glmquant.observe.tiers import TierSpec

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "calibration" / "default.yaml"


@dataclass(frozen=True)
class ObserveConfig:
    source: Path  # BF16 source checkpoint directory
    out: Path  # observations directory
    recipe: Path = DEFAULT_RECIPE
    rows: int | None = None  # override every lane's row count
    tokens: int | None = None  # override every lane's tokens per row
    hessians: HessianMode = HessianMode.NATURAL
    dense_hessians: bool = False  # also capture attention / shared-expert / dense-MLP and lm_head Hessians
    keep: int | None = None  # write prune_plan.json keeping this many experts per MoE layer
    device: str = "cpu"
    batch_rows: int = 4  # calibration rows pushed through a layer at once
    stream_budget_gb: float | None = None  # most disk (1e9 B) the hidden streams may take; None: no limit
    tiers: TierSpec | None = None  # write tier_plan.json: per-expert bit widths (REAP, depth, share or layers)
    # hidden streams held on the device (RAM on cpu) instead of one disk file per chunk: one layer's streams S plus
    # one chunk, no disk traffic; a checkpoint (the streams written to disk) every this many layers where the disk has
    # room, 0: none (a killed run recomputes its streams from the newest, else the embeddings). None: streams on disk
    device_streams_every: int | None = None
    # natural Hessians with each routed token counted once ("token") or weighted by its gate ("gate": hessians.py)
    hessian_weighting: HessianWeighting = HessianWeighting.TOKEN
    # keep this many calibration tokens' MoE inputs and routing per MoE layer, in its Hessians file, for
    # `encode --tune-scales` (tuning_sample.py); 0: none
    tuning_tokens: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("hessians", HessianMode), ("hessian_weighting", HessianWeighting)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                choices = ", ".join(m.value for m in kind)
                raise UsageError(
                    f"--{name.replace('_', '-')} must be one of {choices}, not {getattr(self, name)!r}"
                ) from None
        if self.hessian_weighting is HessianWeighting.GATE and not self.hessians.natural:
            raise UsageError(
                f"--hessian-weighting gate weights the natural Hessians: use it with --hessians natural or both, "
                f"not {self.hessians.value}"
            )
        if self.stream_budget_gb is not None and not self.stream_budget_gb > 0:
            raise UsageError(f"--stream-budget-gb must be positive, got {self.stream_budget_gb}")
        if self.batch_rows < 1:
            raise UsageError(f"--batch-rows must be a positive integer, got {self.batch_rows}")
        if self.device_streams_every is not None and self.device_streams_every < 0:
            raise UsageError(f"--device-streams-every must be 0 or more layers, got {self.device_streams_every}")
        if self.tuning_tokens < 0:
            raise UsageError(f"--tuning-tokens must be 0 or more, got {self.tuning_tokens}")
        if self.tuning_tokens and not self.hessians.natural:
            raise UsageError(
                "--tuning-tokens keeps tokens beside the natural Hessians (the experts they are routed to): use it "
                f"with --hessians natural or both, not {self.hessians.value}"
            )
        if self.keep is not None and self.keep < 1:
            raise UsageError(f"--keep must be a positive integer, got {self.keep}")
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", TierSpec.parse(self.tiers))
        require_visible(self.device)  # before --out is created
        self._check_out()

    def _check_out(self) -> None:
        """--out names a directory apart from the source, as encode's does: observations written into the source
        (or a directory inside it) would sit among its shards and travel with it; a directory holding the source
        would mix the two."""
        out, source = self.out.resolve(), Path(self.source).resolve()
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {self.out} is a file; give a directory for the observations")
        if out.parent.exists() and not out.parent.is_dir():
            raise UsageError(f"--out {self.out}: {self.out.parent} is a file, not a directory")
        if source.is_relative_to(out):  # the same directory, or one the observations' would hold
            raise UsageError(
                f"--out {self.out} holds the source {self.source}; give the observations a directory of their own"
            )
        if out.is_relative_to(source):
            raise UsageError(
                f"--out {self.out} is inside the source {self.source}; give the observations a directory of their own"
            )

    @property
    def stream_budget_bytes(self) -> int | None:
        return None if self.stream_budget_gb is None else int(self.stream_budget_gb * 1e9)


def fingerprint(
    config: ObserveConfig,
    token_rows_sha256: str,
    dtype: torch.dtype,
    head_hessian: bool,
    source_vectors_sha256: str,
    mtp_hessians: bool = False,
) -> dict[str, Any]:
    """Everything that changes the bytes of the observations (see the module docstring). `head_hessian`: the run
    captures lm_head's Hessian (run.py `_observes_head`); `source_vectors_sha256`: the source's 1-D tensors
    (`vector_tensors_sha256`), which tell its checkpoint from another of the same config; `mtp_hessians`: the run
    captures the MTP layer's Hessians (with lm_head's, where the model has an MTP layer)."""
    import transformers

    where: dict[str, Any] = {}  # keys added only when set, so older runs keep their fingerprint
    if config.device_streams_every is not None:
        where["streams"] = "device"
    if config.hessian_weighting is not HessianWeighting.TOKEN:
        where["hessian_weighting"] = config.hessian_weighting.value
    if config.tuning_tokens:
        where["tuning_tokens"] = config.tuning_tokens
    if head_hessian:  # a run from before the head was captured is refused here instead of resuming as done
        where["head_hessian"] = True
    if mtp_hessians:
        where[MTP_HESSIANS_KEY] = True
    return {
        **where,
        "source_config_sha256": _sha256(config.source / "config.json"),
        "source_index_sha256": _sha256(config.source / "model.safetensors.index.json"),
        SOURCE_VECTORS_KEY: source_vectors_sha256,
        "token_rows_sha256": token_rows_sha256,
        "hessians": config.hessians.value,
        "dense_hessians": config.dense_hessians,
        "device": torch.device(config.device).type,
        "batch_rows": config.batch_rows,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "glmquant": glmquant.__version__,
    }


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
