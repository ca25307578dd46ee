"""The fidelity gate: mean KL(source || artifact) and top-1 agreement over a held-out panel.

Never both models in memory: the BF16 source runs first, one decoder layer at a time
(`stream_final_hidden`), its lm_head turns the final hidden states into full-vocabulary log-probs,
which are stored as float32 in a scratch file ([positions, vocab], the whole distribution, since KL
needs all of it); everything of the source is then freed and the artifact is loaded by the runtime,
run row by row, and compared with the stored rows. Both sides compute logits the way transformers'
lm_head does (model dtype matmul), so the difference is the quantization alone.
"""

from __future__ import annotations

import gc
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from glmquant.arch import ModelSpec, load_model_spec, table_for
from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.errors import ConfigError, UsageError
from glmquant.servecheck.scoring import Verdict

_BLOCK = 256  # positions per lm_head matmul


@dataclass(frozen=True)
class FidelityResult:
    positions: int
    mean_kl: float  # mean over positions of KL(source || artifact), nats
    top1_agreement: float  # fraction of positions whose argmax token agrees
    source_ppl: float  # next-token perplexity of the panel under each model
    artifact_ppl: float


def _text(key: str) -> Callable[[ModelSpec], Any]:
    return lambda spec: spec.text.get(key)


# What makes the source and the artifact one model, in the order a mismatch is reported; n_routed_experts is checked
# apart (a pruned artifact keeps fewer). The artifact's config is the source's with only n_routed_experts changed.
SAME_MODEL_FIELDS: tuple[tuple[str, Callable[[ModelSpec], Any]], ...] = (
    ("architecture", lambda spec: spec.architecture),
    ("hidden_size", lambda spec: spec.hidden_size),
    ("num_hidden_layers", lambda spec: spec.num_hidden_layers),
    ("vocab_size", lambda spec: spec.vocab_size),
    ("moe_intermediate_size", lambda spec: spec.moe_intermediate_size),
    ("intermediate_size", lambda spec: spec.intermediate_size),
    ("num_experts_per_tok", lambda spec: spec.num_experts_per_tok),
    ("n_shared_experts", lambda spec: spec.n_shared_experts),
    ("n_group", lambda spec: spec.n_group),
    ("mlp_layer_types", lambda spec: list(spec.mlp_layer_types)),
    ("layer_types", lambda spec: list(spec.attention_types)),
    ("num_nextn_predict_layers", lambda spec: spec.num_mtp_layers),
    ("tie_word_embeddings", lambda spec: spec.tie_word_embeddings),
    *(
        (key, _text(key))
        for key in (
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
    ),
)


def _pruned(artifact: Path) -> bool:
    """Whether the artifact's manifest records an expert selection (`--keep`): only then may it hold fewer routed
    experts than its source (the count it was pruned from is not recorded, so fewer is all that can be checked)."""
    try:
        manifest = json.loads((artifact / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("selection_sha256") is not None


def _spec(path: Path, option: str) -> ModelSpec:
    """The model spec of a checkpoint directory, or a ConfigError naming the option it was given with."""
    if not path.is_dir():
        raise ConfigError(f"{option} {path} is not a directory (a checkpoint directory holding config.json)")
    try:
        return load_model_spec(path)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None


def check_source_matches(artifact: Path, source: Path) -> None:
    """UsageError naming both configs and the first differing field when `source` is not the model the artifact was
    built from: the gate would otherwise compare two unrelated models and report a meaningless failure."""
    ours, theirs = _spec(artifact, "ARTIFACT"), _spec(source, "--bf16-source")
    where = f"--bf16-source {source / 'config.json'} vs ARTIFACT {artifact / 'config.json'}"
    for key, get in SAME_MODEL_FIELDS:
        if get(theirs) != get(ours):
            raise UsageError(
                f"{where}: not the same model ({key} {get(theirs)} vs {get(ours)}); give the artifact's BF16 source"
            )
    pruned = _pruned(artifact)
    if theirs.n_routed_experts != ours.n_routed_experts and not (
        pruned and ours.n_routed_experts < theirs.n_routed_experts
    ):
        why = (
            "a pruned artifact keeps fewer experts than its source, never more"
            if pruned
            else f"its {MANIFEST_NAME} records no pruning, so its source has as many"
        )
        raise UsageError(
            f"{where}: not the same model (n_routed_experts {theirs.n_routed_experts} vs {ours.n_routed_experts}; "
            f"{why}); give the artifact's BF16 source"
        )


def _lm_head(source: Path, device: torch.device) -> torch.Tensor:
    spec = load_model_spec(source / "config.json")
    name = table_for(spec).text_prefix + "embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    with SourceCheckpoint.open(source) as ckpt:
        return ckpt.read_tensor(name).to(device)


def store_source_logprobs(source: Path, ids: torch.Tensor, device: str, path: Path) -> np.memmap:
    """Run the source layer by layer and write its log-probs [N*T, V] (float32) to `path`."""
    from glmquant.observe.streaming import stream_final_hidden

    hidden = stream_final_hidden(source, ids, device=device)  # [N,T,H]
    weight = _lm_head(source, hidden.device)  # [V,H]
    flat = hidden.reshape(-1, hidden.shape[-1])
    store = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(flat.shape[0], weight.shape[0]))
    with torch.no_grad():
        for start in range(0, flat.shape[0], _BLOCK):
            logits = F.linear(flat[start : start + _BLOCK].to(weight.dtype), weight)
            store[start : start + _BLOCK] = F.log_softmax(logits.float(), dim=-1).cpu().numpy()
    store.flush()
    del hidden, weight, flat
    _free(device)
    return store


def _free(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def compare_artifact(artifact: Path, ids: torch.Tensor, reference: np.ndarray, device: str) -> FidelityResult:
    """Run the artifact row by row through the runtime and compare with the stored source log-probs."""
    from glmquant.runtime.loader import load_model
    from glmquant.runtime.options import RuntimeOptions

    loaded = load_model(artifact, RuntimeOptions(device=device))
    rows, tokens = ids.shape
    kl_sum, agree, nll_source, nll_artifact = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for row in range(rows):
            logits = loaded.model(input_ids=ids[row : row + 1].to(loaded.device)).logits[0]  # [T,V]
            q = F.log_softmax(logits.float(), dim=-1).cpu()
            p = torch.from_numpy(np.asarray(reference[row * tokens : (row + 1) * tokens]))
            kl_sum += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            targets = ids[row, 1:].unsqueeze(-1)
            nll_source -= float(p[:-1].gather(-1, targets).sum())
            nll_artifact -= float(q[:-1].gather(-1, targets).sum())
    loaded.close()
    del loaded
    _free(device)
    predicted = rows * (tokens - 1)
    return FidelityResult(
        rows * tokens,
        kl_sum / (rows * tokens),
        agree / (rows * tokens),
        math.exp(nll_source / predicted),
        math.exp(nll_artifact / predicted),
    )


def measure_fidelity(artifact: Path, source: Path, ids: torch.Tensor, device: str = "cpu") -> FidelityResult:
    """Source first (stored, freed), then the artifact: the two models are never loaded together."""
    with tempfile.TemporaryDirectory(prefix="glmquant-fidelity-") as scratch:
        reference = store_source_logprobs(source, ids, device, Path(scratch) / "source_logprobs.npy")
        result = compare_artifact(artifact, ids, reference, device)
        del reference
    return result


def score_fidelity(result: FidelityResult, kl_max: float, top1_min: float) -> Verdict:
    failures = []
    if not math.isfinite(result.mean_kl) or result.mean_kl > kl_max:
        failures.append(f"mean KL {result.mean_kl:.4f} > {kl_max}")
    if result.top1_agreement < top1_min:
        failures.append(f"top-1 agreement {result.top1_agreement:.2%} < {top1_min:.2%}")
    return Verdict(not failures, "; ".join(failures) or "ok", result)
