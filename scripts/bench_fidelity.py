"""Fidelity of routed-expert recipes on the trained proxy, at equal routed bytes (issue 17).

For every recipe: encode the proxy's routed experts (observations of its calibration split), verify the artifact,
decode its experts into the BF16 proxy (everything else stays BF16, so only the experts differ; pruned experts
are never selected: their router correction bias is set to -1e4, which is what slicing the router does), and
compare next-token distributions with the BF16 proxy on held-out text that neither training nor calibration saw:
mean KL(BF16 || recipe) in nats, top-1 agreement (a fraction) and the recipe's perplexity. Every row states its
routed bytes (the EXL3 tensors of the routed experts), their ratio to the seed method's and whether it is at most
the seed's (1 % slack): pruning leaves a few % of scale vectors unspent, so those rows compete with fewer bytes.

Rows: the seed method (natural-routing Hessians, uniform K2 MCG); the seed method with the experts' stored scales
tuned together on their share of the calibration tokens' MoE output (`encode --tune-scales`, the same bytes);
tiers by layer at the seed's bytes, alone and tuned: K3 for the first MoE layers, K1 for the last, K2 between
(`encode --tiers depth:...`; tuned longer, on gate-weighted Hessians with MUL1, with 3INST), every other
byte-neutral allocation of K1-K4 by depth on a proxy of at most 8 MoE layers (the depth sweep, `depth-k<K per
layer>`, untuned, then each tuned), in any order of depth by each layer's KL at K1-K4 measured on calibration text
(`layer-cost`, an exact knapsack, `--tiers layers:...`), or ranked by the share of the residual stream their routed
output is (`share:...`);
gate-weighted natural Hessians (each routed token's rows weighted by its routing weight, observe
--hessian-weighting gate), alone and with MUL1; all-token Hessians; a 50/50 blend; the speed tier's retained
linears at K4-K6 (issue 18); REAP tiers at the seed's bytes (K3 or K4 for the most salient experts, K1 for the
least, K2 for the rest); REAP pruning with the freed bytes on K3; codebooks 3INST and MUL1; a quarter of the
calibration rows; uniform K3 and K4 as references above the seed's bytes; and ExLlamaV3 1.6.5's own converter on
the same proxy when `exllamav3` imports (its routed-expert tensors evaluated the same way; attention, shared experts
and head stay BF16 here too). The rows from codebook-mul1 on use the Hessians (natural, all-token or blend) that
gave the lowest KL among the seed, all-token and blend rows. The rows are listed (and measured) in this order:
the ones issues 17 and 18 wait on first.

    # H200, after scripts/train_proxy.py --out /tmp/proxy --device cuda:
    python scripts/bench_fidelity.py --proxy /tmp/proxy --device cuda --work /tmp/fidelity \
        --results bench/results/fidelity_proxy.json
    # CPU smoke (tests/proxy/test_bench_fidelity.py): a tiny proxy, the exllamav3 layout (no rank slices)
    python scripts/bench_fidelity.py --proxy /tmp/proxy-smoke --device cpu --layout exllamav3 --rows 4 \
        --tokens 32 --heldout-rows 2 --heldout-tokens 32 --work /tmp/fid --results /tmp/fid.json

The results are written after every row; `--resume` keeps the rows of an earlier run with the same proxy and
settings and measures only the missing and failed ones (the observations are reused), so the benchmark can span
several time-limited calls. A row that fails is recorded with its error; the others go on. `--jobs N` measures N
rows at once, each in a worker process with its own proxy (a row's encode and measurement leave the GPU idle much
of the time); the rows on the best Hessians wait for the three Hessian rows, and the file keeps the rows in the
order above whatever order they finish in. `summary` names the seed method's row, the best row at the seed's
bytes (lowest KL) and the ExLlamaV3 row, and checks the issue's goal (KL <= 0.7x the seed's, top-1 >= 3 points
higher, KL no worse than ExLlamaV3's).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from itertools import combinations_with_replacement, groupby
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_common import git_commit
from rich.console import Console

from glmquant.arch import PROJECTIONS, load_model_spec
from glmquant.checkpoint.exl3_groups import exl3_groups
from glmquant.checkpoint.layouts import RETAINED_BITS, layer_bits_text, parse_layer_bits, plan_artifact
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.encode import EncodeConfig, EncodeResult, encode_artifact
from glmquant.encode.draft_head import build_draft_head
from glmquant.encode.retained import encode_retained_file, retained_linears
from glmquant.exl3 import EXL3Tensor, decode_weight, proxy_error
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessian_reader import load_dense_hessian
from glmquant.observe.hessians import HessianMode, HessianWeighting
from glmquant.observe.layer_costs import LayerCosts, measure_layer_costs
from glmquant.observe.prune import write_prune_plan
from glmquant.observe.run import observe
from glmquant.observe.stats import LayerStats, stats_files
from glmquant.observe.tiers import TierSpec, allocate_layer_widths, plan_structure_tiers
from glmquant.observe.width_allocation import allocate_widths
from glmquant.proxy.train import split_rows
from glmquant.runtime.artifact import linear_module_paths, open_artifact

ROOT = Path(__file__).resolve().parents[1]
AT_SEED_BYTES = 1.01  # rows with at most this times the seed's routed bytes compete with it
PRUNED_BIAS = -1e4  # router correction bias of a pruned expert: never among the top-k
EXPERT_KEY = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")  # an EXL3 group's key
HESSIAN_ROWS = ("seed", "all-token", "blend-0.5")
ROUTED_KEY = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.\d+\.")
TUNE_STEPS = 50  # `encode --tune-scales` of the tuned rows (100 before the learning rate went from 2e-3 to 5e-3)
LONG_TUNE_STEPS = 400  # the row that asks whether TUNE_STEPS is enough
MTP_PROMPT_TOKENS = 128  # held-out prompt length of the MTP acceptance run (at most half a held-out row)
ESTIMATE_EXPERTS = 8  # --estimate-experts' default: experts per MoE layer `layer-cost-estimated` encodes at K1-K4
RETAINED_COST_BITS = (2, 3, 4, 5, 6)  # the K a decoder layer's retained linears may take in `retained-layer-cost-*`
SWEEP_BITS = (4, 3, 2, 1)  # the widths the depth sweep gives whole MoE layers
SWEEP_MAX_MOE_LAYERS = 8  # a proxy's few MoE layers are enumerated; a 42-layer model's allocations are not


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    hessians: str = "natural"  # natural | all | best (the best of HESSIAN_ROWS)
    blend: float | None = None
    codebook: str = "mcg"
    bits: int = 2
    tiers: str | None = None
    keep: int | None = None
    observations: str = "full"  # full | small (a quarter of the calibration rows) | gated (gate-weighted natural)
    reference: bool = False  # above the seed's bytes on purpose
    retained_bits: int | None = None  # the speed tier: retained linears EXL3 at this K (issue 18's KL cost)
    retained_exact_layers: int = 0  # but the first layers' retained linears exact (`encode --retained-exact-layers`)
    # or each decoder layer's K (`encode --retained-layer-bits`), here chosen from each layer's KL alone at
    # RETAINED_COST_BITS on calibration text, of least summed KL within uniform K`retained_budget_bits`'s retained
    # bytes ("layer-cost")
    retained_layer_bits: str | None = None
    retained_widths_from: str | None = None
    retained_budget_bits: int = 4
    retained_offered: tuple[int | None, ...] | None = None  # the widths "layer-cost" chooses among (None: all)
    head_bits: int | None = None  # and lm_head EXL3 at this K (`encode --head-bits`)
    tune_scales: int = 0  # Adam steps of `encode --tune-scales` on its observation's token sample
    # widths per MoE layer from each one's KL alone at K1-K4 on calibration text: "measured" from the four uniform
    # stocks, "estimated" by `glmquant layer-costs` from the K2 stock alone
    widths_from: str | None = None


def depth_allocations(moe_layers: int) -> list[tuple[int, ...]]:
    """Every K (of SWEEP_BITS) per MoE layer, non-increasing with depth, that spends the seed's bytes (K2 on
    average), uniform K2 apart; none past SWEEP_MAX_MOE_LAYERS."""
    if moe_layers > SWEEP_MAX_MOE_LAYERS:
        return []
    return [
        bits
        for bits in combinations_with_replacement(SWEEP_BITS, moe_layers)  # non-increasing, SWEEP_BITS' order
        if sum(bits) == 2 * moe_layers and set(bits) != {2}
    ]


def depth_spec(bits: Sequence[int]) -> str:
    """The `--tiers depth:...` spec that gives MoE layer i the width bits[i] (bits non-increasing)."""
    runs = [(k, len(list(group))) for k, group in groupby(bits)]
    return "depth:" + ",".join(f"K{k}={'rest' if i == len(runs) - 1 else n}" for i, (k, n) in enumerate(runs))


def recipes(experts: int, layers: int, moe_layers: int) -> list[Recipe]:
    """The benchmark's rows for a model of `layers` decoder layers, `moe_layers` of them MoE layers with `experts`
    routed experts each."""
    e4, e8 = experts // 4, experts // 8
    m3 = max(1, moe_layers // 3)  # layers moved to K3 (and as many to K1) by the tiers by layer
    by_depth, by_share = f"depth:K3={m3},K2=rest,K1={m3}", f"share:K3={m3},K2=rest,K1={m3}"
    exact = layers // 2  # the speed tier's exact first layers: on the proxy its layers 0-1 carry most of the K4 cost
    return [
        Recipe("seed", "seed method: natural-routing Hessians, uniform K2 MCG"),
        Recipe(
            "seed-tuned",
            f"the seed method, then the stored scales of each unit's experts tuned together on their share of the "
            f"calibration tokens' MoE output (encode --tune-scales {TUNE_STEPS}, codes fixed): the same bytes",
            tune_scales=TUNE_STEPS,
        ),
        Recipe(
            f"seed-tuned-{LONG_TUNE_STEPS}",
            f"seed-tuned with {LONG_TUNE_STEPS} Adam steps instead of {TUNE_STEPS} (the held-out sample still picks "
            "the step kept): whether the tuning has converged",
            tune_scales=LONG_TUNE_STEPS,
        ),
        Recipe(
            "depth-tiers",
            f"tiers by layer: K3 for the first {m3} MoE layer(s), K1 for the last {m3}, K2 between (encode --tiers "
            f"{by_depth}): the seed's bytes",
            tiers=by_depth,
        ),
        Recipe(
            "depth-tiers-tuned",
            f"depth-tiers, then its experts' scales tuned as seed-tuned's (encode --tune-scales {TUNE_STEPS})",
            tiers=by_depth,
            tune_scales=TUNE_STEPS,
        ),
        Recipe(
            f"depth-tiers-tuned-{LONG_TUNE_STEPS}",
            f"depth-tiers-tuned with {LONG_TUNE_STEPS} Adam steps instead of {TUNE_STEPS}: whether its first MoE "
            "layer's K3 experts, most of what is left of its KL, gain from a longer tuning",
            tiers=by_depth,
            tune_scales=LONG_TUNE_STEPS,
        ),
        Recipe(
            "depth-tiers-gated-mul1-tuned",
            "depth-tiers-tuned on gate-weighted natural Hessians with the MUL1 codebook (gate-weighted-mul1-tuned, "
            "the best uniform-K2 row of the eighteenth session's table, by depth)",
            codebook="mul1",
            observations="gated",
            tiers=by_depth,
            tune_scales=TUNE_STEPS,
        ),
        Recipe(
            "depth-tiers-3inst-tuned",
            "depth-tiers-tuned with the 3INST codebook",
            codebook="3inst",
            tiers=by_depth,
            tune_scales=TUNE_STEPS,
        ),
        *(
            Recipe(
                "depth-k" + "".join(map(str, bits)) + ("-tuned" if tune else ""),
                f"the depth sweep: MoE layers at K{', K'.join(map(str, bits))} from the first (encode --tiers "
                f"{depth_spec(bits)}): which byte-neutral allocation by depth is best, "
                + (f"its scales tuned as seed-tuned's (encode --tune-scales {TUNE_STEPS})" if tune else "untuned"),
                tiers=depth_spec(bits),
                tune_scales=TUNE_STEPS if tune else 0,
            )
            for tune in (False, True)  # the untuned sweep first: a tuned row is for the allocations it ranks best
            for bits in depth_allocations(moe_layers)
            if depth_spec(bits) != depth_spec([3] * m3 + [2] * (moe_layers - 2 * m3) + [1] * m3)  # depth-tiers' own
        ),
        Recipe(
            "layer-cost",
            "widths per MoE layer from each layer's own KL at K1-K4 (the other layers BF16), measured on calibration "
            "text with the uniform stocks' experts: the allocation of least summed KL at the seed's bytes "
            "(allocate_layer_widths, then encode --tiers layers:...), in any order of depth",
            widths_from="measured",
        ),
        Recipe(
            "layer-cost-estimated",
            "layer-cost with its costs estimated as `glmquant layer-costs` does from the seed's build alone: each MoE "
            "layer's KL alone at K2, scaled to K1-K4 by --estimate-experts sampled experts' output errors "
            f"(`layer-costs --experts`; default {ESTIMATE_EXPERTS})",
            widths_from="estimated",
        ),
        Recipe(
            "layer-cost-tuned",
            f"layer-cost's widths (from the untuned costs), its scales tuned as seed-tuned's (encode --tune-scales "
            f"{TUNE_STEPS})",
            widths_from="measured",
            tune_scales=TUNE_STEPS,
        ),
        Recipe(
            "layer-tiers",
            f"tiers by layer: K3 for the {m3} MoE layer(s) whose routed output is the largest share of their residual "
            f"stream, K1 for the {m3} with the smallest, K2 for the rest (encode --tiers {by_share}): the seed's bytes",
            tiers=by_share,
        ),
        Recipe(
            "layer-tiers-tuned",
            f"layer-tiers, then its experts' scales tuned as seed-tuned's (encode --tune-scales {TUNE_STEPS})",
            tiers=by_share,
            tune_scales=TUNE_STEPS,
        ),
        Recipe(
            "gate-weighted",
            "natural Hessians with each routed token weighted by its gate (Σ ĝ² x xᵀ), uniform K2",
            observations="gated",
        ),
        Recipe("all-token", "all-token Hessians (ExLlamaV3's convention), uniform K2", hessians="all"),
        Recipe("blend-0.5", "Hessians 0.5 natural + 0.5 all-token, uniform K2", blend=0.5),
        Recipe(
            "gate-weighted-mul1",
            "gate-weighted natural Hessians, uniform K2, MUL1 codebook",
            codebook="mul1",
            observations="gated",
        ),
        Recipe(
            "gate-weighted-mul1-tuned",
            f"gate-weighted-mul1, then its scales tuned as seed-tuned's (encode --tune-scales {TUNE_STEPS}): the "
            "same bytes",
            codebook="mul1",
            observations="gated",
            tune_scales=TUNE_STEPS,
        ),
        *(
            Recipe(
                f"retained-k{k}",
                f"the speed tier (issue 18): the seed's experts, and the retained linears EXL3 K{k} with their "
                "dense Hessians; kl_cost_ratio = KL of the retained linears alone over the seed's (experts') KL",
                retained_bits=k,
            )
            for k in (4, 5, 6)
        ),
        Recipe(
            "retained-k4-head5",
            "the speed tier as the H200 benchmark runs it (issue 18): retained-k4 with lm_head EXL3 K5 and its "
            "Hessian; kl_cost_ratio = KL of the retained linears and the head alone over the seed's KL",
            retained_bits=4,
            head_bits=5,
        ),
        Recipe(
            f"retained-k4-head5-exact{exact}",
            f"retained-k4-head5 with the retained linears of the first {exact} decoder layers exact (encode "
            "--retained-exact-layers), where the proxy's K4 cost sits (docs/fidelity.md)",
            retained_bits=4,
            head_bits=5,
            retained_exact_layers=exact,
        ),
        Recipe(
            "retained-layer-cost-head5",
            f"the speed tier with a K per decoder layer (encode --retained-layer-bits): each layer's retained linears "
            f"alone at K{min(RETAINED_COST_BITS)}-K{max(RETAINED_COST_BITS)} or exact, their KL measured on "
            "calibration text, the widths of least summed KL within uniform K4's retained bytes (allocate_widths); "
            "lm_head K5: retained-k4-head5's bytes",
            head_bits=5,
            retained_widths_from="layer-cost",
        ),
        *(
            Recipe(
                f"retained-layer-cost-k{budget}-head5",
                f"retained-layer-cost-head5 within uniform K{budget}'s retained bytes: {why}",
                head_bits=5,
                retained_widths_from="layer-cost",
                retained_budget_bits=budget,
            )
            for budget, why in (
                (
                    3,
                    "on GLM-5.3-Flash the speed tier needs about that few to project 30 tok/s on a GB10",
                ),
                (5, "the KL cost one bit wider buys, and its bytes"),
                (6, "the KL cost two bits wider buy: where the goal of a KL cost <= 0.1 is met, and at what bytes"),
            )
        ),
        Recipe(
            "retained-layer-cost-k3-gemv-head5",
            "retained-layer-cost-k3-head5 with K2, K4 and exact offered alone (retained-costs --widths K2,K4,exact): "
            "the K the GEMV core runs, whose widths within K3's bytes project 32.17 tok/s on a GB10 where uniform K3's "
            "small-job core gives 27.54 (docs/encode.md)",
            head_bits=5,
            retained_widths_from="layer-cost",
            retained_budget_bits=3,
            retained_offered=(2, 4, None),
        ),
        Recipe(
            f"retained-k5-head6-exact{exact}",
            f"retained-k4-head5-exact{exact} one bit wider (retained linears K5, lm_head K6): what the goal of a KL "
            "cost <= 0.1 costs in bytes",
            retained_bits=5,
            head_bits=6,
            retained_exact_layers=exact,
        ),
        Recipe(
            "codebook-mul1",
            "the best Hessians, uniform K2, MUL1 codebook (ExLlamaV3's default)",
            "best",
            codebook="mul1",
        ),
        Recipe(
            "tiers-k3-k1",
            f"REAP tiers: K3 for the {e4} most salient experts, K1 for the {e4} least, K2 rest",
            "best",
            tiers=f"reap:K3={e4},K2=rest,K1={e4}",
        ),
        Recipe(
            "tiers-k4-k1",
            f"REAP tiers: K4 for the {e8} most salient, K1 for the {e4} least, K2 rest",
            "best",
            tiers=f"reap:K4={e8},K2=rest,K1={2 * e8}",
        ),
        Recipe(
            "prune25-k3",
            f"REAP pruning 25 % (keep {experts - e4}), freed bytes on K3 for the {2 * e4} most salient kept",
            "best",
            keep=experts - e4,
            tiers=f"reap:K3={2 * e4},K2=rest",
        ),
        Recipe(
            "uniform-k4",
            "reference above the seed's bytes: the best Hessians, uniform K4",
            "best",
            bits=4,
            reference=True,
        ),
        Recipe(
            "tiers-k3-k1-narrow",
            f"REAP tiers: K3 for the {e8} most salient, K1 for the {e8} least, K2 rest",
            "best",
            tiers=f"reap:K3={e8},K2=rest,K1={e8}",
        ),
        Recipe(
            "prune12-k3",
            f"REAP pruning 12.5 % (keep {experts - e8}), freed bytes on K3 for the {e4} most salient kept",
            "best",
            keep=experts - e8,
            tiers=f"reap:K3={e4},K2=rest",
        ),
        Recipe(
            "uniform-k3",
            "reference above the seed's bytes: the best Hessians, uniform K3",
            "best",
            bits=3,
            reference=True,
        ),
        Recipe(
            "calibration-quarter",
            "the best Hessians, uniform K2, a quarter of the calibration rows",
            "best",
            observations="small",
        ),
        Recipe("codebook-3inst", "the best Hessians, uniform K2, 3INST codebook", "best", codebook="3inst"),
    ]


class PatchedProxy:
    """The BF16 proxy in memory, whose routed experts can be replaced by decoded ones and restored."""

    def __init__(self, model_dir: Path, device: str) -> None:
        from transformers import Glm5NextForConditionalGeneration

        model: Any = Glm5NextForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16)
        self.model = model.to(device).eval()
        self.layers = {
            i: layer.mlp
            for i, layer in enumerate(self.model.model.language_model.layers)
            if hasattr(layer.mlp, "experts")
        }
        self.original = {
            i: (
                m.experts.gate_up_proj.detach().clone(),
                m.experts.down_proj.detach().clone(),
                m.gate.e_score_correction_bias.detach().clone(),
            )
            for i, m in self.layers.items()
        }

        self.linears: dict[str, torch.Tensor] = {}  # originals of the linears a speed-tier row replaced

    @torch.no_grad()
    def set_experts(
        self,
        experts: dict[tuple[int, int], dict[str, torch.Tensor]],
        pruned: dict[int, list[int]],
        linears: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """experts[(layer, source expert)][proj] = HF (out, in) weight; pruned[layer] = source experts dropped;
        linears[parameter name] = a retained linear's weight."""
        self.restore()
        for name, weight in (linears or {}).items():
            param = self.model.get_parameter(name)
            self.linears[name] = param.detach().clone()
            param.copy_(weight.to(param))
        for (layer, e), w in experts.items():
            mlp = self.layers[layer]
            mlp.experts.gate_up_proj[e] = torch.cat((w["gate_proj"], w["up_proj"])).to(mlp.experts.gate_up_proj)
            mlp.experts.down_proj[e] = w["down_proj"].to(mlp.experts.down_proj)
        for layer, dropped in pruned.items():
            self.layers[layer].gate.e_score_correction_bias[dropped] = PRUNED_BIAS

    @torch.no_grad()
    def restore(self) -> None:
        for name, weight in self.linears.items():
            self.model.get_parameter(name).copy_(weight)
        self.linears.clear()
        for i, (gate_up, down, bias) in self.original.items():
            m = self.layers[i]
            m.experts.gate_up_proj.copy_(gate_up)
            m.experts.down_proj.copy_(down)
            m.gate.e_score_correction_bias.copy_(bias)

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """[rows, tokens, vocab] float32 next-token log-probabilities."""
        device = next(self.model.parameters()).device
        return torch.cat(
            [F.log_softmax(self.model(input_ids=row[None].to(device)).logits.float(), dim=-1) for row in ids]
        )


def compare(reference: torch.Tensor, got: torch.Tensor, ids: torch.Tensor) -> dict[str, float]:
    """Mean KL(reference || got) over positions, top-1 agreement, and got's perplexity on the next tokens."""
    kl = (reference.exp() * (reference - got)).sum(-1)
    top1 = (reference.argmax(-1) == got.argmax(-1)).float()
    targets = ids[:, 1:].to(got.device).unsqueeze(-1)
    nll = -got[:, :-1].gather(-1, targets).double().mean()  # float64: rows a few ulps apart stay apart
    return {"kl": float(kl.mean()), "top1": float(top1.mean()), "ppl": math.exp(float(nll))}


def routed_bytes_by_layer(artifact: Path) -> dict[int, tuple[int, int]]:
    """MoE layer -> (bytes of its routed-expert EXL3 tensors, of their trellises) from the headers."""
    with SourceCheckpoint.open(artifact) as ckpt:
        specs = [ckpt.spec(n) for n in ckpt.names()]
    out: dict[int, tuple[int, int]] = {}
    for key, group in exl3_groups(specs).items():
        found = ROUTED_KEY.search(key + ".")  # not retained linears
        if found is None:
            continue
        layer = int(found.group(1))
        total, trellis = out.get(layer, (0, 0))
        out[layer] = (
            total + sum(p.nbytes for p in group.parts.values()),
            trellis + (group.parts["trellis"].nbytes if "trellis" in group.parts else 0),
        )
    return out


def routed_bytes(by_layer: dict[int, tuple[int, int]], spec: Any) -> tuple[int, float]:
    """(bytes of every routed-expert EXL3 tensor, trellis bits per routed weight) of routed_bytes_by_layer's."""
    weights = len(spec.moe_layers) * spec.n_routed_experts * 3 * spec.hidden_size * spec.moe_intermediate_size
    total = sum(t for t, _ in by_layer.values())
    return total, round(8 * sum(t for _, t in by_layer.values()) / weights, 4)


def artifact_experts(
    artifact: Path,
    keep: dict[int, list[int]] | None,
    source_experts: int,
    device: str,
    layers: Collection[int] | None = None,
) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict[int, list[int]]]:
    """Decoded routed experts of an artifact by (layer, source expert), decoded on `device`, and the source
    experts it dropped; only those of `layers` when given."""
    art = open_artifact(artifact)
    out, pruned = {}, {}
    for layer in art.quantized_layers:
        if layers is not None and layer not in layers:
            continue
        kept = keep[layer] if keep else list(range(source_experts))
        for new_id, source_id in enumerate(kept):
            out[(layer, source_id)] = {p: art.decode_expert(layer, new_id, p, device=device) for p in PROJECTIONS}
        if keep:
            pruned[layer] = sorted(set(range(source_experts)) - set(kept))
    art.checkpoint.close()
    return out, pruned


def composable(recipe: Recipe) -> bool:
    """Whether --compose-layers measures the row from uniform stocks: uniform, `depth:` or `layers:` widths, every
    expert kept (a speed-tier row's retained linears are encoded beside the stocks' experts)."""
    whole_layers = recipe.tiers is None or TierSpec.parse(recipe.tiers).from_structure
    return whole_layers and recipe.keep is None


def experts_only(recipe: Recipe) -> Recipe:
    """The recipe without the speed tier's retained linears and head: what its routed experts are encoded with."""
    return replace(
        recipe,
        retained_bits=None,
        retained_exact_layers=0,
        retained_layer_bits=None,
        retained_widths_from=None,
        retained_offered=None,
        head_bits=None,
    )


def retained_tier(recipe: Recipe) -> bool:
    """Whether the recipe is the speed tier's: retained linears or lm_head EXL3 (issue 18)."""
    retained = (recipe.retained_bits, recipe.retained_layer_bits, recipe.retained_widths_from, recipe.head_bits)
    return any(v is not None for v in retained) or recipe.retained_exact_layers > 0


def tuning_by_layer(result: EncodeResult) -> dict[str, dict[str, Any]]:
    """How far `encode --tune-scales` went, by MoE layer: whether its steps were enough."""
    return {
        str(layer.layer): {
            "heldout_ratio": layer.tuned_ratio,
            "best_steps": [u["best_step"] for u in layer.tuning or []],
            "heldout_by_step": [u["heldout_by_step"] for u in layer.tuning or []],
        }
        for layer in result.layers
    }


@dataclass(frozen=True)
class DecodedLinear:
    """A speed-tier retained linear (or head) decoded from the artifact: its weight (HF layout, float32), role and
    source."""

    weight: torch.Tensor
    role: str
    layer: int | None  # None: lm_head (`--head-bits`)
    source: str  # checkpoint weight name (its dense Hessian's key)
    nbytes: int  # its stored EXL3 tensors' bytes


def artifact_linears(artifact: Path, device: str) -> tuple[dict[str, DecodedLinear], int, int]:
    """Decoded retained linears of a speed-tier artifact by the transformers model's parameter name (the MTP
    layer's left out: the KL is measured without it), their EXL3 bytes and their BF16 bytes."""
    art = open_artifact(artifact)
    out, exl3_bytes, bf16_bytes = {}, 0, 0
    for name, linear in art.retained_linear_modules().items():
        if linear.layer in art.spec.mtp_layers:
            continue
        tensor = art.read_linear(linear, device)
        weight = decode_weight(tensor, torch.float32)
        nbytes = sum(t.numel() * t.element_size() for t in tensor.tensors(linear.key).values())
        out[f"{name}.weight"] = DecodedLinear(weight, linear.role.value, linear.layer, linear.source, nbytes)
        exl3_bytes += nbytes
        bf16_bytes += 2 * linear.in_features * linear.out_features
    art.checkpoint.close()
    return out, exl3_bytes, bf16_bytes


def weight_error_by_role(
    decoded: dict[str, DecodedLinear], original: dict[str, torch.Tensor], observations: Path
) -> dict[str, float]:
    """Per role, the mean over its linears of the Hessian-weighted relative error tr(E H Eᵀ) / tr(W H Wᵀ) (E the
    decoded weight minus the original, H the linear's dense Hessian): what the encoder minimises, so a role whose
    KL does not fall with K while this does is sensitive, not badly encoded."""
    errors: dict[str, list[float]] = {}
    for name, linear in decoded.items():
        h = load_dense_hessian(observations, linear.layer, linear.source).sum
        errors.setdefault(linear.role, []).append(proxy_error(original[name], linear.weight, h))
    return {role: sum(v) / len(v) for role, v in sorted(errors.items())}


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where `tokens` and `reference` differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def mtp_acceptance(
    artifact: Path, prompts: torch.Tensor, new_tokens: int, device: str, draft_head: Path | None = None
) -> dict[str, Any]:
    """Greedy speculative decoding of `prompts` [N, T] with the artifact's own MTP layer drafting k = 1..3 tokens
    (its drafts reading `draft_head`'s lm_head where one is given: `glmquant draft-head`)
    on the runtime's engine (EngineMtpDecoder, what `serve --speculative-config` runs; CUDA graphs on CUDA):
    acceptance rate, tokens per verify step (accepted + 1) and whether every output equals the engine's plain
    greedy decoding (else each prompt's first differing token), the figures issue 18's MTP speedup projection
    takes (docs/speculative.md). On CUDA the figures are BF16's (the served dtype), where an accepted draft's
    next token comes from a verify row whose sums round differently from a one-token step's; a float32 run
    beside them (`float32`) checks exactness, as the GPU test does."""
    from glmquant.runtime.artifact import open_artifact
    from glmquant.runtime.engine import Engine, EngineDecoder
    from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder
    from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
    from glmquant.runtime.options import RuntimeOptions
    from glmquant.runtime.speculative import MAX_SPECULATIVE_TOKENS, SpecStats

    def no_text(_ids: Any) -> str:
        return ""

    def speculate(dtype: str) -> dict[str, Any]:
        options = RuntimeOptions(device=device, dtype=dtype, backend=backend, model_impl="glmquant")
        max_len = prompts.shape[1] + new_tokens + MAX_SPECULATIVE_TOKENS
        engine = Engine.load(open_artifact(artifact), options, max_len=max_len, mtp=True, draft_head=draft_head)
        params = SamplingParams(max_tokens=new_tokens)
        plain = [generate(EngineDecoder(engine), PromptInputs(row[None]), params, no_text).token_ids for row in prompts]
        out: dict[str, Any] = {"runtime": f"engine ({dtype}, {backend})"}
        for k in (1, 2, 3):
            total, differences = SpecStats(), []
            for row, reference in zip(prompts, plain):
                run = generate(EngineMtpDecoder(engine, k), PromptInputs(row[None]), params, no_text)
                differences.append(first_difference(run.token_ids, reference))
                assert run.speculative is not None  # greedy decoding with a speculative decoder
                total.steps += run.speculative.steps
                total.drafted += run.speculative.drafted
                total.accepted += run.speculative.accepted
            out[f"k{k}"] = {
                "acceptance_rate": round(total.acceptance_rate, 4),
                "tokens_per_step": round(total.tokens_per_step, 4),
                "verify_steps": total.steps,
                "equals_plain_greedy": all(d is None for d in differences),
                "first_difference": differences,
            }
        return out

    on_cuda = torch.device(device).type == "cuda"
    backend = "triton" if on_cuda else "torch"
    out = {
        "artifact": artifact.name,
        "prompts": prompts.shape[0],
        "prompt_tokens": prompts.shape[1],
        "new_tokens": new_tokens,
        "draft_head": None if draft_head is None else draft_head.name,
        **speculate("bfloat16" if on_cuda else "float32"),
    }
    if on_cuda:
        out["float32"] = speculate("float32")
    return out


def exllamav3_experts(
    out_dir: Path, layers: Collection[int], experts: int
) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], int, list[int], int]:
    """Decoded routed experts of an ExLlamaV3-converted model by (layer, expert) for the given `layers`, their EXL3
    bytes and widths, and the bytes of experts in other layers: ExLlamaV3 quantizes the MTP layer's experts too
    (layer num_hidden_layers), which the proxy's forward never runs and our rows leave out of their bytes. Every
    projection of the `experts` routed experts of each of `layers` must be there: one left BF16 would flatter it."""
    found: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    nbytes, other_bytes, widths = 0, 0, set()
    with SourceCheckpoint.open(out_dir) as ckpt:
        # grouped and sized from the headers as `routed_bytes` sizes our rows' experts
        for key, group in exl3_groups(ckpt.spec(n) for n in ckpt.names()).items():
            m = EXPERT_KEY.search(key)
            if m is None or "trellis" not in group.parts:
                continue
            size = sum(spec.nbytes for spec in group.parts.values())
            if int(m[1]) not in layers:
                other_bytes += size
                continue
            parts = {spec.name: ckpt.read_tensor(spec.name) for spec in group.parts.values()}
            t = parts[f"{key}.trellis"]
            tensor = EXL3Tensor.from_tensors(parts, key, t.shape[0] * 16, t.shape[1] * 16)
            found.setdefault((int(m[1]), int(m[2])), {})[m[3]] = decode_weight(tensor, torch.float32)
            nbytes += size
            widths.add(tensor.bits)
    missing = [
        f"layers.{layer}.mlp.experts.{e}.{proj}"
        for layer in sorted(layers)
        for e in range(experts)
        for proj in PROJECTIONS
        if proj not in found.get((layer, e), {})
    ]
    if missing:
        raise RuntimeError(
            f"{out_dir}: {len(missing)} routed expert projections have no EXL3 tensors (…trellis), e.g. {missing[0]}"
        )
    return found, nbytes, sorted(widths), other_bytes


def convert_with_exllamav3(model_dir: Path, out_dir: Path, work_dir: Path, rows: int, tokens: int, log: Path) -> None:
    """ExLlamaV3's converter in its own process (it prints a lot and may exit): -b 2.0, MCG, head unquantized. Its
    output streams to `log`, so a call that ends mid-conversion still shows how far it got."""
    args = [
        "-i",
        str(model_dir),
        "-o",
        str(out_dir),
        "-w",
        str(work_dir),
        "-b",
        "2.0",
        "-hb",
        "16",
        "-cb",
        "mcg",
        "-cr",
        str(rows),
        "-cc",
        str(tokens),
    ]
    code = (  # the import is timed: on the H200 the converter printed nothing in 7 minutes (an import that hangs?)
        "import sys, time; t0 = time.monotonic(); print('importing exllamav3', flush=True)\n"
        "from exllamav3.conversion.convert_model import parser, prepare, main\n"
        "print(f'imported exllamav3 in {time.monotonic() - t0:.1f} s', flush=True)\n"
        "a, s, ok, err = prepare(parser.parse_args(sys.argv[1:]))\n"
        "sys.exit(err) if not ok else main(a, s)"
    )
    with log.open("w") as sink:
        run = subprocess.run([sys.executable, "-u", "-c", code, *args], stdout=sink, stderr=subprocess.STDOUT)
    if run.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"ExLlamaV3's converter failed ({run.returncode}; {log}): {tail}")


@dataclass(frozen=True)
class Task:
    """One row to measure: a recipe with the Hessians it uses, or (recipe None) ExLlamaV3's converter."""

    recipe: Recipe | None
    hessians: str = "natural"
    blend: float | None = None


class Evaluator:
    """One process's measuring state: the held-out ids, the BF16 proxy (patched per row) and its reference
    log-probabilities. Every worker of --jobs holds its own; the parent only schedules and records."""

    def __init__(self, args: argparse.Namespace, observations: dict[str, Path]) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.work: Path = args.work
        self.model_dir = args.proxy / "model"
        self.spec = load_model_spec(self.model_dir / "config.json")
        self.observations = observations
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.ids = split_rows(args.proxy / "corpus", "heldout", args.heldout_rows, args.heldout_tokens, self.tokenizer)
        self.proxy = PatchedProxy(self.model_dir, args.device)
        bf16_logprobs = self.proxy.logprobs(self.ids)
        self.bf16_compute: dict[str, float] | None = None
        if args.compute_dtype == "float32":
            # the same weights computed in float32: the checkpoint's function without BF16 rounding, whose own
            # distance from it (bf16_compute) is noise any change of weights reshuffles (docs/fidelity.md)
            self.proxy.model.float()
            self.reference = self.proxy.logprobs(self.ids)
            floor = compare(self.reference, bf16_logprobs, self.ids)
            self.bf16_compute = {k: v for k, v in floor.items() if k != "ppl"}
        else:
            self.reference = bf16_logprobs
        targets = self.ids[:, 1:].to(self.reference.device).unsqueeze(-1)
        self.bf16_ppl = math.exp(float(-self.reference[:, :-1].gather(-1, targets).mean()))
        # the floor of every row's figures: the unchanged proxy measured again (nonzero where kernels are not
        # deterministic, e.g. atomics, or a routing tie that falls the other way)
        self.bf16_repeat = {k: v for k, v in self.measure({}, {}).items() if k != "ppl"}

    def run(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the row, extras for the record: the BF16 perplexity, and the seed row's MTP acceptance)."""
        extras: dict[str, Any] = {
            "bf16_ppl": self.bf16_ppl,
            "bf16_repeat": self.bf16_repeat,
            "bf16_compute": self.bf16_compute,
        }
        if task.recipe is None:
            return self.exllamav3_row(), extras
        return self.row(task.recipe, task.hessians, task.blend, extras), extras

    def draft_head(self, recipe: Recipe) -> Path | None:
        """With --mtp-draft-head-bits K: a K copy of the proxy's lm_head (`glmquant draft-head`, the recipe's
        observations) in the work directory, which the MTP acceptance run's drafts read; with --mtp-draft-mtp-bits M
        also an M copy of its MTP layer (routed experts K2: `draft-head --mtp-bits M`)."""
        bits, mtp_bits = self.args.mtp_draft_head_bits, self.args.mtp_draft_mtp_bits
        if bits is None:
            return None
        path = self.work / f"draft_head_k{bits}{'' if mtp_bits is None else f'_mtp{mtp_bits}'}.safetensors"
        obs = self.observations[recipe.observations]
        build_draft_head(self.model_dir, obs, path, bits, device=self.args.device, mtp_bits=mtp_bits)
        return path

    def encode(self, recipe: Recipe, hessians: str, blend: float | None, out: Path) -> tuple[EncodeResult, Path | None]:
        """`recipe`'s artifact encoded into `out` (anything there first removed), and its prune plan if it prunes."""
        obs = self.observations[recipe.observations]
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(out.with_name(out.name + ".work"), ignore_errors=True)
        plan = None
        if recipe.keep is not None:
            plan = write_prune_plan(obs, recipe.keep, self.work / f"prune-{recipe.name}.json")
        cfg = EncodeConfig(
            source=self.model_dir,
            out=out,
            observations=obs,
            bits=recipe.bits,
            codebook=recipe.codebook,
            layout=self.args.layout,
            hessians=hessians,  # type: ignore[arg-type]  # EncodeConfig parses the text
            blend=blend,
            prune_plan=plan,
            tiers=recipe.tiers,  # type: ignore[arg-type]  # parsed by EncodeConfig too
            retained_bits=recipe.retained_bits,
            retained_exact_layers=recipe.retained_exact_layers,
            retained_layer_bits=recipe.retained_layer_bits,  # type: ignore[arg-type]  # parsed by EncodeConfig
            head_bits=recipe.head_bits,
            tune_scales=recipe.tune_scales,
            device=self.args.device,
            verified_at="2026-01-01T00:00:00Z",
        )
        result = encode_artifact(cfg, Console(quiet=True))
        assert result is not None  # one process: it writes the artifact
        return result, plan

    def stock(
        self, recipe: Recipe, hessians: str, blend: float | None, bits: int, wait: bool
    ) -> tuple[Path, dict[str, Any]] | None:
        """The uniform-K`bits` artifact with `recipe`'s other settings (--compose-layers), encoded once into
        WORK/stocks and kept: its directory and record (manifest, seconds, each layer's routed bytes and tuning).
        A lock keeps two workers from building it at once: a second one waits, or with `wait` False gets None."""
        uniform = replace(experts_only(recipe), bits=bits, tiers=None)
        name = (
            f"k{bits}-{recipe.codebook}-{hessians}{'' if blend is None else blend}-{recipe.observations}"
            f"-tune{recipe.tune_scales}-{self.args.layout}-{self.args.device}"
        )
        out = self.work / "stocks" / name
        record_path = out.with_name(name + ".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        # what the name leaves out: a stock of another proxy or calibration in the same WORK is built again
        calibration = [self.args.rows, self.args.tokens, self.args.batch_rows]
        settings = {"proxy": _proxy_facts(self.args.proxy), "calibration": calibration}
        with open(out.with_name(name + ".lock"), "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # another worker is building it
            if record_path.is_file():
                record = json.loads(record_path.read_text())
                if record.get("settings") == settings:
                    return out, record
                record_path.unlink()
            t0 = time.monotonic()
            result, _ = self.encode(uniform, hessians, blend, out)
            record = {
                "settings": settings,
                "manifest_sha256": result.artifact.manifest_sha256,
                "encode_seconds": round(time.monotonic() - t0, 1),
                "routed_bytes_by_layer": {str(k): list(v) for k, v in routed_bytes_by_layer(out).items()},
                "tuning_by_layer": tuning_by_layer(result) if recipe.tune_scales else None,
            }
            atomic_write_text(record_path, json.dumps(record, indent=2) + "\n")  # last: then the stock is whole
            shutil.rmtree(out.with_name(out.name + ".work"), ignore_errors=True)  # its job's unit files
            return out, record | {"built_here": True}

    def stocks(
        self, recipe: Recipe, hessians: str, blend: float | None, widths: Collection[int]
    ) -> dict[int, tuple[Path, dict[str, Any]]]:
        """The stocks of `widths` for `recipe`'s settings, by K: first those no other worker is building, then it
        waits for those."""
        stocks: dict[int, tuple[Path, dict[str, Any]]] = {}
        for blocking in (False, True):
            for k in sorted(set(widths) - stocks.keys()):
                got = self.stock(recipe, hessians, blend, k, blocking)
                if got is not None:
                    stocks[k] = got
        return dict(sorted(stocks.items()))  # the same order whichever worker built which

    def composed(
        self, recipe: Recipe, hessians: str, blend: float | None
    ) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]], dict[int, tuple[int, int]], dict[str, Any], Path]:
        """A uniform, `depth:` or `layers:` row from the stocks (--compose-layers): each MoE layer's decoded experts,
        routed bytes and tuning taken from the uniform artifact of its width (and that artifact, for a uniform row;
        else the first layer's). The same as encoding the row, since an untuned or tuned layer's encode sees only its
        own weights, Hessians and calibration sample."""
        moe = list(self.spec.moe_layers)
        if recipe.tiers is None:
            width = dict.fromkeys(moe, recipe.bits)
        else:  # the encoder's own assignment of a depth or layers spec's widths to the MoE layers
            width = {layer: k for layer, (k,) in plan_structure_tiers(TierSpec.parse(recipe.tiers), moe, 1).items()}
        experts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        t0 = time.monotonic()
        stocks = self.stocks(recipe, hessians, blend, set(width.values()))
        stock_seconds = time.monotonic() - t0  # building them, or waiting for another worker's
        for k, (path, _) in stocks.items():
            layers = [layer for layer in moe if width[layer] == k]
            experts |= artifact_experts(path, None, self.spec.n_routed_experts, self.args.device, layers)[0]
        by_layer = {layer: tuple(stocks[k][1]["routed_bytes_by_layer"][str(layer)]) for layer, k in width.items()}
        facts: dict[str, Any] = {
            "composed_from": {str(layer): f"k{k}" for layer, k in width.items()},
            "stock_manifests": {f"k{k}": r["manifest_sha256"] for k, (_, r) in stocks.items()},
            "stock_encode_seconds": {f"k{k}": r["encode_seconds"] for k, (_, r) in stocks.items()},
            "stocks_built_here": sorted(f"k{k}" for k, (_, r) in stocks.items() if r.get("built_here")),
            "stock_seconds": round(stock_seconds, 1),
        }
        if recipe.tune_scales:
            facts["tuning_by_layer"] = {
                str(layer): stocks[k][1]["tuning_by_layer"][str(layer)] for layer, k in width.items()
            }
        return experts, by_layer, facts, stocks[width[moe[0]]][0]

    def layer_costs(self, recipe: Recipe, hessians: str, blend: float | None) -> dict[int, dict[int, float]]:
        """Each MoE layer's KL alone (the others BF16) at each K of SWEEP_BITS, on the first --heldout-rows x
        --heldout-tokens of the calibration split: from the untuned uniform stocks of `recipe`'s settings, measured
        once per settings and kept in WORK (under a lock, as the stocks are)."""
        stocks = self.stocks(replace(recipe, tune_scales=0), hessians, blend, SWEEP_BITS)
        name = f"layer-costs-{recipe.codebook}-{hessians}{'' if blend is None else blend}-{recipe.observations}"
        path = self.work / "stocks" / f"{name}-{self.args.layout}-{self.args.device}.json"
        settings = {
            "stock_manifests": {f"k{k}": record["manifest_sha256"] for k, (_, record) in stocks.items()},
            "text": ["calibration", self.args.heldout_rows, self.args.heldout_tokens],
            "compute_dtype": self.args.compute_dtype,
        }

        def measure() -> dict[str, Any]:
            text = self.calibration_text()
            measured: dict[int, dict[int, float]] = {layer: {} for layer in self.spec.moe_layers}
            for k, (stock, _) in stocks.items():
                decoded = artifact_experts(stock, None, self.spec.n_routed_experts, self.args.device)[0]
                for layer in self.spec.moe_layers:
                    alone = {key: w for key, w in decoded.items() if key[0] == layer}
                    measured[layer][k] = self.measure(alone, {}, text=text)["kl"]
            return {"kl_by_layer_and_k": measured}

        kept = self.kept_measurement(path, settings, measure)
        return {int(layer): {int(k): v for k, v in by_k.items()} for layer, by_k in kept["kl_by_layer_and_k"].items()}

    def kept_measurement(
        self,
        path: Path,
        settings: dict[str, Any],
        measure: Callable[[], dict[str, Any]],
        complete: Callable[[dict[str, Any]], bool] = lambda kept: False,
    ) -> dict[str, Any]:
        """`measure()`'s result kept at `path` in WORK beside the `settings` it was measured at, measured again only
        where they differ, else `complete(kept)` adding what it lacks in place (True: something added); a lock keeps
        two workers from measuring it at once."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kept = json.loads(path.read_text()) if path.is_file() else {}
            if kept.get("settings") != settings:
                kept = {"settings": settings, **measure()}
                atomic_write_text(path, json.dumps(kept, indent=2) + "\n")
            elif complete(kept):
                atomic_write_text(path, json.dumps(kept, indent=2) + "\n")
        return kept

    def calibration_text(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first --heldout-rows x --heldout-tokens of the calibration split and the proxy's log-probabilities
        there: what layer costs are measured on (the rows themselves on the held-out text)."""
        rows, tokens = self.args.heldout_rows, self.args.heldout_tokens
        ids = split_rows(self.args.proxy / "corpus", "calibration", rows, tokens, self.tokenizer)
        return ids, self.proxy.logprobs(ids)

    def retained_costs(self, obs: Path) -> tuple[dict[int, dict[int | None, float]], dict[int, dict[int | None, int]]]:
        """Each decoder layer's retained linears alone (the experts, the head and the other layers exact) at each K of
        --retained-cost-bits: their KL on the first --heldout-rows x --heldout-tokens of the calibration split, and
        their stored bytes (exact: KL 0, the BF16 bytes). The linears are encoded as `encode --retained-bits K`
        encodes them (`encode_retained_file`, their dense Hessians from `obs`); measured once per setting, kept in
        WORK, a K not yet measured added to what is kept, a K kept but not asked for left out. Keyed like the stocks,
        by the proxy and the calibration that `obs` was observed with (not its path: a re-observation at other
        settings measures them again, and a copied WORK keeps them)."""
        path = self.work / "stocks" / f"retained-costs-{self.args.device}.json"  # the linears' EXL3 is any layout's
        settings = {
            "observations": obs.name,  # which of WORK's observations (obs-full, ...)
            "proxy": _proxy_facts(self.args.proxy),
            "calibration": [self.args.rows, self.args.tokens, self.args.batch_rows],
            "text": ["calibration", self.args.heldout_rows, self.args.heldout_tokens],
            "compute_dtype": self.args.compute_dtype,
        }

        bits = self.args.retained_cost_bits

        def complete(kept: dict[str, Any]) -> bool:
            missing = tuple(k for k in bits if any(f"{k}" not in by_k for by_k in kept["kl"].values()))
            if missing:
                added = self._measure_retained_costs(obs, missing)
                for part in ("kl", "bytes"):
                    for layer, by_k in added[part].items():
                        kept[part][layer].update(by_k)
            return bool(missing)

        kept = self.kept_measurement(path, settings, lambda: self._measure_retained_costs(obs, bits), complete)

        def options(by_k: dict[str, Any]) -> dict[int | None, Any]:  # the K asked for; what else is kept stays kept
            return {None if k == "exact" else int(k): v for k, v in by_k.items() if k == "exact" or int(k) in bits}

        return (
            {int(layer): options(by_k) for layer, by_k in kept["kl"].items()},
            {int(layer): options(by_k) for layer, by_k in kept["bytes"].items()},
        )

    def _measure_retained_costs(self, obs: Path, bits: tuple[int, ...]) -> dict[str, Any]:
        text = self.calibration_text()
        kl: dict[str, dict[str, float]] = {}
        nbytes: dict[str, dict[str, int]] = {}
        for k in bits:
            decoded, _, _ = self.encoded_linears(obs, Recipe("", "", retained_bits=k))
            for layer in sorted({d.layer for d in decoded.values() if d.layer is not None}):
                alone = {name: d for name, d in decoded.items() if d.layer == layer}
                patched = {name: d.weight for name, d in alone.items()}
                kl.setdefault(str(layer), {"exact": 0.0})[f"{k}"] = self.measure({}, {}, patched, text=text)["kl"]
                by_layer = nbytes.setdefault(str(layer), {})
                by_layer[f"{k}"] = sum(d.nbytes for d in alone.values())
                by_layer["exact"] = sum(2 * d.weight.numel() for d in alone.values())
        return {"kl": kl, "bytes": nbytes}

    def encoded_linears(self, obs: Path, recipe: Recipe) -> tuple[dict[str, DecodedLinear], int, int]:
        """The retained linears (and head) of `recipe`'s speed tier EXL3-encoded as `encode` encodes them
        (`encode_retained_file` on each planned file, their dense Hessians from `obs`) and decoded, by the model's
        parameter name (the MTP layer's left out, as `artifact_linears` does), with their EXL3 and BF16 bytes; the
        routed experts are not encoded (a composed row takes them from the stocks)."""
        out: dict[str, DecodedLinear] = {}
        exl3_bytes = bf16_bytes = 0
        with SourceCheckpoint.open(self.model_dir) as source:
            shards = {n: source.shard_of(n) for n in source.names()}
            plan = plan_artifact(
                self.spec,
                self.args.layout,
                2,
                recipe.codebook,
                shards,
                retained_bits=recipe.retained_bits,
                head_bits=recipe.head_bits,
                retained_exact_layers=recipe.retained_exact_layers,
                retained_layer_bits=None
                if recipe.retained_layer_bits is None
                else parse_layer_bits(recipe.retained_layer_bits),
            )
            for planned in plan.files:
                linears = retained_linears(planned)
                if not linears:
                    continue
                encoded = encode_retained_file(planned, source, obs, False, recipe.codebook, 0, self.args.device)
                for path, linear in linear_module_paths(self.spec, linears).items():
                    if linear.layer in self.spec.mtp_layers:
                        continue
                    parts = {n: t for n, t in encoded.tensors.items() if n.rpartition(".")[0] == linear.key}
                    tensor = EXL3Tensor.from_tensors(parts, linear.key, linear.in_features, linear.out_features)
                    nbytes = sum(t.numel() * t.element_size() for t in parts.values())
                    weight = decode_weight(tensor, torch.float32)
                    out[f"{path}.weight"] = DecodedLinear(
                        weight, linear.role.value, linear.layer, linear.source, nbytes
                    )
                    exl3_bytes += nbytes
                    bf16_bytes += 2 * linear.in_features * linear.out_features
        return out, exl3_bytes, bf16_bytes

    def estimated_costs(self, recipe: Recipe, hessians: str, blend: float | None, obs: Path) -> LayerCosts:
        """`glmquant layer-costs` on the untuned uniform stock at `recipe.bits` (the seed's build): the observations'
        first --heldout-rows calibration rows (of --tokens each; the measured costs pack rows of --heldout-tokens)."""
        ((stock, _),) = self.stocks(replace(recipe, tune_scales=0), hessians, blend, (recipe.bits,)).values()
        return measure_layer_costs(
            self.model_dir,
            obs,
            stock,
            rows=self.args.heldout_rows,
            experts=self.args.estimate_experts,
            device=self.args.device,
            dtype=self.args.compute_dtype,
        )

    def row(self, recipe: Recipe, hessians: str, blend: float | None, extras: dict[str, Any]) -> dict[str, Any]:
        obs = self.observations[recipe.observations]
        out = self.work / f"artifact-{recipe.name}"
        t0 = time.monotonic()
        tier: dict[str, Any] = {}
        if recipe.widths_from is not None:  # its widths first, from the layers' costs on calibration text
            if recipe.widths_from == "measured":
                costs = self.layer_costs(recipe, hessians, blend)
            else:
                estimate = self.estimated_costs(recipe, hessians, blend, obs)
                costs = estimate.cost
                tier["kl_alone"] = {str(layer): v for layer, v in estimate.kl_alone.items()}
                tier["experts_sampled"] = {str(layer): n for layer, n in estimate.experts_sampled.items()}
            widths = allocate_layer_widths(costs, recipe.bits)
            recipe = replace(recipe, tiers=TierSpec.of_widths([widths[layer] for layer in sorted(widths)]).text)
            tier["layer_costs"] = {str(layer): {f"k{k}": v for k, v in c.items()} for layer, c in costs.items()}
            tier["predicted_kl"] = sum(costs[layer][k] for layer, k in widths.items())  # on calibration text
            tier["cost_seconds"] = round(time.monotonic() - t0, 1)
            t0 = time.monotonic()
        if recipe.retained_widths_from is not None:  # the retained linears' K per decoder layer, likewise
            layer_kl, layer_bytes = self.retained_costs(obs)
            budget = sum(by_k[recipe.retained_budget_bits] for by_k in layer_bytes.values())
            chosen = allocate_widths(layer_kl, layer_bytes, budget, recipe.retained_offered)
            text = layer_bits_text(k for _, k in sorted(chosen.items()))
            recipe = replace(recipe, retained_layer_bits=text)
            tier["retained_layer_costs"] = {
                str(layer): {"exact" if k is None else f"k{k}": v for k, v in c.items()}
                for layer, c in layer_kl.items()
            }
            tier["retained_layer_bytes"] = {
                str(layer): {"exact" if k is None else f"k{k}": v for k, v in b.items()}
                for layer, b in layer_bytes.items()
            }
            tier["retained_budget_bytes"] = budget
            tier["retained_predicted_kl"] = sum(layer_kl[layer][k] for layer, k in chosen.items())  # calibration text
            tier["cost_seconds"] = round(time.monotonic() - t0, 1)
            t0 = time.monotonic()
        if self.args.compose_layers and composable(recipe):
            experts, by_layer, facts, out = self.composed(recipe, hessians, blend)  # the seed's MTP run reads out
            tier |= facts
            pruned: dict[int, list[int]] = {}
            result = None
            encode_s = tier["stock_seconds"]  # ~0 when every stock was there
        else:
            result, plan = self.encode(recipe, hessians, blend, out)
            keep = {int(k): v for k, v in json.loads(plan.read_text())["layers"].items()} if plan else None
            encode_s = time.monotonic() - t0
            by_layer = routed_bytes_by_layer(out)
            experts, pruned = artifact_experts(out, keep, self.spec.n_routed_experts, self.args.device)
            if recipe.tune_scales:  # how far the tuning went, by MoE layer: whether its steps were enough
                tier["tuning_by_layer"] = tuning_by_layer(result)
        nbytes, bpw = routed_bytes(by_layer, self.spec)
        linears: dict[str, torch.Tensor] = {}
        if retained_tier(recipe):
            decoded, exl3_bytes, bf16_bytes = (
                self.encoded_linears(obs, recipe) if result is None else artifact_linears(out, self.args.device)
            )
            linears = {name: d.weight for name, d in decoded.items()}
            roles = {name: d.role for name, d in decoded.items()}
            original = {name: self.proxy.model.get_parameter(name).detach() for name in decoded}
            tier |= {
                "retained_linears": len(linears),
                "retained_exl3_bytes": exl3_bytes,
                "retained_bf16_bytes": bf16_bytes,
                "retained_weight_error_by_role": weight_error_by_role(decoded, original, obs),
            }
        decode_s = time.monotonic() - t0 - encode_s
        metrics = self.measure(experts, pruned, linears)
        if recipe.name == "seed" or (recipe.tiers is not None and TierSpec.parse(recipe.tiers).ranks_layers):
            # each MoE layer's experts alone, the others BF16: where the row's KL comes from (what tiers by layer move)
            tier["kl_by_layer"] = {
                str(layer): self.measure(
                    {k: w for k, w in experts.items() if k[0] == layer}, {k: v for k, v in pruned.items() if k == layer}
                )["kl"]
                for layer in sorted({layer for layer, _ in experts})
            }
        if linears:  # the retained linears' own KL, the experts BF16: Bench.save divides it by the seed's KL
            tier |= {f"retained_only_{k}": v for k, v in self.measure({}, {}, linears).items()}
            # and each role's alone (attention, indexer, KDA, shared experts, dense MLPs): where that cost comes from
            tier["retained_only_kl_by_role"] = {
                role: self.measure({}, {}, {n: w for n, w in linears.items() if roles[n] == role})["kl"]
                for role in sorted(set(roles.values()))
            }
        row = {
            "recipe": recipe.name,
            "routed_bytes": nbytes,
            "routed_bpw": bpw,
            **metrics,
            **tier,
            **{k: v for k, v in asdict(replace(recipe, hessians=hessians, blend=blend)).items() if k != "name"},
            "manifest_sha256": result.artifact.manifest_sha256 if result else None,  # composed: stock_manifests
            "encode_seconds": round(encode_s, 1),  # observations to a verified artifact
            "decode_seconds": round(decode_s, 1),
            "measure_seconds": round(time.monotonic() - t0 - encode_s - decode_s, 1),
        }
        if recipe.name == "seed" and self.args.mtp_prompts:
            t1 = time.monotonic()
            length = min(MTP_PROMPT_TOKENS, self.ids.shape[1] // 2)
            prompts = self.ids[: self.args.mtp_prompts, :length]
            try:
                mtp = mtp_acceptance(out, prompts, self.args.mtp_new_tokens, self.args.device, self.draft_head(recipe))
            except Exception as exc:  # noqa: BLE001 - recorded: the seed's row stands on its own
                mtp = {"error": f"{type(exc).__name__}: {exc}"[-3000:], "traceback": traceback.format_exc()[-6000:]}
            extras["mtp_acceptance"] = mtp | {"seconds": round(time.monotonic() - t1, 1)}
        if not self.args.keep_artifacts and result is not None:  # a stock is kept for the rows after
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + ".work"), ignore_errors=True)
        return row

    def measure(
        self,
        experts: dict[tuple[int, int], dict[str, torch.Tensor]],
        pruned: dict[int, list[int]],
        linears: dict[str, torch.Tensor] | None = None,
        text: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The patched proxy against the reference on the held-out text, or on `text` (ids, reference)."""
        ids, reference = text or (self.ids, self.reference)
        self.proxy.set_experts(experts, pruned, linears)
        got = self.proxy.logprobs(ids)
        self.proxy.restore()
        return compare(reference, got, ids)

    def exllamav3_row(self) -> dict[str, Any]:
        from importlib.metadata import version

        name = f"exllamav3-{version('exllamav3')}"
        out, work = self.work / "exllamav3-out", self.work / "exllamav3-work"
        for d in (out, work):
            shutil.rmtree(d, ignore_errors=True)
        tokens = self.args.exllamav3_tokens or self.args.tokens
        rows = self.args.rows * self.args.tokens // tokens  # as many calibration tokens as ours
        row: dict[str, Any] = {
            "recipe": name,
            "description": f"ExLlamaV3's own converter (-b 2.0 -hb 16 -cb mcg, its calibration data at {rows} rows "
            f"x {tokens} tokens); its routed-expert tensors in the BF16 proxy",
        }
        try:
            t0 = time.monotonic()
            log = self.work / "exllamav3-convert.log"
            convert_with_exllamav3(self.model_dir, out, work, rows, tokens, log)
            experts, nbytes, widths, other_bytes = exllamav3_experts(
                out, self.proxy.layers.keys(), self.spec.n_routed_experts
            )
            row.update(
                {
                    "routed_bytes": nbytes,
                    "other_layers_routed_bytes": other_bytes,  # its MTP layer's experts: not in routed_bytes
                    "bits_seen": widths,
                    "encode_seconds": round(time.monotonic() - t0, 1),
                    **self.measure(experts, {}),
                }
            )
        except Exception as exc:  # noqa: BLE001 - recorded: the other rows stand on their own
            row.update(
                {
                    "routed_bytes": None,
                    "kl": None,
                    "top1": None,
                    "ppl": None,
                    "error": f"{type(exc).__name__}: {exc}"[-3000:],
                }
            )
        return row


_EVALUATOR: Evaluator | None = None  # a --jobs worker's own


def _start_worker(args: argparse.Namespace, observations: dict[str, Path], threads: int) -> None:
    global _EVALUATOR
    torch.set_num_threads(threads)
    _EVALUATOR = Evaluator(args, observations)


def _run_task(task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
    assert _EVALUATOR is not None, "the worker was not started"
    return _EVALUATOR.run(task)


class InlineExecutor:
    """--jobs 1: each task runs in this process as it is submitted (the pool's interface, so one scheduler)."""

    def __init__(self, args: argparse.Namespace, observations: dict[str, Path]) -> None:
        _start_worker(args, observations, torch.get_num_threads())

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the scheduler, as a worker's exception is
            future.set_exception(exc)
        return future

    def __enter__(self) -> InlineExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None


class Bench:
    """Schedules the rows (on --jobs worker processes), records them in the canonical order, resumes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.console = Console(stderr=True)
        self.work: Path = args.work
        self.model_dir = args.proxy / "model"
        self.spec = load_model_spec(self.model_dir / "config.json")
        self.rows: list[dict[str, Any]] = []
        self.best_hessians: tuple[str, float | None] | None = None
        self.record: dict[str, Any] = {
            "format": "glmquant.bench_fidelity.v1",
            "commit": args.commit or git_commit(),
            "device": _device_name(args.device),
            "layout": args.layout,
            "compute_dtype": args.compute_dtype,
            "calibration": {"rows": args.rows, "tokens": args.tokens},
            "heldout": {"rows": args.heldout_rows, "tokens": args.heldout_tokens},
            "proxy": _proxy_facts(args.proxy),
            "rows": self.rows,
        }
        if args.resume and args.results.is_file():
            earlier = json.loads(args.results.read_text())
            same = ("layout", "compute_dtype", "calibration", "heldout", "proxy")
            if all(earlier.get(k) == self.record[k] for k in same):
                self.rows += [r for r in earlier["rows"] if "error" not in r]  # failed rows are measured again
                self.record["hessians_chosen"] = earlier.get("hessians_chosen")
                for key in ("mtp_acceptance", "bf16_ppl", "bf16_repeat", "bf16_compute"):
                    if earlier.get(key):
                        self.record[key] = earlier[key]
                self.log(f"resuming: {len(self.rows)} rows already measured in {args.results}")

    def log(self, line: str) -> None:
        self.console.print(line, highlight=False)

    def recipes(self) -> list[Recipe]:
        return recipes(self.spec.n_routed_experts, self.spec.num_hidden_layers, len(self.spec.moe_layers))

    def observe(self, name: str) -> Path:
        """The observation a recipe's `observations` names: full (with the dense Hessians the speed tier reads and
        every calibration token kept for the tuned rows), small (a quarter of the rows) or gated (gate-weighted
        natural Hessians, every token kept too)."""
        rows = max(1, self.args.rows // 4) if name == "small" else self.args.rows
        weighting = HessianWeighting.GATE if name == "gated" else HessianWeighting.TOKEN
        out = self.work / f"obs-{name}"
        t0 = time.monotonic()
        observe(
            ObserveConfig(
                self.model_dir,
                out,
                recipe=self.args.proxy / "corpus" / "calibration.yaml",
                rows=rows,
                tokens=self.args.tokens,
                hessians=HessianMode.BOTH,
                dense_hessians=name == "full",  # the speed-tier rows' retained linears
                device=self.args.device,
                batch_rows=self.args.batch_rows,
                hessian_weighting=weighting,
                tuning_tokens=rows * self.args.tokens if name != "small" else 0,  # every token: the tuned rows
            )
        )
        self.log(f"observed {name} ({rows} x {self.args.tokens} tokens) in {time.monotonic() - t0:.1f} s")
        if name == "full":  # what `--tiers share:...` ranks: each MoE layer's routed output against its stream
            self.record["routed_share_by_layer"] = {
                str(layer): LayerStats.load(path).routed_share for layer, path in stats_files(out).items()
            }
        return out

    def run(self) -> None:
        args = self.args
        self.work.mkdir(parents=True, exist_ok=True)
        wanted = set(args.recipes.split(",")) if args.recipes else None
        done = {r["recipe"] for r in self.rows}
        queue: list[Recipe | None] = []
        for recipe in self.recipes():
            if (wanted is None or recipe.name in wanted) and recipe.name not in done:
                queue.append(recipe)
            if recipe.name == "seed" and self.wants_peer():  # right after the seed method, should a call end early
                queue.append(None)
        cost_bits = args.retained_cost_bits
        for queued in queue:  # a row's retained budget is uniform K's bytes: that K must be among those measured
            if queued is not None and queued.retained_widths_from and queued.retained_budget_bits not in cost_bits:
                raise SystemExit(
                    f"bench_fidelity: {queued.name} spends uniform K{queued.retained_budget_bits}'s retained bytes; "
                    f"--retained-cost-bits {','.join(map(str, cost_bits))} does not measure K"
                    f"{queued.retained_budget_bits}"
                )
        needed = sorted({r.observations for r in queue if r is not None})
        observations = {name: self.observe(name) for name in needed}
        if queue:
            executor: Any
            if args.jobs == 1:
                executor = InlineExecutor(args, observations)
            else:  # spawn: CUDA does not survive a fork; the cores shared so the workers do not oversubscribe them
                threads = max(1, (os.cpu_count() or 1) // args.jobs)
                executor = ProcessPoolExecutor(
                    args.jobs, get_context("spawn"), initializer=_start_worker, initargs=(args, observations, threads)
                )
            with executor:
                self.schedule(executor, queue)
        if args.exllamav3 and importlib.util.find_spec("exllamav3") is None:
            self.rows.append(self.failed("exllamav3-1.6.5", "exllamav3 is not installed here"))
        self.save()  # sorts the rows and compares them with the seed's, which the summary reads
        self.record["summary"] = summarize(self.rows, self.args.heldout_rows * self.args.heldout_tokens)
        self.save()
        self.log(json.dumps(self.record["summary"], indent=2))

    def wants_peer(self) -> bool:
        return (
            self.args.exllamav3
            and importlib.util.find_spec("exllamav3") is not None
            and not any(r["recipe"].startswith("exllamav3") for r in self.rows)
        )

    def schedule(self, executor: Any, queue: list[Recipe | None]) -> None:
        """Up to --jobs rows at once, in the queue's order, except that rows on the best Hessians wait until the
        Hessian rows (seed, all-token, blend) are measured."""
        running: dict[Future[Any], str] = {}

        def ready(item: Recipe | None) -> bool:
            if item is None or item.hessians != "best" or self.best_hessians or self.record.get("hessians_chosen"):
                return True
            waiting = {r.name for r in queue if r is not None} | set(running.values())
            return not waiting & set(HESSIAN_ROWS)

        while queue or running:
            starts = [i for i, x in enumerate(queue) if ready(x)][: self.args.jobs - len(running)]
            for item in [queue[i] for i in starts]:
                queue.remove(item)
                hessians, blend = self.hessians(item) if item is not None else ("natural", None)
                name = item.name if item is not None else "exllamav3"
                self.log(f"{name}: started")
                running[executor.submit(_run_task, Task(item, hessians, blend))] = name
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                try:
                    row, extras = future.result()
                except Exception as exc:  # noqa: BLE001 - recorded (and measured again on --resume); others go on
                    self.log(f"{name}: failed: {type(exc).__name__}: {exc}")
                    row, extras = self.failed(name, exc), {}
                self.record.update(extras)
                self.rows.append(row)
                self.save()
                self.log(
                    f"{row['recipe']}: "
                    + ", ".join(f"{k} {row[k]:.4g}" for k in ("kl", "top1", "ppl") if row.get(k) is not None)
                    + f", {row.get('routed_bytes')} B"
                )
                if "mtp_acceptance" in extras:
                    self.log(f"MTP on the seed artifact: {json.dumps(extras['mtp_acceptance'])}")

    @staticmethod
    def failed(recipe: str, why: Exception | str) -> dict[str, Any]:
        error = f"{type(why).__name__}: {why}" if isinstance(why, Exception) else why
        return {"recipe": recipe, "routed_bytes": None, "kl": None, "top1": None, "ppl": None, "error": error[-3000:]}

    def hessians(self, recipe: Recipe) -> tuple[str, float | None]:
        if recipe.hessians != "best":
            return recipe.hessians, recipe.blend
        if self.best_hessians is None and self.record.get("hessians_chosen"):
            chosen = self.record["hessians_chosen"]
            self.best_hessians = (chosen["hessians"], chosen["blend"])
        if self.best_hessians is None:
            measured = [r for r in self.rows if r["recipe"] in HESSIAN_ROWS and r.get("kl") is not None]
            best: dict[str, Any] = (
                min(measured, key=lambda r: r["kl"]) if measured else {"hessians": "natural", "blend": None}
            )
            self.best_hessians = (best["hessians"], best["blend"])
            self.record["hessians_chosen"] = {
                "hessians": best["hessians"],
                "blend": best["blend"],
                "from": best.get("recipe", "default"),
            }
        return self.best_hessians

    def save(self) -> None:
        """The rows in the canonical order (the peer's right after the seed's), with what compares each to the
        seed's row: bytes ratio, whether at its bytes, and a speed-tier row's KL cost ratio."""
        order = [r.name for r in self.recipes()]
        rank = {name: i for i, name in enumerate(order)}
        self.rows.sort(
            key=lambda r: (
                rank["seed"] + 0.5 if r["recipe"].startswith("exllamav3") else rank.get(r["recipe"], len(order))
            )
        )
        seed = next((r for r in self.rows if r["recipe"] == "seed" and r.get("kl") is not None), None)
        for row in self.rows:
            if seed is not None and row.get("routed_bytes"):
                row["bytes_vs_seed"] = round(row["routed_bytes"] / seed["routed_bytes"], 4)
                row["at_seed_bytes"] = row["bytes_vs_seed"] <= AT_SEED_BYTES
            if "retained_only_kl" in row:
                row["kl_cost_ratio"] = (
                    round(row["retained_only_kl"] / seed["kl"], 4) if seed and seed.get("kl") else None
                )
        results: Path = self.args.results
        results.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(results, json.dumps(self.record, indent=2) + "\n")  # a kill never leaves half a file


def summarize(rows: list[dict[str, Any]], positions: int | None = None) -> dict[str, Any]:
    """The seed method's row, the best row at its bytes (lowest KL), the ExLlamaV3 row and the issue's goal; with
    the held-out `positions` each top-1 is a mean over, the standard error of the best row's top-1 points over the
    seed's, taken as if the two rows were independent (an upper bound: they agree at most positions)."""
    seed = next((r for r in rows if r["recipe"] == "seed" and r.get("kl") is not None), None)
    peers = [
        r
        for r in rows
        if r.get("at_seed_bytes")
        and r.get("kl") is not None
        and not r.get("reference")
        and not r.get("retained_linears")  # the speed tier also quantizes what the recipes keep exact
    ]
    best = min(peers, key=lambda r: r["kl"]) if peers else None
    exl = next((r for r in rows if r["recipe"].startswith("exllamav3")), None)
    out: dict[str, Any] = {
        "seed_method": seed and seed["recipe"],
        "best": best and best["recipe"],
        "exllamav3": exl["recipe"] if exl and exl.get("kl") is not None else None,
    }
    if seed and best:
        out["goal"] = {
            "kl_at_most_0.7x_seed": best["kl"] <= 0.7 * seed["kl"],
            "top1_at_least_seed_plus_3_points": best["top1"] >= seed["top1"] + 0.03,
            "kl_ratio_to_seed": round(best["kl"] / seed["kl"], 4) if seed["kl"] else None,
            "top1_points_over_seed": round(100 * (best["top1"] - seed["top1"]), 2),
        }
        if positions:
            variance = sum(r["top1"] * (1 - r["top1"]) for r in (best, seed)) / positions
            out["goal"] |= {"positions": positions, "top1_points_se": round(100 * math.sqrt(variance), 2)}
        if exl is not None and out["exllamav3"]:
            out["goal"]["no_worse_than_exllamav3"] = best["kl"] <= exl["kl"]
    return out


def _proxy_facts(proxy: Path) -> dict[str, Any]:
    path = proxy / "proxy.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {
        k: record.get(k)
        for k in ("heldout_ppl", "shape", "steps_done", "resumed_at", "tokenizer_sha256", "train_seconds")
    } | {"routing": record.get("routing", {}).get("verdict")}


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _cost_bits(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(sorted({int(k) for k in text.split(",")}))
    except ValueError:
        bits = ()
    if not bits or not set(bits) <= set(RETAINED_COST_BITS):
        raise argparse.ArgumentTypeError(f"takes K from {','.join(map(str, RETAINED_COST_BITS))}, got {text!r}")
    return bits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proxy", type=Path, required=True, help="output directory of scripts/train_proxy.py")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (observations, artifacts)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "fidelity_proxy.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layout", choices=["tr3", "exllamav3"], default="tr3")
    ap.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the proxy's arithmetic for the reference and every row (float32: the BF16 weights' values computed "
        "without BF16 rounding, whose noise would otherwise floor small KLs; bfloat16: as before 2026-12-04)",
    )
    ap.add_argument("--rows", type=int, default=128, help="calibration rows (the small observation: a quarter)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per calibration row")
    ap.add_argument("--batch-rows", type=int, default=8, help="calibration rows per observe step")
    ap.add_argument("--heldout-rows", type=int, default=64)
    ap.add_argument("--heldout-tokens", type=int, default=512)
    ap.add_argument("--recipes", default=None, help="comma-separated subset of the rows (default: all)")
    ap.add_argument("--no-exllamav3", dest="exllamav3", action="store_false", help="skip ExLlamaV3's converter")
    ap.add_argument(
        "--exllamav3-tokens",
        type=_positive,
        default=None,
        help="tokens per row of ExLlamaV3's calibration, with rows scaled to the same token count (default: "
        "--tokens); at most the proxy's index_topk keeps its DSA layers on their dense path (docs/fidelity.md)",
    )
    ap.add_argument("--keep-artifacts", action="store_true")
    ap.add_argument(
        "--estimate-experts",
        type=_positive,
        default=ESTIMATE_EXPERTS,
        help="experts per MoE layer that `layer-cost-estimated` encodes at K1-K4 (`glmquant layer-costs --experts`; "
        f"default {ESTIMATE_EXPERTS})",
    )
    ap.add_argument(
        "--compose-layers",
        action="store_true",
        help="measure the uniform and depth-tiered rows (the depth sweep) from one uniform artifact per width, "
        "kept in WORK/stocks, each MoE layer's experts taken from its width's: the same figures as encoding each "
        "row, for a few encodes instead of one per row",
    )
    ap.add_argument(
        "--mtp-prompts",
        type=int,
        default=8,
        help="held-out prompts of the MTP acceptance run on the seed artifact (0: none)",
    )
    ap.add_argument("--mtp-new-tokens", type=int, default=64, help="greedy tokens per prompt of the MTP run")
    ap.add_argument(
        "--mtp-draft-head-bits",
        type=int,
        default=None,
        help="the MTP run's drafts read an EXL3 copy of lm_head at this K (glmquant draft-head; needs the seed's "
        "observations with --dense-hessians)",
    )
    ap.add_argument(
        "--mtp-draft-mtp-bits",
        type=int,
        default=None,
        help="with --mtp-draft-head-bits: the drafts also read an EXL3 copy of the MTP layer, its linears at this K "
        "and its routed experts at K2 (glmquant draft-head --mtp-bits; the seed's observations must hold its Hessians)",
    )
    ap.add_argument(
        "--retained-cost-bits",
        type=_cost_bits,
        metavar="K[,K...]",
        default=RETAINED_COST_BITS,
        help="the K the retained-layer-cost rows measure each layer's retained linears at and choose among, besides "
        f"exact (default {','.join(map(str, RETAINED_COST_BITS))}; each K is one encode of every retained linear, most "
        "of a CPU run's time)",
    )
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, where git runs)")
    ap.add_argument("--resume", action="store_true", help="keep the rows --results already holds for this proxy")
    ap.add_argument(
        "--jobs",
        type=_positive,
        default=1,
        help="rows measured at once, each worker process with its own proxy (the GPU is idle in much of a row)",
    )
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1767225600")
    args = ap.parse_args()
    if args.exllamav3_tokens and (args.rows * args.tokens) % args.exllamav3_tokens:
        ap.error(
            f"--exllamav3-tokens {args.exllamav3_tokens} must divide --rows x --tokens ({args.rows * args.tokens})"
        )
    if args.mtp_draft_head_bits is not None and args.mtp_draft_head_bits not in RETAINED_BITS:
        ap.error(f"--mtp-draft-head-bits must be {RETAINED_BITS.start}..{RETAINED_BITS.stop - 1}")
    if args.mtp_draft_mtp_bits is not None and (
        args.mtp_draft_head_bits is None or args.mtp_draft_mtp_bits not in RETAINED_BITS
    ):
        ap.error(
            f"--mtp-draft-mtp-bits must be {RETAINED_BITS.start}..{RETAINED_BITS.stop - 1}, with --mtp-draft-head-bits"
        )
    Bench(args).run()


if __name__ == "__main__":
    main()
