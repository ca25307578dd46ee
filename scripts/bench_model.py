"""The whole GLM-5.3-Flash text model on one GPU from `--load-format dummy` weights (tr3 K2 by default): decode tok/s
at batch 1, 4 and 16 with 1k and 32k of context, prefill tok/s at 8k, 64k and 200k, peak GPU memory, where a batch-1
decode step's time and bytes go per kernel class, and a GB10 projection from those measurements.

Parts (each saved to --out as soon as it is done, so a run cut short keeps what it measured):
- graphs:     greedy tokens of B sequences decoded with CUDA graphs equal those of the eager path (B = 1, 4, 16),
              and each decode step is one captured graph per batch size;
- decode:     per context, one prompt prefilled and copied to every slot, then timed graph-replayed steps;
- prefill:    one prompt of each length, chunked, timed from first chunk to last logits;
- classes:    each kernel class captured and timed alone over all layers (batch 1, context 1k); "rest" is the whole
              step minus the classes; bytes per token from the tensors each class reads (`engine/profile.py`);
              the GB10 projection per class: max(bytes / BW, H200 time x (132 SMs x 1.98 GHz) / (48 SMs x GB10 clock)).
- kernels:    torch.profiler over one eager batch-1 decode step and one prefill chunk: kernel launches and the
              kernels that take the most device time (where "rest" and prefill time go).
- mtp:        MTP speculative decoding at batch 1 (the engine loads its MTP layer only when this part runs): per
              k = 1..3 the ms of one draft, of one verify step (k + 1 tokens; CUDA graphs, and eager beside them) and
              of a rollback (each KDA layer's state after the kept tokens copied back), the measured decode
              tok/s with speculation (random weights: acceptance ~0), and the tok/s the step
              times give at a given number of accepted drafts per step (the formula is in the report).

    python scripts/bench_model.py --commit SHA [--quick] [--parts graphs,decode,prefill,classes] [--out FILE]
    python scripts/bench_model.py --smoke --out FILE          # the tiny config on the CPU, every part (a test runs it)
    python scripts/bench_model.py --retained-bits 4 ...       # the speed tier: `model` records it, and `speed_tier`
                                                              # holds bytes/token and the GB10 projection
    python scripts/bench_model.py --retained-bits 4 --head-bits 6 ...   # lm_head EXL3 too (or --head-bits alone)
    python scripts/bench_model.py --retained-bits 4 --retained-exact-layers 2 ...  # the first 2 layers' exact
    python scripts/bench_model.py --routed-experts 160 ...    # 160 of 288 experts per MoE layer built (an H100's
                                                              # memory); a step's bytes and work stay the whole model's
    python scripts/bench_model.py --merge A.json B.json --out FILE
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from glmquant.arch import PROJECTIONS, TensorRole, table_for
from glmquant.checkpoint.draft_head import DraftHead, DraftMtp, mtp_copy_tensors, write_draft_head
from glmquant.checkpoint.layouts import RETAINED_BITS, parse_layer_bits
from glmquant.encode.draft_head import DEFAULT_MTP_EXPERT_BITS
from glmquant.errors import UsageError
from glmquant.exl3.tensor import EXL3Tensor
from glmquant.fixtures.random_artifact import random_exl3
from glmquant.runtime.dummy import dummy_artifact
from glmquant.runtime.engine import Engine
from glmquant.runtime.engine.profile import (
    CLASSES,
    block_input,
    class_bytes,
    class_steps,
    exl3_stacks,
    mtp_draft_bytes,
    unique_experts,
    verify_bytes,
)
from glmquant.runtime.engine.weights import MoEBlock
from glmquant.runtime.options import DENSE_LINEAR_MAX_WEIGHTS, RuntimeOptions

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_CONFIG = ROOT / "tests" / "data" / "glm-5.3-flash" / "config.json"
H200 = {"sms": 132, "clock_ghz": 1.98}
GB10: dict[str, Any] = {
    "sms": 48,
    "clock_ghz": 2.52,
    "clock_source": (
        "derived, not a published clock: NVIDIA's 31 TFLOPS FP32 for the GB10 GPU (Hot Chips 2025, reported by "
        "ferra.ru 2025-08-28) / (2 FLOP x 6,144 CUDA cores) = 2.52 GHz; DGX Spark has 48 SMs (6,144 / 128)"
    ),
}
GB10_BANDWIDTHS = {"218": "measured copy bandwidth of one DGX Spark (docs anchors)", "273": "LPDDR5X spec"}
PARTS = ("graphs", "decode", "prefill", "classes", "kernels", "mtp")


@dataclass(frozen=True)
class Sizes:
    contexts: tuple[int, ...]  # decode contexts; the first is the summary's
    batches: tuple[int, ...]
    prefill: tuple[int, ...]
    steps: int  # timed decode steps per (context, batch)
    check_steps: int  # greedy steps compared eager vs graphs
    chunk: int  # prefill chunk


MAX_K = 3  # drafts per step measured: 1..MAX_K (SpeculativeConfig's range)
FULL = Sizes((1024, 32768), (1, 4, 16), (8192, 65536, 200_000), 64, 16, 4096)
QUICK = Sizes((1024,), (1, 4, 16), (8192,), 32, 8, 4096)
SMOKE = Sizes((24, 40), (1, 2), (48,), 3, 3, 16)


def main() -> None:
    args = parse_args()
    if args.merge:
        fidelity = json.loads(args.fidelity.read_text()) if args.fidelity else None
        try:
            merged = merge([json.loads(Path(p).read_text()) for p in args.merge], fidelity, args.kl_cost_row)
        except ValueError as exc:
            sys.exit(f"bench_model --merge {' '.join(map(str, args.merge))}: {exc}")
        save(merged, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="bench-model-") as scratch:  # the smoke model, configs, the draft file
        measure(args, Path(scratch))


def measure(args: argparse.Namespace, scratch: Path) -> None:
    """Build the dummy model and run `args.parts`, the report saved after each; files it makes go in `scratch`."""
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    config, device = (tiny_config(scratch), "cpu") if args.smoke else (args.config, "cuda")
    unheld = 0  # router rows of experts --routed-experts leaves out: their bytes are added back where a step reads them
    if args.routed_experts is not None:
        try:
            config, unheld = with_routed_experts(config, args.routed_experts, scratch)
        except UsageError as exc:
            sys.exit(f"bench_model.py: {exc}")
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "environment": environment(device),
        "sizes": sizes.__dict__,
        "compile_decode": args.compile_decode,
        "draft_head_bits": args.draft_head_bits,
        "draft_mtp_bits": args.draft_mtp_bits,  # the drafts read a K copy of the MTP layer (routed experts K2)
        "dense_linear_max_weights": args.dense_linear_max_weights,
        "parts": {},
    }
    t0 = time.perf_counter()
    artifact = dummy_artifact(
        config,
        args.layout,
        args.bits,
        device=device,
        retained_bits=args.retained_bits,
        head_bits=args.head_bits,
        retained_exact_layers=args.retained_exact_layers,
        retained_layer_bits=args.retained_layer_bits,
    )
    engine = Engine.load(
        artifact,
        RuntimeOptions(
            device=device,
            backend="torch" if args.smoke else "triton",
            model_impl="glmquant",
            compile_decode=args.compile_decode,
            dense_linear_max_weights=args.dense_linear_max_weights,
        ),
        max_batch=1,
        max_len=sizes.chunk,
        mtp="mtp" in args.parts,
        draft_head=None
        if args.draft_head_bits is None
        else dummy_draft_head(artifact.spec, args.draft_head_bits, args.draft_mtp_bits, scratch),
    )
    sync(engine)
    report["model"] = model_record(artifact, engine, time.perf_counter() - t0, config, unheld)
    save(report, args.out)
    runs: dict[str, Callable[[Engine, Sizes, Any], Any]] = {
        "graphs": check_graphs,
        "decode": decode_speed,
        "prefill": prefill_speed,
        "classes": partial(breakdown, unheld_routers=unheld),
        "kernels": kernel_profile,
        "mtp": partial(mtp_speed, unheld_routers=unheld),
    }
    for part in args.parts:
        reset_peak(engine)
        try:
            result = runs[part](engine, sizes, artifact)
            if isinstance(result, Iterator):  # rows, each saved as soon as it is measured
                rows = report["parts"][part] = []
                for row in result:
                    rows.append(row)
                    save(report, args.out)
            else:
                report["parts"][part] = result
        except Exception:  # noqa: BLE001  (one failed part must not lose the others)
            report["parts"][part + "_error"] = traceback.format_exc()[-4000:]
        report["parts"][part + "_peak_gpu_gb"] = peak_gb(engine)
        report["summary"] = summary(report)
        if is_speed_tier(report):
            report["speed_tier"] = speed_tier(report, None)
        save(report, args.out)
        print(f"{part}: done at +{time.perf_counter() - t0:.0f} s", file=sys.stderr)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "model_h200.json")
    p.add_argument("--commit", default=None, help="the commit measured (git is unreliable on the device)")
    p.add_argument("--config", type=Path, default=REFERENCE_CONFIG, help="config.json of the model to build")
    p.add_argument("--layout", default="tr3", choices=("tr3", "exllamav3"))
    p.add_argument("--bits", type=int, default=2)
    p.add_argument(
        "--retained-bits",
        type=int,
        default=None,
        help="the speed tier: retained linears EXL3 at this K (encode --retained-bits); fills the report's speed_tier",
    )
    p.add_argument(
        "--retained-exact-layers",
        type=int,
        default=0,
        help="with --retained-bits: the first N decoder layers' retained linears stay exact "
        "(encode --retained-exact-layers)",
    )
    p.add_argument(
        "--retained-layer-bits",
        type=layer_bits,
        default=None,
        help="the speed tier with each decoder layer's K (encode --retained-layer-bits K6,K6,exact,K3,...) instead of "
        "--retained-bits; fills the report's speed_tier (its KL cost from --merge --kl-cost-row)",
    )
    p.add_argument(
        "--head-bits",
        type=int,
        default=None,
        help="the speed tier: lm_head EXL3 at this K (encode --head-bits); fills the report's speed_tier",
    )
    p.add_argument(
        "--draft-head-bits",
        type=int,
        default=None,
        help="with the mtp part: the drafts read a random EXL3 copy of lm_head at this K (glmquant draft-head)",
    )
    p.add_argument(
        "--draft-mtp-bits",
        type=int,
        default=None,
        help="with --draft-head-bits: the draft file also holds a random EXL3 copy of the MTP layer, its linears at "
        "this K and its routed experts at K2 (glmquant draft-head --mtp-bits)",
    )
    p.add_argument(
        "--routed-experts",
        type=int,
        default=None,
        help="build each MoE layer with only this many routed experts (a GPU smaller than the model, e.g. an H100: "
        "a decode step still reads num_experts_per_tok per layer, so its bytes and work are the whole model's); "
        "recorded in the report's model.routed_experts",
    )
    p.add_argument("--compile-decode", action="store_true", help="decode steps' math through torch.compile")
    p.add_argument(
        "--dense-linear-max-weights",
        type=int,
        default=DENSE_LINEAR_MAX_WEIGHTS,
        help="EXL3 retained linears of at most this many weights run decoded at load (RuntimeOptions; 0: none)",
    )
    p.add_argument("--quick", action="store_true", help="about 6 minutes of an H200: 1k decode, 8k prefill")
    p.add_argument("--smoke", action="store_true", help="the tiny config on the CPU, every part at tiny sizes")
    p.add_argument("--parts", type=lambda s: tuple(s.split(",")), default=PARTS)
    p.add_argument("--merge", nargs="+", type=Path, help="combine the parts of earlier reports into --out")
    p.add_argument(
        "--fidelity",
        type=Path,
        help="with --merge: bench_fidelity's results on the trained proxy: the mtp part's tok/s and speedup projected "
        "at its MTP acceptance, and the speed tier's KL cost ratio from its retained-kK row",
    )
    p.add_argument(
        "--kl-cost-row",
        help="with --fidelity: the speed tier's KL cost from this row instead of the one named after the report's K "
        "(e.g. retained-layer-cost-k3-head5, widths the proxy chose for its own layers within uniform K3's bytes, "
        "beside a --retained-bits 3 speed run)",
    )
    args = p.parse_args()
    if args.retained_layer_bits is not None and (args.retained_bits is not None or args.retained_exact_layers):
        p.error("--retained-layer-bits replaces --retained-bits and --retained-exact-layers")
    if set(args.parts) - set(PARTS):
        p.error(f"--parts takes {', '.join(PARTS)}")
    if args.draft_head_bits is not None and ("mtp" not in args.parts or args.draft_head_bits not in RETAINED_BITS):
        p.error(f"--draft-head-bits takes K {RETAINED_BITS.start}..{RETAINED_BITS.stop - 1} with the mtp part")
    if args.draft_mtp_bits is not None and (args.draft_head_bits is None or args.draft_mtp_bits not in RETAINED_BITS):
        p.error(f"--draft-mtp-bits takes K {RETAINED_BITS.start}..{RETAINED_BITS.stop - 1} with --draft-head-bits")
    if not args.smoke and not args.merge and not torch.cuda.is_available():
        p.error("no CUDA device: use --smoke on the CPU")
    return args


def with_routed_experts(config: Path, experts: int, directory: Path) -> tuple[Path, int]:
    """A copy of `config` whose MoE layers hold `experts` routed experts, in `directory`, and how many fewer than the
    config's; refused when it is not between the experts each token picks and the config's count."""
    raw = json.loads(Path(config).read_text())
    text = raw.get("text_config", raw)
    picked, total = int(text["num_experts_per_tok"]), int(text["n_routed_experts"])
    if not picked <= experts <= total:
        raise UsageError(
            f"--routed-experts takes {picked}..{total} for {config} (its tokens pick {picked}), not {experts}"
        )
    text["n_routed_experts"] = experts
    out = directory / "routed-experts" / "config.json"
    out.parent.mkdir()
    out.write_text(json.dumps(raw, indent=2))
    return out, total - experts


def unheld_router_bytes(engine: Engine, rows: int, layers: int) -> int:
    """What `rows` router rows (weight and bias) of each of `layers` MoE layers weigh: the routing a step of the whole
    model reads for the experts `--routed-experts` leaves out (every router row is read per token)."""
    moe = next(lw.mlp for lw in engine.weights.layers if isinstance(lw.mlp, MoEBlock))
    return rows * layers * (moe.router[0].nbytes + moe.bias[0].nbytes)


def moe_layers(engine: Engine) -> int:
    return sum(isinstance(lw.mlp, MoEBlock) for lw in engine.weights.layers)


def tiny_config(directory: Path) -> Path:
    from glmquant.fixtures import build_tiny_checkpoint

    return build_tiny_checkpoint(directory / "tiny") / "config.json"


# --- parts ---------------------------------------------------------------------------------------------------------


def check_graphs(engine: Engine, sizes: Sizes, artifact: object) -> Iterator[dict[str, Any]]:
    """B sequences (prompts just past the indexer's top-k, of different lengths) decoded greedily from the same
    cache state, eagerly and with CUDA graphs: the tokens must be equal, one graph captured per batch size."""
    lengths = [engine.cfg.index_topk + 64 + 5 * slot for slot in range(max(sizes.batches))]
    engine.reallocate(len(lengths), max(lengths) + sizes.check_steps + 8)
    first = torch.stack(
        [engine.prefill(slot, random_ids(engine, n, seed=slot), chunk=sizes.chunk) for slot, n in enumerate(lengths)]
    ).argmax(dim=-1)
    saved = engine.caches.snapshot()
    for batch in sizes.batches:
        runs = {}
        before = engine.graphs.captured if engine.graphs else 0
        for eager in (True, False):
            engine.caches.restore(saved)
            positions = torch.tensor(lengths[:batch], device=engine.device)
            runs[eager] = greedy(engine, first[:batch], positions, sizes.check_steps, eager)
        yield {
            "batch": batch,
            "steps": sizes.check_steps,
            "tokens_equal": runs[True][0] == runs[False][0],
            "logits_finite": all(bool(torch.isfinite(run[1]).all()) for run in runs.values()),
            "max_abs_logit_diff_last_step": float((runs[True][1] - runs[False][1]).abs().max()),
            "graphs_captured": (engine.graphs.captured - before) if engine.graphs else 0,
            "cuda_graphs": engine.graphs is not None,
        }


def greedy(
    engine: Engine, tokens: torch.Tensor, positions: torch.Tensor, steps: int, eager: bool
) -> tuple[list[list[int]], torch.Tensor]:
    """`steps` greedy decode steps of slots 0..B-1 from their tokens at their positions; the tokens, last logits."""
    out = []
    for _ in range(steps):
        logits = engine.decode(tokens, positions, int(positions.max()) + 1, eager=eager)
        tokens, positions = logits.argmax(dim=-1), positions + 1
        out.append(tokens.tolist())
    return out, logits.float().clone()


def decode_speed(engine: Engine, sizes: Sizes, artifact: object) -> Iterator[dict[str, Any]]:
    """Per context: prefill slot 0, copy it to every slot, then per batch time graph-replayed greedy steps."""
    for context in sizes.contexts:
        engine.reallocate(max(sizes.batches), context + sizes.steps + 8)
        engine.prefill(0, random_ids(engine, context), chunk=sizes.chunk)
        engine.caches.copy_slot(0, range(1, max(sizes.batches)))
        for batch in sizes.batches:
            tokens = torch.zeros(batch, dtype=torch.long, device=engine.device)
            positions = torch.full((batch,), context, dtype=torch.long, device=engine.device)
            for _ in range(2):  # the first call of a signature runs eagerly, the second captures
                tokens = engine.decode(tokens, positions, context + sizes.steps).argmax(dim=-1)
            run = partial(greedy_replays, engine, tokens, positions, context + sizes.steps, sizes.steps)
            ms = timed_ms(engine, run) / sizes.steps
            yield {
                "context": context,
                "batch": batch,
                "ms_per_step": round(ms, 3),
                "tok_s": round(batch * 1000 / ms, 2),
            }


def greedy_replays(engine: Engine, tokens: torch.Tensor, positions: torch.Tensor, length: int, steps: int) -> None:
    """`steps` graph-replayed greedy decode steps from `tokens` at `positions` (caches of `length` tokens)."""
    for i in range(steps):
        tokens = engine.decode(tokens, positions + i, length).argmax(dim=-1)


def prefill_speed(engine: Engine, sizes: Sizes, artifact: object) -> Iterator[dict[str, Any]]:
    for length in sizes.prefill:
        engine.reallocate(1, length + 8)
        engine.prefill(0, random_ids(engine, 2 * sizes.chunk), chunk=sizes.chunk)  # compiles every chunk kernel
        reset_peak(engine)
        ids = random_ids(engine, length)
        ms = timed_ms(engine, partial(engine.prefill, 0, ids, chunk=sizes.chunk))
        yield {
            "tokens": length,
            "seconds": round(ms / 1000, 3),
            "tok_s": round(length * 1000 / ms, 1),
            "chunk": sizes.chunk,
            "peak_gpu_gb": peak_gb(engine),
        }


def breakdown(engine: Engine, sizes: Sizes, artifact: object, unheld_routers: int = 0) -> dict[str, Any]:
    """Batch-1 decode at the first context: the whole step and each class, per token, and the GB10 projection; the
    router rows of `unheld_routers` experts per MoE layer not held (--routed-experts) count as read."""
    context = sizes.contexts[0]
    engine.reallocate(1, context + 16)
    x = block_input(engine, 1)
    tokens = torch.zeros(1, dtype=torch.long, device=engine.device)
    position = torch.full((1,), context, dtype=torch.long, device=engine.device)
    for _ in range(2):
        engine.decode(tokens, position, context + 1)
    whole = timed_ms(engine, lambda: engine.decode(tokens, position, context + 1), reps=20) / 20
    times = class_times(engine, x, context, whole, reps=20)
    nbytes = class_bytes(engine, 1, context, unique_experts(engine, x), logical_expert_bytes(artifact))
    nbytes["routed_moe"] += unheld_router_bytes(engine, unheld_routers, moe_layers(engine))
    classes: dict[str, dict[str, Any]] = {
        name: {
            "ms_per_token": round(times[name], 4),
            "bytes_per_token": nbytes[name],
            "achieved_gb_s": round(nbytes[name] / times[name] / 1e6, 1) if times[name] > 0 else None,
        }
        for name in (*CLASSES, "rest")
    }
    return {
        "batch": 1,
        "context": context,
        "whole_step_ms": round(whole, 4),
        "classes": classes,
        "rest_is": "the whole step minus the classes (mHC, norms, embedding, adds, gaps between kernels)",
        "bytes_are": "weights + KDA state read and written + MLA latents of the selected tokens + the k-pool keys "
        "the indexer scores (none up to index_topk tokens of context) + the routed experts' EXL3 bytes; activations "
        "not counted",
        "projection": project_gb10({n: (c["ms_per_token"], c["bytes_per_token"]) for n, c in classes.items()}),
    }


def kernel_profile(engine: Engine, sizes: Sizes, artifact: object) -> dict[str, Any]:
    """torch.profiler over one eager batch-1 decode step at the first context and one prefill chunk, each run once
    before (compiles, autotuning): launches, and the kernels (CPU ops off CUDA) ranked by their own time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    context = sizes.contexts[0]
    engine.reallocate(1, context + sizes.chunk + 16)
    engine.prefill(0, random_ids(engine, context), chunk=sizes.chunk)
    tokens = torch.zeros(1, dtype=torch.long, device=engine.device)
    position = torch.full((1,), context, dtype=torch.long, device=engine.device)
    engine.decode(tokens, position, context + 1, eager=True)  # compiles and warms every decode kernel
    chunk_ids = random_ids(engine, sizes.chunk, seed=1)
    work = {
        "decode_step_eager_b1": lambda: engine.decode(tokens, position, context + 1, eager=True),
        "prefill_chunk": lambda: engine.prefill(0, chunk_ids, chunk=sizes.chunk),
    }
    out: dict[str, Any] = {"context": context, "chunk": sizes.chunk, "time_is": "device" if cuda else "cpu"}
    for name, fn in work.items():
        fn()  # warm: Triton autotuning (fla's kernels key on sizes, e.g. rows / 65,536) stays out of the profile
        sync(engine)
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            fn()
            sync(engine)
        out[name] = kernel_table(prof.key_averages(), cuda)
    return out


ROLLBACK_NOTE = (
    "a step with a rejected draft also pays rollback_ms (each KDA layer's state after the last kept token copied "
    "back), not in this formula"
)
SPEC_FORMULA = f"tok/s = 1000 x (1 + accepted drafts per step) / (draft_ms x k + verify_ms); {ROLLBACK_NOTE}"


def mtp_speed(engine: Engine, sizes: Sizes, artifact: object, unheld_routers: int = 0) -> dict[str, Any]:
    """Batch 1 at the first context: per k, ms per draft (one MTP position), per verify step (k + 1 tokens against
    the static caches, each token's KDA states recorded) and per rollback (the states after the first token copied
    back), each as
    EngineMtpDecoder runs it (CUDA graphs where the engine has them; the eager verify beside it); then `steps`
    speculative steps through EngineMtpDecoder timed end to end (tokens / s actually produced)."""
    from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder
    from glmquant.runtime.generate import PromptInputs

    context, reps = sizes.contexts[0], max(3, sizes.steps // 4)
    graphs = engine.graphs is not None
    engine.reallocate(1, context + (MAX_K + 1) * (sizes.steps + 2) + 16)
    ids = random_ids(engine, context)
    hidden = engine.prefill_hidden(0, ids, chunk=sizes.chunk)
    engine.draft(0, hidden, torch.cat([ids[1:], ids[:1]]), 0)  # the MTP cache holds the prompt's positions
    tokens = torch.zeros(1, dtype=torch.long, device=engine.device)
    position = torch.full((1,), context, dtype=torch.long, device=engine.device)
    for _ in range(2):
        engine.decode(tokens, position, context + 1)
    plain_ms = timed_ms(engine, lambda: engine.decode(tokens, position, context + 1), reps=reps) / reps
    saved = engine.save_recurrent(0)
    one = hidden[-1:]

    def draft() -> None:
        engine.draft(0, one, tokens, context, graphs)

    def rollback() -> None:
        engine.keep_verified(0, 1)

    rows = []
    for k in range(1, MAX_K + 1):
        step_ids = random_ids(engine, k + 1, seed=k).to(engine.device)

        def verify(step_ids: torch.Tensor = step_ids, graphed: bool = graphs) -> None:
            engine.verify(0, step_ids, context, graphed)
            engine.restore_recurrent(0, saved)  # the next rep verifies from the same state

        times = {}
        for name, fn in (
            ("draft_ms", draft),
            ("verify_ms", verify),
            ("verify_eager_ms", partial(verify, graphed=False)),
            ("rollback_ms", rollback),
        ):
            for _ in range(2):  # warm: the first call of a graph's signature runs eagerly, the second captures
                fn()
            times[name] = timed_ms(engine, fn, reps=reps) / reps
        engine.restore_recurrent(0, saved)
        verify_x = block_input(engine, 1, tokens=k + 1)
        classes = {n: round(ms, 4) for n, ms in class_times(engine, verify_x, context, times["verify_ms"], 10).items()}
        routed = unique_experts(engine, verify_x)
        read = verify_bytes(engine, k + 1, context, routed, logical_expert_bytes(artifact))
        read["routed_moe"] += unheld_router_bytes(engine, unheld_routers, moe_layers(engine))
        engine.restore_recurrent(0, saved)
        diff = verify_graph_diff(engine, step_ids, context, saved)
        decoder = EngineMtpDecoder(engine, k)
        decoder.prefill(PromptInputs(ids.view(1, -1)))
        produced: list[int] = [int(decoder.speculate(0)[-1].argmax())]  # warm: the MTP layer reads the prompt
        ms = timed_ms(engine, partial(speculate_greedily, decoder, produced), reps=sizes.steps)
        step_ms = times["draft_ms"] * k + times["verify_ms"]
        rows.append(
            {
                "k": k,
                **{name: round(v, 4) for name, v in times.items()},
                "verify_classes_ms": classes,
                "verify_bytes": read,
                "verify_experts_routed": routed,
                "verify_graph_max_abs_logit_diff": diff,
                "measured_tok_s": round((len(produced) - 1) * 1000 / ms, 2),
                "measured_acceptance_rate": round(decoder.stats.acceptance_rate, 4),
                "measured_steps": sizes.steps,  # timed; the acceptance rate counts the warm-up step too
                "tok_s_at_accepted_per_step": {
                    f"{a:g}": round(1000 * (1 + a) / step_ms, 2)
                    for a in sorted({0.0, 0.5, 1.0, round(k * 0.7, 2), float(k)})
                },
            }
        )
    return {
        "batch": 1,
        "context": context,
        "plain_step_ms": round(plain_ms, 4),
        "plain_tok_s": round(1000 / plain_ms, 2),
        "graphs": graphs,
        "draft_bytes": mtp_draft_bytes(engine) + unheld_router_bytes(engine, unheld_routers, 1),  # the MTP layer's
        "bytes_are": "verify_bytes: each class's bytes for the k + 1 tokens (class_bytes; the routed experts "
        "their rows route to, verify_experts_routed over the MoE layers: random rows route independently, where "
        "a text's consecutive tokens share experts; KDA's state written once more per extra token); draft_bytes: "
        "the weights one drafted token reads (the MTP layer, its top-k dense experts, lm_head)",
        "verify": "draft_ms, verify_ms and rollback_ms as EngineMtpDecoder runs them: one CUDA graph per token "
        "count where CUDA graphs run (graphs: true), else eager; verify_eager_ms the same verify eager on the "
        "decode math, and verify_graph_max_abs_logit_diff its largest logit difference from the graph's; the "
        "plain step graph-replayed where CUDA graphs run",
        "verify_classes": "verify_classes_ms: each kernel class of the classes part over all layers for the k + 1 "
        "tokens, captured and timed alone as there (without the verify's per-token KDA state records), and rest = "
        "verify_ms minus the classes: where a verify's time goes beside a plain step's (the classes part)",
        "formula": SPEC_FORMULA,
        "rows": rows,
    }


def class_times(engine: Engine, x: torch.Tensor, context: int, whole_ms: float, reps: int) -> dict[str, float]:
    """ms of each class for the rows of x at `context` (`class_steps`, each captured and replayed alone), and "rest":
    `whole_ms`, the step they belong to, less them."""
    times = {
        name: timed_ms(engine, replayable(engine, fn), reps=reps) / reps
        for name, fn in class_steps(engine, x, context).items()
    }
    times["rest"] = whole_ms - sum(times.values())
    return times


def verify_graph_diff(engine: Engine, step_ids: torch.Tensor, context: int, saved: list[torch.Tensor]) -> float | None:
    """The largest logit difference between the verify step replayed as a CUDA graph (`Engine.verify(graphs=True)`)
    and the eager verify; None off CUDA."""
    if engine.graphs is None:
        return None
    try:
        engine.restore_recurrent(0, saved)
        eager = engine.verify(0, step_ids, context)[0].float()
        engine.restore_recurrent(0, saved)
        return float((engine.verify(0, step_ids, context, graphs=True)[0].float() - eager).abs().max())
    finally:
        engine.restore_recurrent(0, saved)


def speculate_greedily(decoder: Any, tokens: list[int]) -> None:
    """One speculative step from the last of `tokens`; the tokens it yields are appended (greedy)."""
    tokens.extend(int(logits.argmax()) for logits in decoder.speculate(tokens[-1]))


def kernel_table(events: Any, cuda: bool, top: int = 25) -> dict[str, Any]:
    """Launch count, total own time and the `top` entries of a profiler's key_averages()."""
    rows = []
    for e in events:
        us = float(getattr(e, "self_device_time_total", 0.0)) if cuda else float(e.self_cpu_time_total)
        if us > 0:
            rows.append((us, e.key, int(e.count)))
    rows.sort(key=lambda r: (-r[0], r[1]))
    total = sum(r[0] for r in rows)
    return {
        "launches": sum(r[2] for r in rows),
        "distinct": len(rows),
        "total_ms": round(total / 1e3, 4),
        "top": [
            {"name": key[:160], "count": count, "ms": round(us / 1e3, 4), "share": round(us / total, 4)}
            for us, key, count in rows[:top]
        ],
    }


def project_gb10(classes: dict[str, tuple[float, int]]) -> dict[str, Any]:
    """Per class the larger of its bytes over the GB10's bandwidth and its H200 time scaled by SM count x clock."""
    scale = (H200["sms"] * H200["clock_ghz"]) / (GB10["sms"] * GB10["clock_ghz"])
    out: dict[str, Any] = {
        "formula": "per class c: t_c = max(bytes_c / BW, h200_ms_c x (132 x 1.98 GHz) / (48 x GB10 clock)); "
        "tok/s = 1000 / sum_c t_c (ms), batch 1",
        "assumptions": {
            "h200": H200,
            "gb10": GB10,
            "compute_scale": round(scale, 4),
            "bandwidths_gb_s": GB10_BANDWIDTHS,
            "caveats": "H200 kernel time is taken as SM-throughput-bound and scaled by SMs x clock; "
            "L2 size, launch latency and the GB10's unified memory are not modelled",
        },
        "classes": {},
    }
    for bw in GB10_BANDWIDTHS:
        total = 0.0
        for name, (ms, nbytes) in classes.items():
            memory_ms, compute_ms = nbytes / (float(bw) * 1e9) * 1e3, max(ms, 0.0) * scale
            row = out["classes"].setdefault(name, {"h200_ms": ms, "bytes": nbytes})
            row[f"gb10_ms_{bw}"] = round(max(memory_ms, compute_ms), 4)
            row[f"bound_{bw}"] = "bandwidth" if memory_ms >= compute_ms else "compute"
            total += max(memory_ms, compute_ms)
        out[f"gb10_ms_{bw}"] = round(total, 4)
        out[f"gb10_tok_s_{bw}"] = round(1000 / total, 2)
    return out


# --- measuring -----------------------------------------------------------------------------------------------------


def timed_ms(engine: Engine, work: Callable[[], object], reps: int = 1) -> float:
    """Wall time of `reps` calls of work, ms, the device synchronized before and after (CUDA events on a GPU)."""
    sync(engine)
    if engine.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            work()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def replayable(engine: Engine, fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured as a CUDA graph after one eager run (its replay), or fn itself off CUDA."""
    fn()
    if engine.device.type != "cuda":
        return fn
    sync(engine)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def random_ids(engine: Engine, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, engine.cfg.vocab, (n,), generator=gen)


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(engine: Engine) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if engine.device.type == "cuda" else None


def logical_expert_bytes(artifact: Any) -> int:
    """EXL3 bytes of one logical routed expert: gate, up and down, every rank slice (read from expert 0)."""
    layer = artifact.quantized_layers[0]
    parts = [artifact.read_expert(layer, 0, proj) for proj in PROJECTIONS]
    return artifact.ranks * sum(
        EXL3Tensor.storage_bytes(t.in_features, t.out_features, t.bits, t.codebook) for t in parts
    )


# --- report --------------------------------------------------------------------------------------------------------


def layer_bits(text: str) -> tuple[int | None, ...]:
    """--retained-layer-bits as encode parses it; argparse reports a bad entry."""
    try:
        return parse_layer_bits(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dummy_draft_head(spec: Any, bits: int, mtp_bits: int | None, directory: Path) -> Path:
    """A draft-head file of random EXL3 K `bits` weights of lm_head's shape in `directory`; with `mtp_bits`, also a
    random copy of the MTP layer (its linears at that K, its routed experts at K2, as `draft-head --mtp-bits`)."""
    path = directory / "draft_head.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = random_exl3(spec.hidden_size, spec.vocab_size, g, bits).tensors("lm_head")
    mtp = None
    if mtp_bits is not None:
        layer = spec.mtp_layers[0]
        for t in mtp_copy_tensors(spec, layer):
            k = mtp_bits if t.expert is None else DEFAULT_MTP_EXPERT_BITS
            tensors |= random_exl3(t.in_features, t.out_features, g, k).tensors(t.key)
        mtp = DraftMtp(layer, mtp_bits, DEFAULT_MTP_EXPERT_BITS, spec.n_routed_experts)
    write_draft_head(path, DraftHead("lm_head", bits, "mcg", spec.hidden_size, spec.vocab_size, mtp), tensors)
    return path


def model_record(artifact: Any, engine: Engine, load_s: float, config: Path, unheld: int) -> dict[str, Any]:
    spec, table, ckpt = artifact.spec, table_for(artifact.spec), artifact.checkpoint
    mtp = tuple(table.layer_prefix(layer) for layer in spec.mtp_layers)
    vision = {t.name for t in table.top_level(spec) if t.role is TensorRole.VISION}
    skipped = [n for n in ckpt.names() if (engine.mtp is None and n.startswith(mtp)) or n in vision]
    return {
        "config": str(config),
        "routed_experts": {  # --routed-experts: fewer held than the model has; a step reads the same per token
            "per_layer": artifact.spec.n_routed_experts,
            "per_token": artifact.spec.num_experts_per_tok,
            "unheld_per_layer": unheld,
            "unheld_are": "experts of the config not built (--routed-experts, a GPU smaller than the model): their "
            "router rows are counted in the bytes a step reads (classes, mtp), not timed",
        },
        "layout": artifact.layout,
        "bits": ckpt.plan.bits,
        "retained_bits": ckpt.plan.retained_bits,
        "retained_exact_layers": ckpt.plan.retained_exact_layers,
        "retained_layer_bits": None if ckpt.plan.retained_layer_bits is None else list(ckpt.plan.retained_layer_bits),
        "head_bits": ckpt.plan.head_bits,
        "retained_linears": sum(1 for lin in artifact.retained_linears.values() if lin.layer is not None),
        "head_exl3": any(lin.layer is None for lin in artifact.retained_linears.values()),  # --head-bits
        "exl3_stacks": exl3_stacks(engine),  # of those, what `exl3_linear` runs per step: three launches per stack
        "codebook": ckpt.plan.codebook,
        "planned_tensors": len(ckpt.names()),
        "load_s": round(load_s, 1),
        "resident_gb": round(torch.cuda.memory_allocated() / 1e9, 2) if engine.device.type == "cuda" else None,
        "not_resident": {
            "what": "MTP layer and vision tower (plain text decoding uses neither)"
            if engine.mtp is None
            else "vision tower (the MTP layer is resident: the mtp part runs)",
            "tensors": len(skipped),
            "bytes": sum(ckpt.spec(n).nbytes for n in skipped),
        },
    }


def environment(device: str) -> dict[str, Any]:
    def package(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: package(name) for name in ("triton", "transformers", "flash-linear-attention", "fla-core")},
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            cuda=torch.version.cuda,
        )
    else:
        env["gpu"] = None
    return env


def summary(report: dict[str, Any]) -> dict[str, Any]:
    parts = report["parts"]
    decode = parts.get("decode", [])
    first = min((r["context"] for r in decode), default=None)
    at = {r["batch"]: r["tok_s"] for r in decode if r["context"] == first}
    prefill = {r["tokens"]: r["seconds"] for r in parts.get("prefill", [])}
    projection = parts.get("classes", {}).get("projection", {})
    graphs = parts.get("graphs")
    mtp = {r["k"]: r for r in parts.get("mtp", {}).get("rows", [])}
    peaks = [v for k, v in parts.items() if k.endswith("_peak_gpu_gb") and v is not None]
    return {
        "decode_tok_s_b1": at.get(1),
        "decode_tok_s_b16": at.get(16),
        "decode_context": first,
        "prefill_200k_s": prefill.get(200_000),
        "peak_gpu_gb": max(peaks, default=None),
        "gb10_tok_s_218": projection.get("gb10_tok_s_218"),
        "gb10_tok_s_273": projection.get("gb10_tok_s_273"),
        "graphs_equal_eager": all(r["tokens_equal"] for r in graphs) if graphs else None,
        "logits_finite": all(r["logits_finite"] for r in graphs) if graphs else None,
        **{f"mtp_verify_ms_k{k}": r["verify_ms"] for k, r in mtp.items()},
        "mtp_draft_ms": mtp[1]["draft_ms"] if 1 in mtp else None,
        **{f"mtp_measured_tok_s_k{k}": r["measured_tok_s"] for k, r in mtp.items()},
    }


def is_speed_tier(report: dict[str, Any]) -> bool:
    """Whether the report's model is the speed tier: EXL3 retained linears or head (`--retained-bits`, `--head-bits`;
    reports from before --head-bits have no head_bits)."""
    model = report.get("model") or {}
    return any(model.get(k) is not None for k in ("retained_bits", "retained_layer_bits", "head_bits"))


def speed_tier(
    report: dict[str, Any], fidelity: dict[str, Any] | None, kl_cost_row: str | None = None
) -> dict[str, Any]:
    """The speed tier's figures (`--retained-bits`, `--head-bits`): what this run measures, and from `fidelity`
    (bench_fidelity's results) its KL cost at the same K: the proxy row with the same retained and head K
    (`retained-k4`, `retained-k4-head5`), or the row named `kl_cost_row`; null for what is not provided."""
    classes = report["parts"].get("classes", {})
    per_class = classes.get("classes", {})
    bits, head_bits = report["model"]["retained_bits"], report["model"].get("head_bits")
    exact = report["model"].get("retained_exact_layers", 0)  # reports from before the option have none
    layer_bits = report["model"].get("retained_layer_bits")
    kl_cost_ratio = None
    if kl_cost_row is not None:
        found = [r for r in (fidelity or {}).get("rows", []) if r["recipe"] == kl_cost_row]
        if not found:
            raise ValueError(f"--kl-cost-row {kl_cost_row}: no such row in the --fidelity results")
        row = found[0]
        kl_cost_ratio = row.get("kl_cost_ratio")
        widths = row.get("retained_layer_bits")  # the proxy's own widths: not necessarily what this run timed
        kl_from = f"the proxy fidelity run merged with --fidelity: its {kl_cost_row} row, named by --kl-cost-row" + (
            f" (the proxy's layers at {widths})" if widths else ""
        )
    elif layer_bits is not None:
        kl_from = "not measured: widths by layer have no row of their own; name the proxy's with --kl-cost-row"
    elif bits is None:
        kl_from = f"not measured: the proxy fidelity bench has no row with an EXL3 head alone (head_bits {head_bits})"
    else:
        recipe = f"retained-k{bits}" + (f"-head{head_bits}" if head_bits is not None else "")
        recipe += f"-exact{exact}" if exact else ""
        rows = (fidelity or {}).get("rows", [])
        kl_cost_ratio = next((r.get("kl_cost_ratio") for r in rows if r["recipe"] == recipe), None)
        head = "lm_head exact" if head_bits is None else f"lm_head EXL3 K{head_bits}"
        missing = "no --fidelity given" if fidelity is None else "the --fidelity results have no such row"
        kl_from = ("" if kl_cost_ratio is not None else f"not measured ({missing}): ") + (
            f"the proxy fidelity run merged with --fidelity: its {recipe} row, the retained linears' KL alone "
            f"(experts BF16, {head}) over the seed row's (the experts') KL"
            + (
                f"; the proxy's first {exact} of its own layers exact, not the same share of this model's"
                if exact
                else ""
            )
        )
    bytes_per_token = sum(c["bytes_per_token"] for c in per_class.values()) if per_class else None
    return {
        "retained_bits": bits,
        "retained_exact_layers": exact,
        "retained_layer_bits": layer_bits,
        "head_bits": head_bits,
        "bytes_per_token": bytes_per_token,
        "bytes_per_token_is": "batch-1 decode at the classes part's context, summed over its classes (the EXL3 "
        "retained linears and head at their stored bytes, those the run decodes at load, "
        "dense_linear_max_weights, at their dense bytes)",
        "gb10_tok_s_218": classes.get("projection", {}).get("gb10_tok_s_218"),
        # what no kernel can pass at these bytes: every class at the Spark's measured copy bandwidth, nothing else
        "gb10_bandwidth_bound_tok_s_218": round(218e9 / bytes_per_token, 2) if bytes_per_token else None,
        "mtp_speedup": (report.get("mtp_at_proxy_acceptance") or {}).get("speedup"),
        "gb10_mtp_speedup_218": (report.get("mtp_at_proxy_acceptance") or {}).get("gb10_speedup_218"),
        "mtp_speedup_from": "the mtp part (--parts mtp with --retained-bits) merged with --fidelity (the "
        "trained proxy's MTP acceptance): mtp_at_proxy_acceptance",
        "kl_cost_ratio": kl_cost_ratio,
        "kl_cost_ratio_from": kl_from,
    }


def mtp_at_acceptance(
    mtp: dict[str, Any], acceptance: dict[str, Any], plain_gb10: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The mtp part's step times at the tokens per verify step the trained proxy's MTP layer measured
    (bench_fidelity's mtp_acceptance): per k the projected tok/s (SPEC_FORMULA, the graph verify) and its speedup
    over the plain step, and the best k. A projection: the proxy's acceptance, this model's step times. With the
    classes part's GB10 projection (`plain_gb10`) and the mtp part's bytes, each k's step is projected on the GB10
    the same way (`gb10_218`)."""
    rows = []
    for row in mtp["rows"]:
        measured = acceptance.get(f"k{row['k']}")
        if measured is None:
            continue
        step_ms = row["k"] * row["draft_ms"] + row.get("verify_graph_ms", row["verify_ms"])  # older reports: both
        tok_s = 1000 * measured["tokens_per_step"] / step_ms
        rows.append(
            {
                "k": row["k"],
                "tokens_per_step": measured["tokens_per_step"],
                "acceptance_rate": measured["acceptance_rate"],
                "step_ms": round(step_ms, 4),
                "tok_s": round(tok_s, 2),
                "speedup": round(tok_s / mtp["plain_tok_s"], 3),
            }
        )
        if plain_gb10 is not None and "verify_bytes" in row and mtp.get("draft_bytes"):
            rows[-1]["gb10_218"] = gb10_speculation(row, mtp["draft_bytes"], measured["tokens_per_step"], plain_gb10)
    best = max(rows, key=lambda r: r["speedup"], default=None)
    best_gb10 = max((r for r in rows if "gb10_218" in r), key=lambda r: r["gb10_218"]["speedup"], default=None)
    return {
        "formula": "tok_s = 1000 x tokens_per_step / (k x draft_ms + verify_ms), speedup = tok_s / plain_tok_s; "
        + ROLLBACK_NOTE,
        "acceptance_from": {
            k: acceptance[k] for k in ("artifact", "prompts", "new_tokens", "draft_head") if k in acceptance
        },  # draft_head: the file the proxy's drafts read (None: the artifact's head)
        "plain_tok_s": mtp["plain_tok_s"],
        "rows": rows,
        "best_k": best["k"] if best else None,
        "speedup": best["speedup"] if best else None,
        "gb10_best_k": best_gb10["k"] if best_gb10 else None,
        "gb10_speedup_218": best_gb10["gb10_218"]["speedup"] if best_gb10 else None,
    }


def gb10_speculation(
    row: dict[str, Any], draft_bytes: int, tokens_per_step: float, plain_gb10: dict[str, Any]
) -> dict[str, Any]:
    """One k's speculative step projected on the GB10 (218 GB/s) as `project_gb10` projects a plain step: the
    verify per class, each draft as one class, at the proxy's tokens per step, over the plain step's projection."""
    verify = project_gb10({c: (ms, row["verify_bytes"][c]) for c, ms in row["verify_classes_ms"].items()})
    draft = project_gb10({"draft": (row["draft_ms"], draft_bytes)})
    verify_ms, draft_ms = verify["gb10_ms_218"], draft["gb10_ms_218"]
    step_ms = row["k"] * draft_ms + verify_ms
    tok_s = 1000 * tokens_per_step / step_ms
    return {
        "formula": "step = k x draft + verify, each max(bytes / 218 GB/s, H200 ms x compute scale) per class; "
        "tok/s = 1000 x tokens_per_step / step; speedup over the plain step's GB10 projection",
        "verify_ms": round(verify_ms, 4),
        "draft_ms": round(draft_ms, 4),
        "step_ms": round(step_ms, 4),
        "tok_s": round(tok_s, 2),
        "speedup": round(tok_s * plain_gb10.get("gb10_ms_218", 1000 / plain_gb10["gb10_tok_s_218"]) / 1000, 3),
    }


# what the parts of one merged report must share: the commit, the card and the model timed, and the drafts' settings
MERGE_FACTS = ("commit", "compile_decode", "draft_head_bits", "draft_mtp_bits", "dense_linear_max_weights")
MERGE_MODEL_FACTS = (
    "layout",
    "bits",
    "codebook",
    "retained_bits",
    "retained_exact_layers",
    "retained_layer_bits",
    "head_bits",
)
MERGE_ENVIRONMENT_FACTS = ("gpu", "torch", "triton")
DERIVED = ("summary", "speed_tier", "mtp_at_proxy_acceptance", "fidelity_from")  # recomputed by every merge


def merge_facts(report: dict[str, Any]) -> dict[str, Any]:
    """What a report's parts were timed with, by dotted key (`merge` refuses to combine parts that differ)."""
    model, environment = report.get("model") or {}, report.get("environment") or {}
    return {
        **{k: report.get(k) for k in MERGE_FACTS},
        **{f"model.{k}": model.get(k) for k in MERGE_MODEL_FACTS},
        "model.routed_experts.per_layer": (model.get("routed_experts") or {}).get("per_layer"),
        **{f"environment.{k}": environment.get(k) for k in MERGE_ENVIRONMENT_FACTS},
    }


def merge(
    reports: list[dict[str, Any]], fidelity: dict[str, Any] | None = None, kl_cost_row: str | None = None
) -> dict[str, Any]:
    """Later reports' parts replace earlier ones of the same name; the summary, the MTP projection and the speed
    tier are recomputed (an earlier merge's are not kept). With `fidelity` (bench_fidelity's results), the mtp part
    is projected at the trained proxy's MTP acceptance and the speed tier takes its KL cost. ValueError for reports
    timed at another commit, on another card or of another model (`merge_facts`), or an unknown `kl_cost_row`."""
    first = merge_facts(reports[0])
    for i, report in enumerate(reports[1:], start=2):
        differ = {k: (first[k], v) for k, v in merge_facts(report).items() if v != first[k]}
        if differ:
            said = "; ".join(f"{k} {a!r} in report 1, {b!r} in report {i}" for k, (a, b) in differ.items())
            raise ValueError(f"their parts were not timed alike: {said}")
    sources = [c for r in reports for c in (r.get("merged_from") or [r.get("command")])]  # merges of merges too
    kept = {k: v for k, v in reports[0].items() if k not in DERIVED}
    merged = {**kept, "parts": {}, "merged_from": sources}
    for r in reports:
        merged["parts"].update(r["parts"])
    merged["summary"] = summary(merged)
    if fidelity is not None:  # which proxy fidelity run the projection and the KL cost come from
        merged["fidelity_from"] = {k: fidelity.get(k) for k in ("format", "commit", "device")}
    acceptance = (fidelity or {}).get("mtp_acceptance")
    if acceptance and "rows" in merged["parts"].get("mtp", {}):
        plain_gb10 = merged["parts"].get("classes", {}).get("projection")
        projected = mtp_at_acceptance(merged["parts"]["mtp"], acceptance, plain_gb10)
        # the drafts timed here read a K copy of lm_head (--draft-head-bits) or the artifact's head (None), and a K
        # copy of the MTP layer (--draft-mtp-bits) or the artifact's BF16 one (None)
        merged["mtp_at_proxy_acceptance"] = projected | {
            "timed_draft_head_bits": merged.get("draft_head_bits"),
            "timed_draft_mtp_bits": merged.get("draft_mtp_bits"),
            # two baselines: the mtp part times its own plain step (after its prefill; up to 8 % slower than the classes
            # part's on the H100); the GB10 projection's plain step is the classes part's
            "speedup_over": "the mtp part's plain step (plain_tok_s)",
            "gb10_speedup_218_over": "the classes part's GB10 projection of the plain step",
        }
    if is_speed_tier(merged):
        merged["speed_tier"] = speed_tier(merged, fidelity, kl_cost_row)
    return merged


def save(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    main()
