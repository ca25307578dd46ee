"""Train the fidelity proxy: a small `Glm5NextForConditionalGeneration` with GLM-5.3-Flash's layer pattern and
routing, from a fixed seed, on the package-text corpus, with its own tokenizer; then write it as a release-layout
BF16 source checkpoint and check it (held-out perplexity, routing not collapsed).

Output directory:
  corpus/        train / calibration / heldout splits (.jsonl), corpus.json, calibration.yaml, heldout.yaml
  model/         the BF16 source checkpoint (tokenizer, config, shards, index): what observe and encode read
  routing/       `glmquant observe` statistics of the calibration split (REAP, load), no Hessians
  proxy.json     the record: configs, corpus summary, tokenizer hash, loss curve, held-out perplexity, routing

Routing is trained the GLM / DeepSeek-V3 way, without an auxiliary loss: after every step each MoE layer's
`e_score_correction_bias` moves by `bias_update_rate` against the sign of each expert's load error (a buffer,
never a gradient), so no expert starves. The indexer of the DSA layers is not trained (transformers runs it
without gradients); `index_topk` k-pools cover the whole training context, so their attention is dense.
The MTP layer (the drafter of speculative decoding, docs/speculative.md) trains with the model, DeepSeek-V3's
way: `arch.hf_glm5_mtp.MtpLayer` (transformers' MLA attention and MoE modules; the model's embedding and lm_head,
shared) reads the model's final hidden state h_i (after its final norm, as the runtime feeds it) with t_{i+1} and
predicts t_{i+2}; the loss is the main LM loss + `mtp_loss_weight` x the MTP loss, jointly from the first step
(h_i not detached: the release's MTP layer was trained so, and h_i then carries what the layer needs; the MTP
router is balanced like the model's). `mtp_loss_weight` 0 writes the layer untrained (made up from the seed).
Training runs in float32 (TF32 matmuls on a GPU) with transformers' grouped-GEMM expert path (one GEMM per
projection, not a loop over the experts): the same dtypes and code on the CPU and the GPU, so the CPU smoke test
covers the GPU path; the checkpoint is cast to BF16 when written.
`--dtype bfloat16` trains in BF16 throughout instead (weights, activations and AdamW state), a fallback.

Reproducible: the seed fixes the corpus, the tokenizer, the initial weights and the batches, and training runs
with torch's deterministic algorithms, so a rerun on the CPU gives the same bytes. On a GPU cuBLAS needs
CUBLAS_WORKSPACE_CONFIG=:4096:8 (scripts/train_proxy.py sets it) and flash-linear-attention's Triton kernels
may still sum in varying order: reruns agree to float rounding, not bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from glmquant.arch.module_map import EXPERTS_IMPLEMENTATION
from glmquant.calibration import load_recipe
from glmquant.calibration.build import build_token_rows, tokenizer_sha256
from glmquant.devices import device_type
from glmquant.errors import UsageError
from glmquant.fixtures.tiny import TinyModelConfig, save_release_checkpoint
from glmquant.proxy.corpus import (
    DEFAULT_CORPUS_RECIPE,
    build_corpus,
    load_corpus_recipe,
    read_corpus_lock,
    read_split,
    split_recipe,
)
from glmquant.proxy.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from glmquant.arch.hf_glm5_mtp import MtpLayer

# The H200 proxy: 8 layers (2 dense, then MoE; DSA at 3 and 7, KDA elsewhere), 64 experts top-8 + a shared one.
PROXY_SHAPE = TinyModelConfig(
    hidden_size=256,
    num_hidden_layers=8,
    first_dense_layers=2,
    n_routed_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    intermediate_size=1024,
    vocab_size=8192,
    shard_bytes=128 << 20,
    attention_heads=4,
    head_dim=64,
    q_lora_rank=128,
    kv_lora_rank=64,
    index_topk=128,
)
# The CPU smoke proxy: the same pattern at 4 layers (1 dense, DSA at 3) and 32 experts. Its attention is the H200
# proxy's (4 heads of 64, LoRA ranks 128/64): ExLlamaV3 pads a projection's output to 128 columns, and its KDA module
# then fails on a fused q/k/v of 2 heads of 32 (192 columns), so narrower heads would leave the peer row unmeasurable.
SMOKE_SHAPE = TinyModelConfig(
    hidden_size=128,
    num_hidden_layers=4,
    first_dense_layers=1,
    n_routed_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    intermediate_size=256,
    vocab_size=512,
    shard_bytes=32 << 20,
    attention_heads=PROXY_SHAPE.attention_heads,
    head_dim=PROXY_SHAPE.head_dim,
    q_lora_rank=PROXY_SHAPE.q_lora_rank,
    kv_lora_rank=PROXY_SHAPE.kv_lora_rank,
    index_topk=32,
)
VOCAB_MULTIPLE = 64
STATE_NAME = "train_state.pt"
# settings that do not change the trained weights: a run may resume with other values of these
RESUME_FREE = ("out", "max_minutes", "checkpoint_every", "log_every", "heldout_rows", "calibration_rows")
TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    shape: TinyModelConfig = PROXY_SHAPE
    corpus_recipe: Path = DEFAULT_CORPUS_RECIPE
    corpus_bytes: int | None = None  # None: the recipe's max_bytes
    # an earlier build's corpus.lock.json: exactly its documents (the same corpus on another set-up, or an error)
    corpus_lock: Path | None = None
    seed: int = 0
    device: str = "cuda"
    steps: int = 500  # 8.2 M tokens: ~5.7 minutes at ~24k tokens/s (29k measured on an H200 without the MTP layer)
    batch_rows: int = 32
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_fraction: float = 0.1  # cosine decay ends at lr * this
    warmup_steps: int = 50
    weight_decay: float = 0.1
    bias_update_rate: float = 1e-3
    max_minutes: float | None = None  # pause (state saved, resumable) once this much wall time has passed
    # steps between saved training states besides the pauses and the end (0: none); a state is ~2.2 GB at
    # PROXY_SHAPE (fp32 weights and AdamW moments), seconds to write
    checkpoint_every: int = 0
    heldout_rows: int = 64
    calibration_rows: int = 64  # rows of the routing check
    log_every: int = 50
    # transformers' grouped GEMM over experts (one GEMM per projection instead of a loop over the experts)
    experts_implementation: str = EXPERTS_IMPLEMENTATION
    dtype: str = "float32"  # weights and activations; "bfloat16" is the fallback should a GPU kernel refuse float32
    mtp_loss_weight: float = 0.3  # lambda of the MTP loss (DeepSeek-V3's early value); 0: MTP layer not trained

    def __post_init__(self) -> None:
        for name in ("steps", "batch_rows", "seq_len", "heldout_rows", "calibration_rows", "log_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if not self.lr > 0 or not 0 <= self.min_lr_fraction <= 1 or self.warmup_steps < 0:
            raise UsageError("--lr must be positive, --min-lr-fraction in [0, 1], --warmup-steps >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise UsageError(f"--max-minutes must be positive, got {self.max_minutes}")
        if not (math.isfinite(self.mtp_loss_weight) and self.mtp_loss_weight >= 0):
            raise UsageError(f"--mtp-loss-weight must be a finite number >= 0, got {self.mtp_loss_weight}")
        if self.dtype not in TRAIN_DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(TRAIN_DTYPES)}, got {self.dtype!r}")
        device_type(self.device)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to lr * min_lr_fraction at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_fraction + (1 - self.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class LoadBalancer:
    """Aux-loss-free balancing: each router's selections are counted during the step, then its bias moves."""

    routers: list[Any]  # transformers' MoE routers: num_experts, e_score_correction_bias
    rate: float
    counts: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = [torch.zeros(r.num_experts, device=r.e_score_correction_bias.device) for r in self.routers]
        for router, count in zip(self.routers, self.counts):
            router.register_forward_hook(self._counter(count))

    @staticmethod
    def _counter(count: torch.Tensor) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, _args: tuple, out: tuple) -> None:  # returns None: output unchanged
            count.add_(torch.bincount(out[2].reshape(-1), minlength=count.numel()).float())

        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Update every bias; returns the worst layer's load imbalance (max / mean count) of this step."""
        worst = 0.0
        for router, count in zip(self.routers, self.counts):
            mean = count.mean()
            worst = max(worst, float(count.max() / mean.clamp(min=1)))
            router.e_score_correction_bias.add_(self.rate * torch.sign(mean - count))
            count.zero_()
        return worst


def plain_settings(cfg: TrainConfig, leave_out: tuple[str, ...]) -> dict[str, Any]:
    """The config's fields but `leave_out` as plain data (paths as text), for JSON and saved states."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k not in leave_out}


def settings_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """The settings a saved training state depends on (every field but RESUME_FREE)."""
    return plain_settings(cfg, RESUME_FREE)


def save_train_state(path: Path, cfg: TrainConfig, state: dict[str, Any]) -> None:
    """Write the training state atomically (a temporary file renamed over it): a kill mid-write keeps the last."""
    partial = path.with_name(path.name + ".partial")
    torch.save({"format": "glmquant.proxy-train-state.v1", "settings": settings_fingerprint(cfg), **state}, partial)
    os.replace(partial, path)


def load_train_state(path: Path, cfg: TrainConfig) -> dict[str, Any]:
    """A saved training state to resume from, refused (naming the file and the settings) when it cannot be read
    or was written with settings that change the weights."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # RNG states must stay on the CPU
    except Exception as exc:  # noqa: BLE001 - any unreadable file: the message names it and the way out
        raise UsageError(f"{path}: cannot read the saved training state ({exc}); delete it to start over") from None
    if not isinstance(state, dict) or state.get("format") != "glmquant.proxy-train-state.v1":
        raise UsageError(f"{path}: not a proxy training state; delete it to start over")
    ours = settings_fingerprint(cfg)
    differ = sorted(k for k in ours.keys() | state["settings"].keys() if ours.get(k) != state["settings"].get(k))
    if differ:
        raise UsageError(
            f"{path} was saved with other settings ({', '.join(differ)}): resume with the same ones, or delete it "
            "to start over"
        )
    return state


class StopRequests:
    """Within the block, Ctrl-C and SIGTERM ask the training loop to pause at the end of the step under way
    (`requested` names the signal); a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def token_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """Every training document's tokens, each followed by the end-of-text token, as one int32 stream."""
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for doc in ids for t in (*doc, eos)], dtype=torch.int32)


def text_model_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:  # a Glm5NextForConditionalGeneration
    """Logits of the language model alone (the vision tower is not involved in text)."""
    hidden = model.model.language_model(input_ids=ids).last_hidden_state
    return model.lm_head(hidden)


def build_mtp(model: Any) -> MtpLayer:  # a Glm5NextForConditionalGeneration
    """The model's MTP layer (`arch.hf_glm5_mtp.MtpLayer`, the module the runtime drafts with) on its embedding and
    lm_head, on the model's device and dtype, initialized as transformers initializes the model's layers."""
    from glmquant.arch.hf_glm5_mtp import MtpLayer

    text = model.model.language_model
    mtp = MtpLayer(text.config, text.embed_tokens, model.lm_head)
    mtp.config._attn_implementation = text.config._attn_implementation
    mtp.config._experts_implementation = text.config._experts_implementation
    for module in mtp.modules():
        text._init_weights(module)
    weight = model.lm_head.weight
    return mtp.to(weight.device, weight.dtype).train()


def mtp_logits(mtp: MtpLayer, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits of t_{i+2} for every position i with both t_{i+1} and t_{i+2} in `ids` [B, T]
    (`hidden` [B, >= T - 2, H]: h_i after the final norm): [B, T - 2, V]."""
    return mtp(hidden[:, : ids.shape[1] - 2], ids[:, 1:-1], None)[0]


@torch.no_grad()
def mtp_heldout(model: Any, mtp: MtpLayer, rows: torch.Tensor, batch: int) -> dict[str, Any]:
    """The MTP layer on `rows` [N, T], at every position i with t_{i+1} and t_{i+2} in the row, given the true
    t_{i+1}: top-1 accuracy at t_{i+2}, greedy agreement (its argmax equals the model's argmax at i + 1: a 1-token
    draft accepted under greedy verification), perplexity; and the model's own top-1 at t_{i+2} from i + 1."""
    model.eval()
    mtp.eval()
    nll, right, agree, main_right, count = 0.0, 0, 0, 0, 0
    for part in rows.split(batch):
        hidden = model.model.language_model(input_ids=part).last_hidden_state
        logits = mtp_logits(mtp, hidden, part).float()
        main = model.lm_head(hidden[:, 1:-1]).argmax(-1)
        target, draft = part[:, 2:], logits.argmax(-1)
        nll += float(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"))
        right += int((draft == target).sum())
        agree += int((draft == main).sum())
        main_right += int((main == target).sum())
        count += target.numel()
    model.train()
    mtp.train()
    return {
        "heldout_top1": right / count,
        "heldout_greedy_agreement": agree / count,
        "heldout_ppl": math.exp(nll / count),
        "heldout_main_top1_next": main_right / count,
        "heldout_positions": count,
    }


@torch.no_grad()
def perplexity(model: torch.nn.Module, rows: torch.Tensor, batch: int) -> float:
    """exp(mean next-token NLL) over `rows` [N, T]."""
    model.eval()
    nll, count = 0.0, 0
    for part in rows.split(batch):
        logits = text_model_logits(model, part)
        nll += float(F.cross_entropy(logits[:, :-1].float().flatten(0, 1), part[:, 1:].flatten(), reduction="sum"))
        count += part[:, 1:].numel()
    model.train()
    return math.exp(nll / count)


def train_proxy(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Corpus, tokenizer, training, checkpoint and checks; returns (and writes) the record.

    Resumable: the training state is saved to OUT/train_state.pt every `checkpoint_every` steps, when
    `max_minutes` is reached, and on Ctrl-C or SIGTERM (at the end of the step under way); the same command then
    continues from it, to the same weights an uninterrupted run gives. A paused run returns `{"paused": True,
    ...}` and writes no model; the state is removed once proxy.json is written."""
    from transformers import AutoTokenizer, Glm5NextForConditionalGeneration

    started = time.monotonic()
    corpus_dir, model_dir, state_path = cfg.out / "corpus", cfg.out / "model", cfg.out / STATE_NAME
    state = load_train_state(state_path, cfg) if state_path.is_file() else None
    tokenizer: Any  # transformers' fast tokenizer, trained here or read back
    if state is None:
        recipe = load_corpus_recipe(cfg.corpus_recipe)
        recipe = recipe.scaled(cfg.corpus_bytes) if cfg.corpus_bytes else recipe
        lock = None if cfg.corpus_lock is None else read_corpus_lock(cfg.corpus_lock, recipe)
        corpus = build_corpus(recipe, corpus_dir, lock)
        texts = read_split(corpus_dir, "train")
        tokenizer = train_tokenizer(texts, cfg.shape.vocab_size)
        model_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(model_dir)
        stream = token_stream(tokenizer, texts)
    else:  # the corpus, tokenizer and token stream of the run being resumed
        corpus, stream = state["corpus"], state["stream"]
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer_sha = tokenizer_sha256(tokenizer)
    if state is not None:
        if tokenizer_sha != state["tokenizer_sha256"]:
            raise UsageError(f"{model_dir}: the tokenizer differs from the one {state_path} was trained with")
        log(f"resuming from {state_path} after step {state['steps_done']}")
    log(
        f"corpus: {json.dumps({k: (v['documents'], v['bytes']) for k, v in corpus['splits'].items()})}, "
        f"{len(corpus['languages'])} languages"
    )
    shape = replace(cfg.shape, vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    heldout = split_rows(corpus_dir, "heldout", cfg.heldout_rows, cfg.seq_len, tokenizer)
    for split, rows in (("heldout", cfg.heldout_rows), ("calibration", cfg.calibration_rows)):
        split_recipe(corpus_dir, split, rows, cfg.seq_len)  # the proxy's recipes, beside their splits
    log(
        f"tokenizer: {len(tokenizer)} tokens; train stream {stream.numel():,} tokens; "
        f"{cfg.steps * cfg.batch_rows * cfg.seq_len:,} to train on"
    )

    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    deterministic, precision = torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()
    torch.use_deterministic_algorithms(True, warn_only=True)  # CPU: bit-identical reruns (index_add_ would race)
    torch.set_float32_matmul_precision("high")  # fp32 weights and activations, TF32 matmuls on a GPU
    hf_config = shape.hf_config(tokenizer)
    hf_config.text_config._experts_implementation = cfg.experts_implementation
    model: Any = Glm5NextForConditionalGeneration(hf_config)  # transformers types its `to` unbound
    model = model.to(device, TRAIN_DTYPES[cfg.dtype]).train()
    text = model.model.language_model
    mtp = build_mtp(model) if cfg.mtp_loss_weight > 0 else None
    routers = [layer.mlp.gate for layer in text.layers if hasattr(layer.mlp, "experts")]
    balancer = LoadBalancer(routers + ([mtp.mlp.gate] if mtp is not None else []), cfg.bias_update_rate)
    params = [p for n, p in model.named_parameters() if "visual" not in n]
    params += list(mtp.parameters()) if mtp is not None else []
    decay = [p for p in params if p.dim() >= 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    sampler = torch.Generator().manual_seed(cfg.seed)
    curve: list[dict[str, Any]] = []
    resumed_at: list[int] = []
    first, earlier_seconds = 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        if mtp is not None:
            mtp.load_state_dict(state["mtp"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        first, curve, earlier_seconds = state["steps_done"], state["loss_curve"], state["train_seconds"]
        resumed_at = [*state["resumed_at"], first]

    def save_state(steps_done: int) -> None:
        save_train_state(
            state_path,
            cfg,
            {
                "steps_done": steps_done,
                "resumed_at": resumed_at,
                "loss_curve": curve,
                "train_seconds": earlier_seconds + time.monotonic() - train_started,
                "model": model.state_dict(),
                "mtp": mtp.state_dict() if mtp is not None else None,
                "optimizer": optimizer.state_dict(),
                "sampler": sampler.get_state(),
                "torch_rng": torch.get_rng_state(),
                "corpus": corpus,
                "stream": stream,
                "tokenizer_sha256": tokenizer_sha,
            },
        )

    train_started = time.monotonic()
    try:
        with StopRequests() as stop:
            for step in range(first, cfg.steps):
                starts = torch.randint(0, stream.numel() - cfg.seq_len - 1, (cfg.batch_rows,), generator=sampler)
                batch = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()]).long().to(device)
                for group in optimizer.param_groups:
                    group["lr"] = cfg.lr_at(step)
                hidden = text(input_ids=batch[:, :-1]).last_hidden_state
                loss = F.cross_entropy(model.lm_head(hidden).float().flatten(0, 1), batch[:, 1:].flatten())
                total, mtp_loss = loss, None
                if mtp is not None:  # t_{i+2} from h_i and t_{i+1}: every input position but the last
                    logits = mtp_logits(mtp, hidden, batch).float()
                    mtp_loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 2:].flatten())
                    total = loss + cfg.mtp_loss_weight * mtp_loss
                optimizer.zero_grad(set_to_none=True)
                total.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                imbalance = balancer.step()
                if step % cfg.log_every == 0 or step == cfg.steps - 1:
                    elapsed = time.monotonic() - train_started
                    curve.append(
                        {
                            "step": step,
                            "loss": round(loss.item(), 4),
                            **({"mtp_loss": round(mtp_loss.item(), 4)} if mtp_loss is not None else {}),
                            "load_imbalance": round(imbalance, 3),
                            "seconds": round(earlier_seconds + elapsed, 1),
                        }
                    )
                    log(
                        f"step {step}: loss {loss.item():.4f}"
                        + (f", MTP loss {mtp_loss.item():.4f}" if mtp_loss is not None else "")
                        + f", load imbalance {imbalance:.2f}, "
                        f"{(step + 1 - first) * cfg.batch_rows * cfg.seq_len / max(elapsed, 1e-9):,.0f} tokens/s"
                    )
                out_of_time = cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes
                if step + 1 < cfg.steps and (out_of_time or stop.requested):
                    save_state(step + 1)
                    why = f"--max-minutes {cfg.max_minutes} reached" if out_of_time else f"{stop.requested} received"
                    log(f"paused after step {step} ({why}): the same command continues from {state_path}")
                    return {"paused": True, "steps_done": step + 1, "state": str(state_path)}
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    save_state(step + 1)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_float32_matmul_precision(precision)
    if first < cfg.steps:  # a crash or kill in the checks below does not cost the training
        save_state(cfg.steps)
    train_seconds = earlier_seconds + time.monotonic() - train_started
    ppl = perplexity(model, heldout.to(device), cfg.batch_rows)
    log(f"held-out perplexity {ppl:.3f} ({heldout.numel():,} tokens)")
    mtp_record = mtp_heldout(model, mtp, heldout.to(device), cfg.batch_rows) if mtp is not None else None
    if mtp_record is not None:
        log(
            f"MTP held-out: top-1 {mtp_record['heldout_top1']:.3f}, greedy agreement "
            f"{mtp_record['heldout_greedy_agreement']:.3f}, perplexity {mtp_record['heldout_ppl']:.3f}"
        )

    model = model.to("cpu").float()
    mtp_state = mtp.to("cpu").float().state_dict() if mtp is not None else None
    save_release_checkpoint(
        model, model_dir, tokenizer, cfg.seed, shape.shard_bytes, made_up_router_bias=False, mtp_state=mtp_state
    )
    routing = routing_check(model_dir, corpus_dir / "calibration.yaml", cfg.out / "routing", cfg.device)
    log(f"routing: {json.dumps(routing['verdict'])}")
    record = {
        "format": "glmquant.proxy.v1",
        "seed": cfg.seed,
        "train_config": plain_settings(cfg, ("shape",)),
        "shape": asdict(shape),
        "corpus": corpus,
        "tokenizer_sha256": tokenizer_sha,
        "tokenizer_vocab": len(tokenizer),
        "train_tokens": stream.numel(),
        "steps_done": cfg.steps,
        "resumed_at": resumed_at,
        "train_seconds": round(train_seconds, 1),
        "loss_curve": curve,
        "heldout_ppl": ppl,
        "heldout_tokens": heldout.numel(),
        "routing": routing,
        "mtp_trained": mtp is not None,
        "mtp": mtp_record,
        "environment": _environment(device),
        "seconds": round(time.monotonic() - started, 1),
    }
    (cfg.out / "proxy.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    state_path.unlink(missing_ok=True)
    return record


def split_rows(corpus_dir: Path, split: str, rows: int, tokens: int, tokenizer: Any) -> torch.Tensor:
    """`rows` packed rows of `tokens` from a split, through the calibration packer (as observe packs them). Its recipe
    goes to a temporary directory: the corpus is only read, so processes side by side (bench_fidelity's workers) do
    not write over each other's recipe, nor over the proxy's calibration.yaml."""
    with tempfile.TemporaryDirectory(prefix="glmquant-split-") as tmp:
        recipe = load_recipe(split_recipe(corpus_dir, split, rows, tokens, Path(tmp)))
        return build_token_rows(recipe, tokenizer).lanes[0].ids.long()


def routing_check(model_dir: Path, recipe: Path, obs_dir: Path, device: str) -> dict[str, Any]:
    """`glmquant observe` (REAP statistics only) over the calibration split: per MoE layer the load imbalance,
    the experts that got no token and the spread of REAP saliency; collapsed routing (a starved expert, or one
    expert taking over 4x its share) fails the verdict."""
    from glmquant.observe.config import ObserveConfig
    from glmquant.observe.hessians import HessianMode
    from glmquant.observe.run import observe
    from glmquant.observe.stats import LayerStats, stats_files

    observe(ObserveConfig(model_dir, obs_dir, recipe=recipe, hessians=HessianMode.NONE, device=device))
    layers: dict[str, dict[str, Any]] = {}
    for layer, path in stats_files(obs_dir).items():
        s = LayerStats.load(path)
        reap = s.reap[s.count > 0]
        quarter = max(1, reap.numel() // 4)
        ranked = reap.sort(descending=True).values
        layers[str(layer)] = {
            "load_imbalance": round(s.load_imbalance, 3),
            "experts_without_tokens": int((s.count == 0).sum()),
            "reap_max_over_min": round(float(reap.max() / reap.min()), 3) if reap.numel() else None,
            "reap_cv": round(float(reap.std() / reap.mean()), 4) if reap.numel() > 1 else None,
            "reap_top_over_bottom_quarter": round(float(ranked[:quarter].mean() / ranked[-quarter:].mean()), 3)
            if reap.numel()
            else None,
        }
    worst = max((stats["load_imbalance"] for stats in layers.values()), default=0.0)
    starved = sum(stats["experts_without_tokens"] for stats in layers.values())
    return {
        "layers": layers,
        "verdict": {
            "collapsed": worst > 4 or starved > 0,
            "worst_load_imbalance": worst,
            "experts_without_tokens": starved,
        },
    }


def _environment(device: torch.device) -> dict[str, Any]:
    import transformers

    from glmquant.observe.streaming import kda_implementation

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "kda": kda_implementation(),
    }
