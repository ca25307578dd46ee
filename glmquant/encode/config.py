"""The options of one encode job, built once at the CLI edge and checked here.

Resuming a killed job (rerun the same command; the state lives in --work-dir, default ARTIFACT.work):

    may change:  --work-dir location (moved with its contents), progress display, the number of processes
                 (torchrun's world size: units are assigned by rank, each computed the same way anywhere)
    must match:  the source's tensors (content hash of its structure), the observations' token rows and
                 recipe, the kept experts and their tiers, --bits --codebook --layout --hessians --blend --keep
                 --tiers --seed --retained-bits --retained-exact-layers --retained-layer-bits --head-bits
                 --retained-uncalibrated-fallback --tune-scales
                 --experts-per-unit (the batch a GPU computes together), --source-repo and --revision
                 (the commit a Hub source resolved to), the device type and the Viterbi backend (CPU and GPU
                 arithmetic differ)

A mismatch is refused with an error naming the state file; nothing already written is touched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

import torch

from glmquant.checkpoint.artifact_config import TR3_TIER_BITS
from glmquant.checkpoint.layouts import (
    LAYOUTS,
    MARKER_PARTS,
    check_exact_layers,
    check_layer_bits,
    check_linear_bits,
    parse_layer_bits,
)
from glmquant.devices import require_visible
from glmquant.encode.scale_tuning import LEARNING_RATE
from glmquant.environment import encode_memo_dir, exl3_backend
from glmquant.errors import UsageError
from glmquant.exl3.refit import REFIT_ROUNDS
from glmquant.exl3.scale_search import DEFAULT_SEARCH, ScaleSearch
from glmquant.observe.hessians import HessianMode
from glmquant.observe.tiers import TierSpec

# the scale search and refit rounds that jobs begun at 95a428e (the first with these defaults) were encoded with
UNRECORDED_SEARCH = ScaleSearch(
    band_width=1,
    coarse_stride=6,
    coarse_min_tiles=48,
    fine_stride=3,
    fine_min_tiles=96,
    coarse_walk=True,
    fine_walk=True,
)
UNRECORDED_REFIT_ROUNDS = 1

HESSIAN_MODES = (HessianMode.NATURAL, HessianMode.ALL)


# 33: a GLM-5.3-Flash expert adds 256 Viterbi tiles per LDLQ step, and 33 x 256 fills exactly 64 waves of one block
# on 132 SMs (H100 SXM, H200), where 32 experts' 8,192 tiles leave a 63rd wave nearly empty: 1 % of a layer's time on
# an H200 (docs/encode.md)
DEFAULT_EXPERTS_PER_UNIT = 33


@dataclass(frozen=True)
class EncodeConfig:
    source: Path
    out: Path
    observations: Path | None = None  # `glmquant observe` output; None needs uncalibrated=True
    uncalibrated: bool = False  # encode without observations (identity Hessians): asked for, never a silent default
    bits: int = 2
    codebook: str = "mcg"
    layout: str = "tr3"
    hessians: HessianMode = HessianMode.NATURAL
    blend: float | None = None  # natural share s of the Hessians s·natural + (1 - s)·all-token (needs both)
    keep: int | None = None  # REAP pruning: experts kept per layer, ranked by the observations' saliency
    prune_plan: Path | None = None  # or an explicit plan file
    tiers: TierSpec | None = None  # per-expert bit widths by REAP saliency, or per layer (replaces `bits`)
    tier_plan: Path | None = None  # or an explicit tier_plan.json
    device: str = "cpu"
    work_dir: Path | None = None
    seed: int = 0
    # work unit: this many experts' EXL3 tensors encoded in one batched call
    experts_per_unit: int = DEFAULT_EXPERTS_PER_UNIT
    source_repo: str | None = None
    source_revision: str | None = None  # the Hub commit a repo-id source resolved to
    verify: bool = True
    verified_at: str | None = None  # the manifest's timestamp (None: SOURCE_DATE_EPOCH, else the build's time)
    # the speed tier: the retained linears (attention, shared experts, dense MLPs) EXL3-encoded at this K with their
    # dense Hessians (`observe --dense-hessians`); None keeps every retained tensor exact
    retained_bits: int | None = None
    # the first decoder layers whose retained linears stay exact beside the --retained-bits ones (where the speed tier
    # costs most KL: docs/fidelity.md)
    retained_exact_layers: int = 0
    # or each decoder layer's K (None: exact), the first layer first, instead of those two (`--retained-layer-bits`,
    # text parsed here)
    retained_layer_bits: tuple[int | None, ...] | None = None
    # lm_head EXL3-encoded at this K with the Hessian of its input (observe --dense-hessians); None keeps it exact
    head_bits: int | None = None
    # a retained linear (or lm_head) without a dense Hessian is encoded uncalibrated instead of refused (asked for,
    # never a default)
    retained_fallback_identity: bool = False
    # Adam steps tuning the stored scales of each unit's routed experts together on their share of the sampled tokens'
    # MoE output (`observe --tuning-tokens`), the codes fixed (scale_tuning.py); 0: the encoder's own scales
    tune_scales: int = 0

    def __post_init__(self) -> None:
        if self.observations is None and not self.uncalibrated:
            raise UsageError(
                "no --observations: give the output of `glmquant observe`, or --uncalibrated to encode "
                "without calibration (identity Hessians, a much worse artifact)"
            )
        if self.observations is not None and self.uncalibrated:
            raise UsageError("--uncalibrated and --observations exclude each other")
        self._check_out()
        try:
            object.__setattr__(self, "hessians", HessianMode(self.hessians))
        except ValueError:
            raise UsageError(f"--hessians must be natural or all, got {self.hessians!r}") from None
        if self.hessians not in HESSIAN_MODES:
            raise UsageError(f"--hessians must be natural or all (encode uses one), got {self.hessians.value!r}")
        if self.layout not in LAYOUTS:
            raise UsageError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.codebook not in MARKER_PARTS:
            raise UsageError(f"--codebook must be one of {', '.join(MARKER_PARTS)}, got {self.codebook!r}")
        if not 1 <= self.bits <= 8:
            raise UsageError(f"--bits must be 1..8, got {self.bits}")
        if self.blend is not None and not (0 < self.blend < 1 and self.hessians is HessianMode.NATURAL):
            raise UsageError(
                f"--blend is the natural Hessians' share in (0, 1), with --hessians natural; got "
                f"{self.blend} with {self.hessians.value}"
            )
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", TierSpec.parse(self.tiers))
        if self.tiers is not None and self.tier_plan is not None:
            raise UsageError("--tiers and --tier-plan exclude each other")
        if (self.tiers is not None or self.tier_plan is not None) and self.uncalibrated:
            raise UsageError("--tiers ranks by the observations' statistics: it needs --observations")
        if self.tiers is not None and self.layout == "tr3" and max(self.tiers.bits) > max(TR3_TIER_BITS):
            raise UsageError(
                f"the tr3 layout's tiers are K{min(TR3_TIER_BITS)}..K{max(TR3_TIER_BITS)}; "
                f"--tiers {self.tiers.text} asks for more"
            )
        for name, value in (("--keep", self.keep), ("--experts-per-unit", self.experts_per_unit)):
            if value is not None and value < 1:
                raise UsageError(f"{name} must be a positive integer, got {value}")
        if self.keep is not None and self.prune_plan is not None:
            raise UsageError("--keep and --prune-plan exclude each other")
        for option, bits in (("--retained-bits", self.retained_bits), ("--head-bits", self.head_bits)):
            if bits is not None:
                check_linear_bits(option, bits)
        check_exact_layers(self.retained_bits, self.retained_exact_layers)  # the layer count: at planning
        if isinstance(self.retained_layer_bits, str):
            object.__setattr__(self, "retained_layer_bits", parse_layer_bits(self.retained_layer_bits))
        check_layer_bits(self.retained_bits, self.retained_exact_layers, self.retained_layer_bits)
        if self.tune_scales < 0:
            raise UsageError(f"--tune-scales must be 0 or more Adam steps, got {self.tune_scales}")
        if self.tune_scales and self.uncalibrated:
            raise UsageError("--tune-scales tunes on the observations' sampled tokens: it needs --observations")
        asked = (self.retained_bits, self.retained_layer_bits, self.head_bits)
        if self.retained_fallback_identity and all(v is None for v in asked):
            raise UsageError(
                "--retained-uncalibrated-fallback applies to --retained-bits, --retained-layer-bits and --head-bits "
                "only"
            )
        require_visible(self.device)  # a CUDA job on a machine without one, refused before any work
        exl3_backend()
        encode_memo_dir()

    def _check_out(self) -> None:
        """--out names a directory to create or fill that does not hold an input (writing into the source would
        replace its config and index with the artifact's)."""
        out = self.out.resolve()
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {self.out} is a file; give a directory for the artifact")
        if out.parent.exists() and not out.parent.is_dir():
            raise UsageError(f"--out {self.out}: {self.out.parent} is a file, not a directory")
        for name, given in (("the source", self.source), ("--observations", self.observations)):
            if given is None:
                continue
            other = Path(given).resolve()
            if other.is_relative_to(out):  # the same directory, or one the artifact's would hold
                raise UsageError(f"--out {self.out} holds {name} {given}; give the artifact a directory of its own")

    @property
    def state_dir(self) -> Path:
        return self.work_dir or self.out.with_name(self.out.name + ".work")

    def fingerprint(self, inputs: dict[str, str | None]) -> str:
        """What must not change between a killed run and its resume: every option that shapes the bytes, the
        device type and Viterbi backend (CPU and GPU arithmetic differ), and the hashes of the inputs' contents
        (`inputs`: source structure, observations, prune plan), not their paths."""
        shaping = {
            k: v.value if isinstance(v, Enum) else str(v)
            for k, v in asdict(self).items()
            if k
            not in (
                "out",
                "work_dir",
                "verify",
                "source",
                "observations",
                "prune_plan",
                "tier_plan",
                "uncalibrated",
                "verified_at",
            )
        }
        for k, default in (
            ("retained_bits", None),
            ("retained_exact_layers", 0),
            ("retained_layer_bits", None),
            ("head_bits", None),
            ("retained_fallback_identity", False),
            ("tune_scales", 0),
        ):
            if getattr(self, k) == default:  # a job from before these options existed resumes unchanged
                del shaping[k]
        if self.tiers is not None and not self.tiers.widths:  # hashed as before `layers` specs added the field
            shaping["tiers"] = str({k: v for k, v in asdict(self.tiers).items() if k != "widths"})
        if self.tune_scales:  # a job begun when each expert was tuned alone, or at another rate, is not resumed
            shaping["tune_scales_loss"] = "unit-output"
            shaping["tune_scales_lr"] = repr(LEARNING_RATE)
        shaping["device"] = torch.device(self.device).type
        shaping["backend"] = exl3_backend() or "auto"
        # the encoder's own defaults: units encoded before a change of them must not be mixed with units after it;
        # recorded once they differ from those of 95a428e, whose jobs were fingerprinted without them
        if DEFAULT_SEARCH != UNRECORDED_SEARCH:
            shaping["scale_search"] = json.dumps(asdict(DEFAULT_SEARCH), sort_keys=True)
        if REFIT_ROUNDS != UNRECORDED_REFIT_ROUNDS:
            shaping["refit_rounds"] = str(REFIT_ROUNDS)
        return hashlib.sha256(json.dumps({**shaping, **inputs}, sort_keys=True).encode()).hexdigest()
