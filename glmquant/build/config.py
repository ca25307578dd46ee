"""The options of a fused build: one observation config and one encode config, checked against each other.

Resuming (rerun the same command): the observation follows observe's rules (observe/config.py) and the encode
encode's (encode/config.py); a build's observation directory can only be resumed by a build.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmquant.encode.config import EncodeConfig
from glmquant.errors import UsageError
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessians import HessianMode


@dataclass(frozen=True)
class BuildConfig:
    observe: ObserveConfig  # its `keep` writes OBS/prune_plan.json from the REAP statistics, as observe does
    encode: EncodeConfig  # prunes only with an explicit `prune_plan`

    def __post_init__(self) -> None:
        o, e = self.observe, self.encode
        if e.source != o.source or e.observations != o.out:
            raise UsageError("a build encodes the source it observes, with the observations it writes")
        if e.keep is not None or (e.tiers is not None and not e.tiers.from_structure):
            raise UsageError(
                "a build encodes all experts or those of --prune-plan, at --bits, the tiers of --tier-plan or "
                "depth or layers tiers: the statistics of the later layers do not exist yet when the first is encoded "
                "(observe --keep N / --tiers SPEC write OBS/prune_plan.json / OBS/tier_plan.json for another encode)"
            )
        if o.dense_hessians:
            raise UsageError("--dense-hessians is for observe: a build keeps only the routed experts' Hessians")
        wanted = HessianMode(e.hessians)
        if not (o.hessians.natural if wanted is HessianMode.NATURAL else o.hessians.all_tokens):
            raise UsageError(
                f"encoding with {wanted.value!r} Hessians needs them observed (--hessians "
                f"{o.hessians.value} does not give them)"
            )
        if e.tune_scales and not o.tuning_tokens:
            raise UsageError("--tune-scales tunes on the tokens the observation keeps: give --tuning-tokens N too")
        if e.blend is not None and o.hessians is not HessianMode.BOTH:
            raise UsageError("--blend mixes natural and all-token Hessians: observe them with --hessians both")
