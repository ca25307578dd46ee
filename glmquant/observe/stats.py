"""Per-expert REAP statistics of one MoE layer, accumulated over calibration tokens.

For expert j and the tokens x routed to it (g_j(x): the model's routing weight, normalized and scaled;
f_j(x): the expert's output before gating):

    count         |X_j|                       sum_norm       Σ ‖f_j(x)‖₂
    sum_gate      Σ g_j(x)                    sum_gate_norm  Σ g_j(x)·‖f_j(x)‖₂
    max_norm      max ‖f_j(x)‖₂               sum_score      Σ sigmoid score over *all* tokens (router view)
    ean = sum_norm / count                    reap = sum_gate_norm / count  (REAP saliency, 0 if unrouted)
    selection_share = count / (tokens · top_k)

and per layer, over all its tokens (r: the MoE block's input before its norm, the residual stream it adds to; y: the
block's output, routed experts and shared expert; y_routed: the routed experts' share Σ_j g_j f_j):

    routed_energy  Σ ‖y_routed‖²              residual_energy  Σ ‖r + y‖²
    routed_share = routed_energy / residual_energy   (how large the routed output is against the stream it joins:
                                                      an error of the experts perturbs the stream in that proportion)

Sums are float64 on the accumulating device: per-expert sums over ~10⁶ tokens in float32 would lose
digits, and the tensors are only [E] long.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import dtype_name
from glmquant.checkpoint.writer import write_safetensors
from glmquant.errors import CheckpointFormatError
from glmquant.observe.routing import Routing

SUMS = ("sum_norm", "sum_gate", "sum_gate_norm", "sum_score")
ENERGIES = ("routed_energy", "residual_energy")  # per-layer scalars; absent from observations before 2026-12-05


def stats_path(obs_dir: Path, layer: int) -> Path:
    return obs_dir / f"layer-{layer:02d}.stats.safetensors"


def stats_files(obs_dir: Path) -> dict[int, Path]:
    """Layer -> statistics file of every MoE layer observed in `obs_dir`."""
    return {
        int(p.name.split(".")[0].removeprefix("layer-")): p for p in sorted(obs_dir.glob("layer-*.stats.safetensors"))
    }


class ExpertStats:
    """Accumulator for one layer; `update_router` once per batch, `update_expert` per routed expert."""

    def __init__(self, n_experts: int, top_k: int, device: torch.device | str = "cpu") -> None:
        self.top_k = top_k
        self.tokens = 0
        self.count = torch.zeros(n_experts, dtype=torch.int64, device=device)
        self.max_norm = torch.zeros(n_experts, dtype=torch.float64, device=device)
        self.sums = {name: torch.zeros(n_experts, dtype=torch.float64, device=device) for name in SUMS}
        self.energies = {name: torch.zeros((), dtype=torch.float64, device=device) for name in ENERGIES}

    def update_router(self, routing: Routing) -> None:
        self.tokens += routing.scores.shape[0]
        self.sums["sum_score"] += routing.scores.double().sum(dim=0)

    def update_energies(self, routed: torch.Tensor, residual_after: torch.Tensor) -> None:
        """routed [N, H]: the routed experts' output of a batch's tokens; residual_after [N, H]: r + y of them."""
        self.energies["routed_energy"] += routed.double().square().sum()
        self.energies["residual_energy"] += residual_after.double().square().sum()

    def update_expert(self, expert: int, gates: torch.Tensor, norms: torch.Tensor) -> None:
        """gates, norms: [n] routing weights and output norms of the n tokens routed to `expert`."""
        g, f = gates.double(), norms.double()
        self.count[expert] += g.numel()
        self.sums["sum_norm"][expert] += f.sum()
        self.sums["sum_gate"][expert] += g.sum()
        self.sums["sum_gate_norm"][expert] += (g * f).sum()
        self.max_norm[expert] = torch.maximum(self.max_norm[expert], f.max())

    def update_experts(
        self, experts: torch.Tensor, counts: torch.Tensor, gates: list[torch.Tensor], norms: list[torch.Tensor]
    ) -> None:
        """`update_expert` for every expert one batch routed tokens to, with a few kernels per batch instead of a
        dozen per expert: `experts` [m] the distinct experts (int64), `counts` [E] the batch's tokens per expert,
        `gates[i]`, `norms[i]` those of experts[i]. Each expert's partial sums are the same reductions as
        `update_expert`'s and each running sum gets exactly one addition of them, so the result is bit-identical."""
        if not gates:
            return
        parts: dict[str, list[torch.Tensor]] = {"sum_norm": [], "sum_gate": [], "sum_gate_norm": []}
        peaks = []
        for gate, norm in zip(gates, norms):
            g, f = gate.double(), norm.double()
            parts["sum_norm"].append(f.sum())
            parts["sum_gate"].append(g.sum())
            parts["sum_gate_norm"].append((g * f).sum())
            peaks.append(f.max())
        self.count += counts
        for name, values in parts.items():
            self.sums[name].index_add_(0, experts, torch.stack(values))
        self.max_norm[experts] = torch.maximum(self.max_norm[experts], torch.stack(peaks))

    def result(self) -> LayerStats:
        return LayerStats(
            self.tokens,
            self.top_k,
            self.count.cpu(),
            self.max_norm.cpu(),
            {k: v.cpu() for k, v in self.sums.items()},
            {k: v.cpu() for k, v in self.energies.items()},
        )


@dataclass(frozen=True)
class LayerStats:
    """Finished statistics of one layer (CPU tensors), with the derived per-expert measures."""

    tokens: int
    top_k: int
    count: torch.Tensor  # [E] int64
    max_norm: torch.Tensor  # [E] float64
    sums: Mapping[str, torch.Tensor]  # SUMS -> [E] float64
    energies: Mapping[str, torch.Tensor] | None = None  # ENERGIES -> float64 scalars (None: observed before them)

    def _per_token(self, total: torch.Tensor) -> torch.Tensor:
        return torch.where(self.count > 0, total / self.count.clamp(min=1), torch.zeros_like(total))

    @property
    def ean(self) -> torch.Tensor:
        return self._per_token(self.sums["sum_norm"])

    @property
    def reap(self) -> torch.Tensor:
        return self._per_token(self.sums["sum_gate_norm"])

    @property
    def selection_share(self) -> torch.Tensor:
        return self.count.double() / max(1, self.tokens * self.top_k)

    @property
    def load_imbalance(self) -> float:
        """Busiest expert's token count over the mean count (1.0 = perfectly balanced)."""
        mean = self.count.double().mean().item()
        return float(self.count.max().item() / mean) if mean > 0 else 0.0

    @property
    def routed_share(self) -> float | None:
        """routed_energy / residual_energy (module docstring); None when the observation predates the energies."""
        if self.energies is None:
            return None
        residual = float(self.energies["residual_energy"])
        return float(self.energies["routed_energy"]) / residual if residual > 0 else 0.0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "count": self.count,
            "max_norm": self.max_norm,
            **self.sums,
            "ean": self.ean,
            "reap": self.reap,
            "selection_share": self.selection_share,
            "tokens": torch.tensor(self.tokens, dtype=torch.int64),
            "top_k": torch.tensor(self.top_k, dtype=torch.int64),
            **(self.energies or {}),
        }

    def save(self, path: Path) -> None:
        tensors = self.tensors()
        specs = [TensorSpec(k, dtype_name(v), tuple(v.shape)) for k, v in tensors.items()]
        write_safetensors(path, specs, lambda s: tensors[s.name], {"format": "glmquant.expert_stats.v1"})

    @classmethod
    def load(cls, path: Path) -> LayerStats:
        with SourceCheckpoint.open(path) as f:
            t = {name: f.read_tensor(name) for name in f.names()}
        missing = sorted({"tokens", "top_k", "count", "max_norm", *SUMS} - set(t))
        if missing:
            raise CheckpointFormatError(f"{path}: not an expert-statistics file (missing tensors {missing})")
        energies = {k: t[k] for k in ENERGIES} if all(k in t for k in ENERGIES) else None
        return cls(int(t["tokens"]), int(t["top_k"]), t["count"], t["max_norm"], {k: t[k] for k in SUMS}, energies)
