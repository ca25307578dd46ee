"""The runtime's own copy of every non-expert text-model tensor, on the device, read one decoder layer at a time.

Projections that read the same input are concatenated so one matmul serves them (KDA: q, k, v, f_a, g_a, b; MLA:
q_a, kv_a and the indexer's wk, weights_proj and k-pool gate; q_b with the indexer's wq_b; gate with up).
Tensors keep transformers' dtypes: fp32 where its model keeps them fp32 (KDA conv, A_log, dt_bias, router, mHC
base and scale), the model dtype otherwise; but with the Triton backends the router stays in the model dtype,
which its kernel reads and multiplies in fp32 (`kernels/router.py`). Every tensor of a layer must be used, and
only those exist.

A retained linear stored as EXL3 (the speed tier, `encode --retained-bits`; lm_head with `--head-bits`) is decoded
once at load to its dense weight in the model dtype (`decode_weight`, as the transformers-module runtime's torch path
does) and then concatenated and applied like an exact one with the torch backend; with the Triton backends a
projection holding one of over `RuntimeOptions.dense_linear_max_weights` weights becomes an `Exl3Proj`
(`linears.py`): its EXL3 blocks run through `exl3_linear` (adjacent ones of one shape as one stack), the others
(exact, or EXL3 decoded for being that small) as one dense weight per run of adjacent blocks, each writing its
columns of the projection's output. kv_b, which attention absorbs as a matrix, is always decoded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from rich.progress import track

from glmquant.arch import TensorRole, table_for
from glmquant.errors import CheckpointFormatError
from glmquant.exl3.decode import decode_weight
from glmquant.exl3.tensor import EXL3Tensor
from glmquant.runtime.artifact import Artifact
from glmquant.runtime.engine.config import EngineConfig
from glmquant.runtime.engine.linears import Exl3Proj, Proj
from glmquant.runtime.options import decoded_at_load


@dataclass(frozen=True)
class Hyper:
    fn: torch.Tensor  # [(2 + N) N, N H]
    base: torch.Tensor  # fp32 [(2 + N) N]
    scale: torch.Tensor  # fp32 [3]


@dataclass(frozen=True)
class MLP:
    gate_up: Proj  # [2 I, H], gate rows first
    down: Proj  # [H, I]


@dataclass(frozen=True)
class MoEBlock:
    router: torch.Tensor  # [E, H]: fp32, or the model dtype with the Triton backends (`kernels/router.py`)
    bias: torch.Tensor  # fp32 [E]
    shared: MLP


@dataclass(frozen=True)
class KDAWeights:
    in_proj: Proj  # [3 P + 2 D + heads, H]: q, k, v, f_a, g_a, b
    conv: torch.Tensor  # fp32 [3 P, kernel]
    f_b: Proj  # [P, D]
    g_b: Proj  # [P, D]
    dt_bias: torch.Tensor  # fp32 [P]
    a_log: torch.Tensor  # fp32 [heads]
    o_norm: torch.Tensor  # [D]
    o_proj: Proj  # [H, P]


@dataclass(frozen=True)
class MLAWeights:
    in_proj: Proj  # [q_rank + kv_rank + 2 index_dim + index_heads, H]: q_a, kv_a, wk, k-pool gate, weights_proj
    q_norm: torch.Tensor  # [q_rank]
    kv_norm: torch.Tensor  # [kv_rank]
    q_b: Proj  # [heads nope + index_heads index_dim, q_rank]: q_b, then the indexer's wq_b
    kv_b: torch.Tensor  # [heads (nope + v), kv_rank]
    o_proj: Proj  # [H, heads v]
    k_norm_weight: torch.Tensor  # [index_dim]
    k_norm_bias: torch.Tensor  # [index_dim]
    ape: torch.Tensor  # [kpool, index_dim]


@dataclass(frozen=True)
class LayerWeights:
    attn_hc: Hyper
    ffn_hc: Hyper
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attention: KDAWeights | MLAWeights
    mlp: MLP | MoEBlock


@dataclass(frozen=True)
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: Proj  # [V, H]
    layers: tuple[LayerWeights, ...]


class _LayerReader:
    """Reads a layer's tensors by suffix onto the device and checks that every one of them was used."""

    def __init__(
        self,
        artifact: Artifact,
        prefix: str,
        names: list[str],
        dtype: torch.dtype,
        device: torch.device,
        kernels: bool = False,
        dense_max_weights: int = 0,
        copies: Mapping[str, EXL3Tensor] | None = None,
    ) -> None:
        self.artifact, self.prefix, self.dtype, self.device = artifact, prefix, dtype, device
        self.left = set(names)
        self.kernels = kernels  # EXL3 retained linears run by `exl3_linear` (the Triton backends), else decoded
        self.dense_max_weights = dense_max_weights  # but those of at most this many weights decoded too
        self.copies = copies or {}  # EXL3 tensors by key that replace the artifact's (a draft file's MTP layer)

    def __call__(self, suffix: str, fp32: bool = False) -> torch.Tensor:
        name = self.prefix + suffix
        key = name.removesuffix(".weight")
        if name.endswith(".weight") and (key in self.copies or key in self.artifact.retained_linears):
            self.left.discard(name)  # the speed tier (or a copy): decoded once, used like the exact weight
            return decode_weight(self._exl3(key), self.dtype)
        if name not in self.artifact.checkpoint:
            raise CheckpointFormatError(f"{self.artifact.path}: tensor {name} is missing")
        self.left.discard(name)
        return self.artifact.checkpoint.read_tensor(name).to(self.device, torch.float32 if fp32 else self.dtype)

    def cat(self, *suffixes: str) -> torch.Tensor:
        return self(suffixes[0]) if len(suffixes) == 1 else torch.cat([self(s) for s in suffixes])

    def proj(self, *suffixes: str) -> Proj:
        """The row blocks of one projection: concatenated dense, or an `Exl3Proj` where one is an EXL3 linear
        that the kernels run."""
        keys = [(self.prefix + s).removesuffix(".weight") for s in suffixes]
        exl3 = [s.endswith(".weight") and self._runs_exl3(k) for s, k in zip(suffixes, keys)]
        if not self.kernels or not any(exl3):
            return self.cat(*suffixes)
        blocks: list[EXL3Tensor | torch.Tensor] = []
        for suffix, key, is_exl3 in zip(suffixes, keys, exl3):
            if is_exl3:
                self.left.discard(self.prefix + suffix)
                blocks.append(self._exl3(key))
            else:
                blocks.append(self(suffix))
        return Exl3Proj.build(blocks, self.device)

    def _exl3(self, key: str) -> EXL3Tensor:
        if key in self.copies:
            return self.copies[key]
        return self.artifact.read_linear(self.artifact.retained_linears[key], self.device)

    def _runs_exl3(self, key: str) -> bool:
        """An EXL3 linear large enough for `exl3_linear` (`RuntimeOptions.dense_linear_max_weights`)."""
        linear = self.copies.get(key) or self.artifact.retained_linears.get(key)
        return linear is not None and not decoded_at_load(linear, self.dense_max_weights)

    def finish(self) -> None:
        if self.left:
            raise CheckpointFormatError(
                f"{self.artifact.path}: the runtime has no use for {len(self.left)} tensor(s) "
                f"of {self.prefix.rstrip('.')}, e.g. {sorted(self.left)[:3]}"
            )


def load_weights(
    artifact: Artifact,
    cfg: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernels: bool = False,
    dense_max_weights: int = 0,
) -> ModelWeights:
    """Every non-expert tensor of the text model (the MTP layer and vision tower are not read); `kernels`: EXL3
    retained linears of more than `dense_max_weights` weights run through `exl3_linear` (the Triton backends),
    the others are decoded once."""
    spec, table = artifact.spec, table_for(artifact.spec)
    layers = []
    for layer in track(range(cfg.layers), description="text layers to device", transient=True):
        names = [t.name for t in table.layer_tensors(spec, layer) if t.role is not TensorRole.ROUTED_EXPERT]
        read = _LayerReader(artifact, table.layer_prefix(layer), names, dtype, device, kernels, dense_max_weights)
        layers.append(_layer(read, cfg, layer))
        read.finish()
    top_names = [t.name for t in table.top_level(spec) if t.role is not TensorRole.VISION]
    top = _LayerReader(artifact, "", top_names, dtype, device, kernels, dense_max_weights)
    p = table.text_prefix
    embed = top(p + "embed_tokens.weight")
    weights = ModelWeights(
        embed, top(p + "norm.weight"), embed if spec.tie_word_embeddings else top.proj("lm_head.weight"), tuple(layers)
    )
    top.finish()
    return weights


def _layer(read: _LayerReader, cfg: EngineConfig, layer: int) -> LayerWeights:
    def hyper(site: str) -> Hyper:
        return Hyper(read(f"hc_{site}_fn"), read(f"hc_{site}_base", True), read(f"hc_{site}_scale", True))

    attention = _kda(read) if cfg.layer_kinds[layer] == "kda" else _mla(read)
    if cfg.mlp_kinds[layer] == "dense":
        mlp: MLP | MoEBlock = _mlp(read, "mlp.")
    else:
        mlp = MoEBlock(
            read("mlp.gate.weight", not read.kernels),  # the model dtype where `kernels/router.py` reads it
            read("mlp.gate.e_score_correction_bias", True),
            _mlp(read, "mlp.shared_experts."),
        )
    return LayerWeights(
        hyper("attn"),
        hyper("ffn"),
        read("input_layernorm.weight"),
        read("post_attention_layernorm.weight"),
        attention,
        mlp,
    )


def _mlp(read: _LayerReader, prefix: str) -> MLP:
    return MLP(
        read.proj(prefix + "gate_proj.weight", prefix + "up_proj.weight"), read.proj(prefix + "down_proj.weight")
    )


def _kda(read: _LayerReader) -> KDAWeights:
    a = "self_attn."
    conv = torch.cat([read(f"{a}{x}_conv1d.weight", True) for x in "qkv"]).squeeze(1)
    return KDAWeights(
        read.proj(*(f"{a}{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj"))),
        conv,
        read.proj(a + "f_b_proj.weight"),
        read.proj(a + "g_b_proj.weight"),
        read(a + "dt_bias", True),
        read(a + "A_log", True),
        read(a + "o_norm.weight"),
        read.proj(a + "o_proj.weight"),
    )


def _mla(read: _LayerReader) -> MLAWeights:
    a, i = "self_attn.", "self_attn.indexer."
    return MLAWeights(
        read.proj(
            a + "q_a_proj.weight",
            a + "kv_a_proj_with_mqa.weight",
            i + "wk.weight",
            i + "index_kpool_compress_gate",
            i + "weights_proj.weight",
        ),
        read(a + "q_a_layernorm.weight"),
        read(a + "kv_a_layernorm.weight"),
        read.proj(a + "q_b_proj.weight", i + "wq_b.weight"),
        read(a + "kv_b_proj.weight"),
        read.proj(a + "o_proj.weight"),
        read(i + "k_norm.weight"),
        read(i + "k_norm.bias"),
        read(i + "index_kpool_compress_ape"),
    )
