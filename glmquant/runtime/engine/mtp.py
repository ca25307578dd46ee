"""The checkpoint's MTP layer on the engine's own blocks (the drafter of MTP speculative decoding).

The same layer as `arch.hf_glm5_mtp.MtpLayer` (see there and `docs/speculative.md`): for position i,
x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]), then sparse MLA with its DSA indexer (`blocks.mla_block`, on
its own static cache) and the MoE (`blocks.moe_block`), plain residuals, then `shared_head.norm` and the target's
lm_head. Its routed experts are BF16 in the artifact (not EXL3), so they run through `DenseExperts`, an expert
backend over stacked dense weights; a draft file's EXL3 copy of the layer (`draft-head --mtp-bits`) replaces its
linears and routed experts (`LayerExperts`, one `fused_moe` stack, on the Triton backends).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from glmquant.arch import table_for
from glmquant.checkpoint.draft_head import DraftMtpTensors, read_draft_head, read_draft_mtp
from glmquant.errors import ConfigError
from glmquant.exl3.decode import decode_weight
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.engine.blocks import Run, mla_block, moe_block
from glmquant.runtime.engine.cache import MLACache
from glmquant.runtime.engine.config import EngineConfig
from glmquant.runtime.engine.experts import LayerExperts
from glmquant.runtime.engine.linears import Exl3Proj, Proj, project
from glmquant.runtime.engine.weights import MLAWeights, ModelWeights, MoEBlock, _LayerReader, _mla, _mlp
from glmquant.runtime.expert_cache import CacheStats

_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.gate_proj\.weight")  # one per routed expert, after the layer prefix
_STACKS = (("gate_proj", "up_proj"), ("down_proj",))  # the projections of the experts' two stacks


@dataclass(frozen=True)
class MtpWeights:
    layer: int  # the checkpoint's layer index (num_hidden_layers)
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: Proj  # [H, 2 H]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention: MLAWeights
    mlp: MoEBlock
    head_norm: torch.Tensor  # shared_head.norm
    experts: DenseExperts | LayerExperts  # LayerExperts: a draft file's EXL3 copy on the Triton backends
    head: Proj | None = None  # a drafter's own lm_head (`glmquant draft-head`); None: the target's


class DenseExperts:
    """Routed experts kept as dense stacks (gate/up [E, 2I, H], down [E, H, I]), an `ExpertBackend` for one layer.

    A few tokens (decode, verify, drafts) gather their routes' weights and multiply in one batched matmul (no
    host sync); many tokens (a prompt) go expert by expert."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, swiglu_limit: float | None) -> None:
        self.gate_up, self.down, self.swiglu_limit = gate_up, down, swiglu_limit
        self.uses = 0

    def forward(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.uses += expert_ids.numel()
        if expert_ids.numel() <= self.gate_up.shape[0]:
            gate_up = torch.matmul(self.gate_up[expert_ids], hidden[:, None, :, None]).squeeze(-1)  # [T, k, 2I]
            y = torch.matmul(self.down[expert_ids], self._swiglu(gate_up).unsqueeze(-1)).squeeze(-1)  # [T, k, H]
            return (y.float() * weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        for e in torch.unique(expert_ids).tolist():
            token_idx, slot = torch.where(expert_ids == e)
            y = F.linear(self._swiglu(F.linear(hidden[token_idx], self.gate_up[e])), self.down[e])
            out.index_add_(0, token_idx, y.float() * weights[token_idx, slot, None])
        return out.to(hidden.dtype)

    def stats(self) -> CacheStats:
        n = self.gate_up.shape[0]
        return CacheStats(n, n, self.uses, 0, 0)

    @property
    def expert_bytes(self) -> int:
        """The bytes one routed expert's use reads."""
        return self.gate_up[0].nbytes + self.down[0].nbytes

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return F.silu(gate) * up


def load_mtp_weights(
    artifact: Artifact,
    dtype: torch.dtype,
    device: torch.device,
    kernels: bool = False,
    draft_head: str | Path | None = None,
    dense_max_weights: int = 0,
) -> MtpWeights:
    """The artifact's MTP layer on the device (every one of its tensors, experts included); `kernels`: the Triton
    backends run it (its router then stays in the model dtype, as the text layers'); `draft_head`: a draft-head
    file whose lm_head the drafts read (EXL3 with `kernels`, else decoded to `dtype`), and whose EXL3 copy of the MTP
    layer replaces the artifact's linears and routed experts where it holds one (`draft-head --mtp-bits`; the
    artifact's BF16 ones are then not read)."""
    spec, table = artifact.spec, table_for(artifact.spec)
    if not spec.mtp_layers:
        raise ConfigError(f"{artifact.path}: the model has no MTP layer (num_nextn_predict_layers is 0)")
    layer = spec.mtp_layers[0]
    prefix = table.layer_prefix(layer)
    names = [t.name for t in table.layer_tensors(spec, layer)]
    mtp_copy = None if draft_head is None else read_draft_mtp(draft_head, spec, device)
    copies = None if mtp_copy is None else mtp_copy.linears
    read = _LayerReader(artifact, prefix, names, dtype, device, kernels, dense_max_weights, copies)
    experts = sorted(int(m.group(1)) for n in names if (m := _EXPERT.fullmatch(n[len(prefix) :])))
    if mtp_copy is None:
        backend: DenseExperts | LayerExperts = _dense_experts(read, experts, spec.swiglu_limit)
    else:
        read.left -= {n for n in names if n[len(prefix) :].startswith("mlp.experts.")}  # the copy's replace them
        backend = _copied_experts(mtp_copy, dtype, device, kernels, spec.swiglu_limit)
    weights = MtpWeights(
        layer,
        read("enorm.weight"),
        read("hnorm.weight"),
        read.proj("eh_proj.weight"),
        read("input_layernorm.weight"),
        read("post_attention_layernorm.weight"),
        _mla(read),
        MoEBlock(
            read("mlp.gate.weight", not read.kernels),
            read("mlp.gate.e_score_correction_bias", True),
            _mlp(read, "mlp.shared_experts."),
        ),
        read("shared_head.norm.weight"),
        backend,
        None if draft_head is None else _draft_head(draft_head, artifact, dtype, device, kernels),
    )
    read.finish()
    return weights


def _dense_experts(read: _LayerReader, experts: list[int], swiglu_limit: float | None) -> DenseExperts:
    """The artifact's BF16 routed experts of the MTP layer, stacked."""
    mlps = [_mlp(read, f"mlp.experts.{e}.") for e in experts]
    dense = [(m.gate_up, m.down) for m in mlps]  # the artifact's MTP layer is never EXL3: its reader decodes
    assert all(isinstance(g, torch.Tensor) and isinstance(d, torch.Tensor) for g, d in dense)
    gate_up, down = torch.stack([g for g, _ in dense]), torch.stack([d for _, d in dense])  # type: ignore[misc]
    return DenseExperts(gate_up, down, swiglu_limit)


def _copied_experts(
    mtp_copy: DraftMtpTensors, dtype: torch.dtype, device: torch.device, kernels: bool, swiglu_limit: float | None
) -> DenseExperts | LayerExperts:
    """A draft file's EXL3 routed experts: resident stacks run by `fused_moe` with `kernels`, else decoded and
    stacked as `DenseExperts` (as the torch backend decodes EXL3)."""
    experts = mtp_copy.experts
    if kernels:
        from glmquant.runtime.kernels.exl3_jobs import WeightStack
        from glmquant.runtime.kernels.fused_moe import MoEWeights

        gate_up_stack, down_stack = (
            WeightStack.from_tensors([[e[p] for e in experts] for p in ps], device) for ps in _STACKS
        )
        return LayerExperts(MoEWeights(gate_up_stack, down_stack, swiglu_limit))
    gate_up, down = (
        torch.stack([torch.cat([decode_weight(e[p], dtype) for p in ps]) for e in experts]).to(device) for ps in _STACKS
    )
    return DenseExperts(gate_up, down, swiglu_limit)


def _draft_head(path: str | Path, artifact: Artifact, dtype: torch.dtype, device: torch.device, kernels: bool) -> Proj:
    tensor = read_draft_head(path, artifact.spec.hidden_size, artifact.spec.vocab_size, device)
    return Exl3Proj.build([tensor], device) if kernels else decode_weight(tensor, dtype)


def allocate_mtp_cache(
    cfg: EngineConfig, max_batch: int, max_len: int, dtype: torch.dtype, device: torch.device
) -> MLACache:
    """The MTP layer's own MLA latent and indexer caches (max_len a whole number of k-pools)."""
    max_len = -(-max_len // cfg.kpool) * cfg.kpool

    def empty(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return MLACache(
        empty(max_batch, max_len, cfg.kv_rank),
        empty(max_batch, max_len, cfg.index_dim),
        empty(max_batch, max_len, cfg.index_dim),
        empty(max_batch, max_len // cfg.kpool, cfg.index_dim),
    )


def mtp_hidden(
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    w: MtpWeights,
    target: ModelWeights,
    cache: MLACache,
    pools: int,
    run: Run,
) -> torch.Tensor:
    """hidden [B, S, H] (the target's final-norm hidden states h_i), next_ids [B, S] (t_{i+1}), positions [B, S]
    -> the MTP layer's output hidden states [B, S, H] (`mtp_logits` gives t_{i+2}'s logits); `cache` rows of the
    batch. A draft's CUDA graph captures this part."""
    cfg, ops = run.cfg, run.ops
    e = ops.rms_norm(F.embedding(next_ids, target.embed), w.enorm, cfg.rms_eps)
    x = project(torch.cat([e, ops.rms_norm(hidden, w.hnorm, cfg.rms_eps)], dim=-1), w.eh_proj)
    x = x + mla_block(ops.rms_norm(x, w.input_norm, cfg.rms_eps), w.attention, cache, positions, pools, run)
    return x + moe_block(ops.rms_norm(x, w.post_norm, cfg.rms_eps), w.mlp, w.layer, run)


def mtp_logits(x: torch.Tensor, w: MtpWeights, target: ModelWeights, run: Run) -> torch.Tensor:
    """Logits of the MTP layer's output hidden states x [..., H]: its head norm, then the drafter's own lm_head where
    it has one, else the target's (EXL3 with `--head-bits`, as the target runs it)."""
    return project(run.ops.rms_norm(x, w.head_norm, run.cfg.rms_eps), target.lm_head if w.head is None else w.head)
