"""Which experts an encode keeps (all, an explicit prune plan, or the top-N by the observations' REAP saliency)
and at which bit widths (one K, an explicit tier plan, or tiers by REAP saliency: `glmquant/observe/tiers.py`).

A prune plan (`prune_plan.json`, written by `glmquant observe --keep N`) maps MoE layers to the source
experts kept, in output order: {"keep": N, "layers": {"3": [17, 4, ...], ...}}. The MTP layer has no
calibration statistics (observation does not run it); unless the plan names it, it keeps the experts of the
last MoE layer, so every layer has the same expert count as `n_routed_experts` in the config says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from glmquant.arch import ModelSpec
from glmquant.checkpoint.artifact_config import TR3_TIER_BITS
from glmquant.encode.config import EncodeConfig
from glmquant.errors import UsageError
from glmquant.observe.prune import check_keep
from glmquant.observe.tiers import TierPlan, load_tier_plan, plan_structure_tiers

PRUNE_PLAN_NAME = "prune_plan.json"
TIER_PLAN_NAME = "tier_plan.json"


def resolve_keep(cfg: EncodeConfig, spec: ModelSpec) -> dict[int, list[int]] | None:
    if cfg.prune_plan is not None:
        plan_path = cfg.prune_plan
    elif cfg.keep is None:
        return None
    else:
        if cfg.observations is None:
            raise UsageError("--keep needs --observations (REAP saliency) or use --prune-plan FILE")
        from glmquant.observe.prune import write_prune_plan

        cfg.state_dir.mkdir(parents=True, exist_ok=True)  # the job's work directory, made before its state
        plan_path = write_prune_plan(cfg.observations, cfg.keep, cfg.state_dir / PRUNE_PLAN_NAME)
    return load_prune_plan(plan_path, spec, cfg.keep)


def load_prune_plan(path: Path, spec: ModelSpec, expect_keep: int | None = None) -> dict[int, list[int]]:
    try:
        data = json.loads(Path(path).read_text())
        layers = {int(k): [int(e) for e in v] for k, v in data["layers"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path}: not a prune plan ({exc})") from None
    missing = [layer for layer in spec.moe_layers if layer not in layers]
    if missing:
        raise UsageError(f"{path}: no kept experts for MoE layer(s) {missing}")
    if expect_keep is not None and any(len(v) != expect_keep for v in layers.values()):
        raise UsageError(f"{path}: plan does not keep {expect_keep} experts in every layer")
    for kept in {len(v) for v in layers.values()}:
        check_keep(spec, kept, str(path))
    last = spec.moe_layers[-1]
    for mtp in spec.mtp_layers:
        layers.setdefault(mtp, layers[last])
    return layers


def resolve_tiers(cfg: EncodeConfig, spec: ModelSpec, keep: Mapping[int, Sequence[int]] | None) -> TierPlan | None:
    """Bits of each output expert per quantized layer (None: every expert at --bits). Depth and layers tiers follow
    from the model's structure, so a build plans them before any layer is observed; the others read the observations."""
    experts = len(next(iter(keep.values()))) if keep else spec.n_routed_experts
    if cfg.tier_plan is not None:
        where = str(cfg.tier_plan)
        plan = load_tier_plan(cfg.tier_plan, spec.moe_layers, experts)
    elif cfg.tiers is None:
        return None
    elif cfg.tiers.from_structure:
        where = f"--tiers {cfg.tiers.text}"
        plan = TierPlan(plan_structure_tiers(cfg.tiers, spec.moe_layers, experts), cfg.tiers.rest_bits)
    else:
        from glmquant.observe.tiers import write_tier_plan

        assert cfg.observations is not None  # EncodeConfig refuses --tiers without --observations
        quantized = {layer: experts for layer, experts in keep.items() if layer in spec.moe_layers} if keep else None
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        path = write_tier_plan(cfg.observations, cfg.tiers, quantized, cfg.state_dir / TIER_PLAN_NAME)
        where, plan = str(path), load_tier_plan(path, spec.moe_layers, experts)
    widths = {b for bits in plan.expert_bits.values() for b in bits}
    if cfg.layout == "tr3" and not widths <= set(TR3_TIER_BITS):
        raise UsageError(f"{where}: K{sorted(widths)} experts; the tr3 layout's tiers are K1 to K4")
    return plan
