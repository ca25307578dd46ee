"""`observe`: calibration rows through the model one decoder layer at a time, collecting per MoE layer the
REAP statistics and expert Hessians; resumable after a kill at any point (checkpointing.py).

Per layer: load only that layer's weights and push every chunk of `batch_rows` rows of every lane through it
(read from the stream files entering the layer), with hooks feeding the statistics (lanes that `use: reap`) and
Hessians (lanes that `use: hessians`); hand the accumulators to the results sink (by default `ObservationFiles`:
save them in the observations directory; the fused build encodes the layer from them instead); then advance
the streams to the next layer. Memory: one layer + one chunk + the layer's accumulators. Disk: the streams
entering the layer plus the output chunks written so far. Output chunks that would take the streams past the
stream budget are not written while observing but recomputed once the layer's results are saved, when each
input chunk is deleted as soon as its output exists (a second forward of those chunks, for a smaller disk); the
layer stays loaded across the save for that, so its weights are read once (a resumed run reads them again).
Each layer's `LayerCost` splits the passes' wall time into weight loads, stream reads and writes (`parts_s`),
the rest being the forward with its hooks: scripts/scale_extrapolation.py scales each part on its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from glmquant.arch import load_model_spec
from glmquant.calibration import TokenRows, load_recipe, reuse_or_build
from glmquant.checkpoint.layouts import quantizable_head
from glmquant.checkpoint.reader import assert_finite, vector_tensors_sha256
from glmquant.errors import GlmquantError
from glmquant.observe.capture import CaptureTargets, LayerCapture
from glmquant.observe.checkpointing import RunState, clean_stale, resume_point, state_dir, write_state
from glmquant.observe.config import ObserveConfig, fingerprint
from glmquant.observe.hessian_reader import hessians_path
from glmquant.observe.hessians import HessianAccumulator, HessianMode
from glmquant.observe.prune import check_keep, write_prune_plan
from glmquant.observe.routing import RoutingParams
from glmquant.observe.stats import ExpertStats, LayerStats, stats_path
from glmquant.observe.streaming import TextModel, run_layer
from glmquant.observe.streams import Chunk, DeviceStreamStore, StreamStore
from glmquant.observe.summary import HeadSummary, LaneSummary, LayerCost, LayerSummary, ObservationSummary
from glmquant.observe.tiers import write_tier_plan
from glmquant.observe.tuning_sample import TuningSampler

Advance = Callable[[int], None]
T = TypeVar("T")


class LayerResults(Protocol):
    """Where each observed layer's accumulators go once every calibration row went through the layer."""

    kind: str  # recorded in the resume fingerprint: a run cannot switch sinks half-way

    def start(self, rows: TokenRows) -> None:
        """Called once the token rows are known, before the first layer."""

    def save(self, layer: int | None, stats: ExpertStats | None, hessians: HessianAccumulator | None) -> None:
        """Make the layer's results durable (the run records the layer as committed right after). Layer None:
        lm_head's Hessian (`--dense-hessians`), saved before the last layer's progress is recorded."""


class ObservationFiles:
    """The default sink: `layer-LL.stats.safetensors` and `layer-LL.hessians.safetensors` in the observations
    (`head.hessians.safetensors` for lm_head's)."""

    kind = "files"

    def __init__(self, obs_dir: Path) -> None:
        self.obs_dir = obs_dir

    def start(self, rows: TokenRows) -> None:
        pass

    def save(self, layer: int | None, stats: ExpertStats | None, hessians: HessianAccumulator | None) -> None:
        if stats is not None:
            assert layer is not None  # lm_head has no REAP statistics
            stats.result().save(stats_path(self.obs_dir, layer))
        if hessians is not None and not hessians.empty:
            hessians.save(hessians_path(self.obs_dir, layer), layer)


def observe(config: ObserveConfig, progress: bool = False, results: LayerResults | None = None) -> ObservationSummary:
    """Run (or resume, or just re-summarize) an observation; returns what observations.json records."""
    from transformers import AutoTokenizer

    started = time.monotonic()
    if config.keep is not None:  # before the hours of observing, not after
        check_keep(load_model_spec(Path(config.source) / "config.json"), config.keep, "--keep")
    results = results or ObservationFiles(config.out)
    config.out.mkdir(parents=True, exist_ok=True)
    model = TextModel.open(config.source, config.device)
    recipe = load_recipe(config.recipe).with_shape(config.rows, config.tokens)
    rows = reuse_or_build(recipe, AutoTokenizer.from_pretrained(str(config.source)), config.out)
    head = _observes_head(model, rows, config)
    mtp = head and bool(model.spec.mtp_layers)  # the MTP layer's Hessians come with lm_head's
    vectors = vector_tensors_sha256(model.ckpt)
    fp = {**fingerprint(config, rows.sha256, model.dtype, head, vectors, mtp), "results": results.kind}
    clean_stale(config.out)
    resumed = resume_point(config.out, fp)
    store_args = (
        state_dir(config.out),
        [(x.name, *x.ids.shape) for x in rows.lanes],
        config.batch_rows,
        (model.cfg.hc_mult, model.cfg.hidden_size),
        model.dtype,
        config.stream_budget_bytes,
    )
    if config.device_streams_every is None:
        streams = StreamStore(*store_args)
    else:
        streams = DeviceStreamStore(*store_args, device=model.device)
    results.start(rows)
    costs: dict[int | str, LayerCost] = {}
    with model.ckpt, progress_bar(progress) as bar, _writer_stopped_on_error(streams):
        state = resumed
        recomputed_from: int | None = None
        recompute_s: float | None = None
        if state is None:
            rows.save(config.out)
            _measured(model.device, costs.setdefault("embed", LayerCost()), "advance_s", _embed, model, rows, streams)
            state = RunState(fp, 0, False)
            if not streams.in_memory:
                write_state(config.out, fp, 0)
        elif isinstance(streams, DeviceStreamStore) and state.next_layer < model.num_layers:
            recomputed_from = _recompute_streams(model, rows, streams, state, costs.setdefault("resume", LayerCost()))
            recompute_s = costs["resume"].advance_s
        elif isinstance(streams, DeviceStreamStore):
            streams.drop_checkpoints()  # killed after its last layer was recorded, before its checkpoints were deleted
        layers = bar.add_task("layers", total=model.num_layers, completed=state.next_layer)
        chunks = bar.add_task("chunks", total=len(streams.chunks))

        def advance(n: int) -> None:
            bar.advance(chunks, n)

        for layer in range(state.next_layer, model.num_layers):
            cost = costs[layer] = LayerCost(chunks=len(streams.chunks))
            kept: torch.nn.Module | None = None  # the layer, when the observing pass leaves it to the advancing one
            if not (layer == state.next_layer and state.committed):
                bar.reset(chunks, description=f"layer {layer}")
                found, kept = _measured(
                    model.device, cost, "observe_s", _observe_pass, model, rows, config, streams, layer, advance, cost
                )
                _begin_checkpoint(config, streams, layer + 1, model.num_layers, early=True)  # beside `save`
                if found is not None:
                    results.save(layer, *found)
                    del found
                write_state(config.out, fp, layer, committed=True, checkpoint=_checkpoint_of(streams))
            bar.reset(chunks, description=f"layer {layer} streams")
            cost.recomputed_chunks = _measured(
                model.device, cost, "advance_s", _advance, model, streams, layer, advance, cost, kept
            )
            kept = None
            if layer == model.num_layers - 1 and head:
                head_cost = costs["head"] = LayerCost(chunks=len(streams.chunks))
                found_head = _measured(model.device, head_cost, "observe_s", _observe_head, model, rows, streams)
                results.save(None, None, found_head)
                del found_head
                if mtp:
                    mtp_cost = costs["mtp"] = LayerCost(chunks=len(streams.chunks))
                    found_mtp = _measured(
                        model.device, mtp_cost, "observe_s", _observe_mtp, model, rows, config, streams, mtp_cost
                    )
                    results.save(model.spec.mtp_layers[0], None, found_mtp)
                    del found_mtp
            _record_progress(config, fp, streams, layer + 1, model.num_layers, cost)
            streams.drop_layer(layer)
            bar.advance(layers)
    streams.drop_layer(model.num_layers)  # the final streams are not an output
    summary = _summarize(
        model, rows, config, fp, resumed.next_layer if resumed is not None else None, costs, time.monotonic() - started
    )
    summary = replace(summary, streams_recomputed_from=recomputed_from, streams_recompute_s=recompute_s)
    summary.save(config.out)
    return summary


def _record_progress(
    config: ObserveConfig, fp: dict, streams: StreamStore, next_layer: int, layers: int, cost: LayerCost
) -> None:
    """Record `next_layer` as the resume point. Device streams name their newest checkpoint beside it, from which
    (or from the embeddings) a rerun recomputes the streams entering `next_layer`; every `device_streams_every`
    layers the checkpoint `_begin_checkpoint` started is waited for first (begun here where it could not begin beside
    the results: the layer's outputs came from its advancing pass), and the older one is then deleted on a thread of
    its own. At the end every checkpoint is deleted. The wait is the layer's `advance.checkpoint` part; the writer's
    own time, overlapped or not, `checkpoint.write`."""
    if not isinstance(streams, DeviceStreamStore):
        write_state(config.out, fp, next_layer)
        return
    if next_layer == layers:
        write_state(config.out, fp, next_layer)
        streams.drop_checkpoints()
        return
    if _checkpoint_due(config, next_layer, layers):
        started = time.monotonic()
        _begin_checkpoint(config, streams, next_layer, layers, early=False)
        if streams.checkpointing == next_layer:
            try:
                nbytes, writing = streams.finish_checkpoint()
            except GlmquantError as err:
                if not _disk_full(err):
                    raise
                _skip_checkpoint(streams, err)  # the previous one stays named below
            else:
                write_state(config.out, fp, next_layer, checkpoint=next_layer)
                streams.drop_checkpoints(keep=next_layer, wait=False)  # the run goes on meanwhile
                elapsed = time.monotonic() - started
                cost.add_part("advance.checkpoint", elapsed, nbytes)
                cost.add_part("checkpoint.write", writing, nbytes)
                cost.advance_s = round(cost.advance_s + elapsed, 3)
                return
    write_state(config.out, fp, next_layer, checkpoint=streams.checkpointed)


def _skip_checkpoint(streams: DeviceStreamStore, err: GlmquantError) -> None:
    """A checkpoint the disk filled up under: its files deleted and the run going on without it, as where the disk had
    no room to begin it (the previous checkpoint, or the embeddings, stays what a killed run recomputes from)."""
    streams.cancel_checkpoint()
    streams.drop_checkpoints(keep=streams.checkpointed)
    since = "the embeddings" if streams.checkpointed is None else f"the checkpoint of layer {streams.checkpointed}"
    warnings.warn(f"{err}: checkpoint skipped; a killed run recomputes the streams from {since}", stacklevel=3)


def _disk_full(err: GlmquantError) -> bool:
    """Whether a write failed for want of space (`atomic_file` names the file and keeps the OSError as the cause)."""
    return isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC


def _checkpoint_of(streams: StreamStore) -> int | None:
    """The newest checkpoint written whole (device streams), which a rerun recomputes the streams from."""
    return streams.checkpointed if isinstance(streams, DeviceStreamStore) else None


def _recompute_streams(
    model: TextModel, rows: TokenRows, streams: DeviceStreamStore, state: RunState, cost: LayerCost
) -> int:
    """Device streams of a resumed run: those entering `state.next_layer`, from its newest checkpoint (or the
    embeddings) through the layers the run had finished (a plain forward: their results are kept). Returns the
    layer they were recomputed from (0: the embeddings)."""
    start = state.checkpoint
    if start is not None and not streams.has_checkpoint(start):
        warnings.warn(
            f"{streams.directory(start)}: the checkpoint the run recorded is not all there; its streams are "
            "recomputed from the embeddings",
            stacklevel=2,
        )
        start = None
    if start is None:
        _measured(model.device, cost, "advance_s", _embed, model, rows, streams)
        start = 0
    else:
        streams.restore(start)
    for layer in range(start, state.next_layer):
        _measured(model.device, cost, "advance_s", _advance, model, streams, layer, lambda _n: None, cost)
    return start


def _checkpoint_due(config: ObserveConfig, next_layer: int, layers: int) -> bool:
    """Whether device streams entering `next_layer` (not the final ones) are checkpointed: every
    `device_streams_every` layers."""
    every = config.device_streams_every
    if not every:
        return False
    return next_layer < layers and next_layer % every == 0


def _begin_checkpoint(config: ObserveConfig, streams: StreamStore, next_layer: int, layers: int, early: bool) -> None:
    """Start writing the due checkpoint of the streams entering `next_layer` once all of them are held, where the
    disk has room for it beside the previous one, which stays the resume point until the new one is written: free
    space of one layer's streams, twice that when `early` (right after the layer's observing pass, so that the
    layer's results, saved meanwhile, fit too). Early, the disk writes overlap the results' saving (a build encodes
    the layer meanwhile). Without room the checkpoint is skipped: a killed run recomputes the streams from the
    previous one (or the embeddings), a forward through the layers since, rather than waiting for a write in place
    of it now."""
    if not isinstance(streams, DeviceStreamStore) or not _checkpoint_due(config, next_layer, layers):
        return
    if streams.checkpointing == next_layer or not all(streams.has(next_layer, c) for c in streams.chunks):
        return
    streams.drop_checkpoints(keep=streams.checkpointed)  # a failed run's unfinished one, before measuring the room
    if shutil.disk_usage(config.out).free >= (2 if early else 1) * streams.layer_bytes:
        streams.start_checkpoint(next_layer)


@contextlib.contextmanager
def _writer_stopped_on_error(streams: StreamStore) -> Iterator[None]:
    """A run that fails or is interrupted stops its checkpoint writer after the chunk under way: the checkpoint was
    never recorded, so nothing reads it, and no thread goes on writing after the run has ended."""
    try:
        yield
    except BaseException as failure:
        if isinstance(streams, DeviceStreamStore):
            error = streams.cancel_checkpoint()
            if error is not None and error is not failure:
                failure.add_note(f"the stream checkpoint's writer failed too: {error}")
        raise


def _measured(device: torch.device, cost: LayerCost, field: str, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), its wall time added to `cost.<field>` and its device peak folded into `cost.peak_device_bytes`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.monotonic()
    result = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        cost.peak_device_bytes = max(cost.peak_device_bytes or 0, torch.cuda.max_memory_allocated(device))
    setattr(cost, field, round(getattr(cost, field) + time.monotonic() - started, 3))
    return result


def progress_bar(enabled: bool) -> Progress:
    """The layer-streamed stages' bars: description, bar, done of total, time."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not enabled
    )


def _lane_chunks(streams: StreamStore, lane: str) -> list[Chunk]:
    return [c for c in streams.chunks if c.lane == lane]


def _embed(model: TextModel, rows: TokenRows, streams: StreamStore) -> None:
    """Streams entering layer 0 for every lane (chunks a killed run already wrote are kept)."""
    for lane in rows.lanes:
        chunks = _lane_chunks(streams, lane.name)
        for chunk, emb in zip(chunks, model.embed(lane.ids[c.start : c.stop] for c in chunks)):
            if not streams.has(0, chunk):
                streams.write(0, chunk, emb)


def _observe_pass(
    model: TextModel,
    rows: TokenRows,
    config: ObserveConfig,
    streams: StreamStore,
    layer: int,
    advance: Advance,
    cost: LayerCost,
) -> tuple[tuple[ExpertStats | None, HessianAccumulator | None] | None, torch.nn.Module | None]:
    """Every chunk through the layer with the hooks on (writing the output chunks that fit the stream budget);
    returns the layer's accumulators (None for a layer with nothing to observe) and the layer itself when some
    output chunk is still missing (the advancing pass computes it without reading the weights again), else None."""
    spec, device = model.spec, model.device
    moe = spec.mlp_layer_types[layer] == "sparse"
    uses = {use for lane in rows.lanes for use in lane.use}
    stats = ExpertStats(spec.n_routed_experts, spec.num_experts_per_tok, device) if moe and "reap" in uses else None
    mode = config.hessians if moe else HessianMode.NONE
    hessians = None
    if "hessians" in uses and (mode is not HessianMode.NONE or config.dense_hessians):
        hessians = HessianAccumulator(
            mode,
            spec.n_routed_experts,
            spec.hidden_size,
            spec.moe_intermediate_size,
            device,
            config.hessian_weighting,
        )
        if moe and config.tuning_tokens:
            tokens = sum(lane.ids.numel() for lane in rows.lanes if "hessians" in lane.use)
            hessians.sampler = TuningSampler.over(config.tuning_tokens, tokens)
    if stats is None and hessians is None:
        return None, None
    module = _load(model, layer, cost, "observe")
    with LayerCapture(module, model.plan(layer), RoutingParams.from_spec(spec)) as capture:
        for lane in rows.lanes:
            capture.targets = CaptureTargets(
                stats if "reap" in lane.use else None,
                hessians if "hessians" in lane.use else None,
                config.dense_hessians,
            )
            for chunk in _lane_chunks(streams, lane.name):
                out = _forward(module, streams, layer, chunk, device, cost, "observe")
                if not streams.has(layer + 1, chunk) and streams.fits(chunk):
                    _write(streams, layer, chunk, out, cost, "observe")
                if streams.in_memory:  # the output replaces the input (rows are independent sequences)
                    streams.drop(layer, chunk)
                advance(1)
    if all(streams.has(layer + 1, chunk) for chunk in streams.chunks):
        del module
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return (stats, hessians), None
    return (stats, hessians), module


def _observes_head(model: TextModel, rows: TokenRows, config: ObserveConfig) -> bool:
    """Whether the run captures lm_head's Hessian: with --dense-hessians, a lane that feeds Hessians, and a head of
    the model's own (a tied one is the embedding, which `--head-bits` refuses)."""
    uses = {use for lane in rows.lanes for use in lane.use}
    return config.dense_hessians and "hessians" in uses and not model.spec.tie_word_embeddings


def _observe_head(model: TextModel, rows: TokenRows, streams: StreamStore) -> HessianAccumulator:
    """lm_head's dense Hessian: its input (the final norm's output over the streams leaving the last layer, as the
    model's forward computes it) over every token of the lanes that feed Hessians. Run (and saved) before the last
    layer's progress is recorded, so a killed run redoes it from the final streams (still on disk, or recomputed by a
    device-stream run)."""
    layer = model.num_layers
    hessians = HessianAccumulator(HessianMode.NONE, 0, 0, 0, model.device)
    name = quantizable_head(model.spec).name
    with torch.no_grad():
        for lane in rows.lanes:
            if "hessians" in lane.use:
                for chunk in _lane_chunks(streams, lane.name):
                    hessians.add_dense(name, model.collapse(streams.read(layer, chunk).to(model.device)))
    return hessians


def _observe_mtp(
    model: TextModel, rows: TokenRows, config: ObserveConfig, streams: StreamStore, cost: LayerCost
) -> HessianAccumulator:
    """The MTP layer's Hessians (its linears' dense ones and its routed experts' in `config.hessians`' mode): the
    layer run as the drafter runs it, position i taking the final hidden state h_i (lm_head's input) and the token
    t_{i+1} of the same row, over every token but each row's last of the lanes that feed Hessians. Run (and saved)
    with lm_head's, before the last layer's progress is recorded, from the same final streams."""
    spec, device = model.spec, model.device
    layer = spec.mtp_layers[0]
    hessians = HessianAccumulator(
        config.hessians,
        spec.n_routed_experts,
        spec.hidden_size,
        spec.moe_intermediate_size,
        device,
        config.hessian_weighting,
    )
    module = cast(Any, _load(model, layer, cost, "observe"))
    with LayerCapture(module, model.plan(layer), RoutingParams.from_spec(spec)) as capture:
        capture.targets = CaptureTargets(None, hessians, True)
        with torch.no_grad():
            for lane in rows.lanes:
                if "hessians" not in lane.use:
                    continue
                for chunk in _lane_chunks(streams, lane.name):
                    hidden = model.collapse(streams.read(model.num_layers, chunk).to(device))
                    ids = lane.ids[chunk.start : chunk.stop].to(device, torch.long)
                    module.block(hidden[:, :-1], ids[:, 1:], None)
    return hessians


def _advance(
    model: TextModel,
    streams: StreamStore,
    layer: int,
    advance: Advance,
    cost: LayerCost,
    module: torch.nn.Module | None = None,
) -> int:
    """The advancing pass (after the layer's results are saved): each output chunk not written yet, and each input
    chunk deleted as soon as its output exists. Uses `module` (the layer the observing pass kept) or loads the layer
    when an output is missing; returns how many outputs it computed."""
    computed = 0
    for chunk in streams.chunks:
        if not streams.has(layer + 1, chunk):
            if module is None:
                module = _load(model, layer, cost, "advance")
            out = _forward(module, streams, layer, chunk, model.device, cost, "advance")
            _write(streams, layer, chunk, out, cost, "advance")
            computed += 1
        streams.drop(layer, chunk)
        advance(1)
    return computed


def _load(model: TextModel, layer: int, cost: LayerCost, stage: str) -> torch.nn.Module:
    """The layer (the MTP layer for its index), its load timed into cost.parts_s["<stage>.load"]."""
    started = _now(model.device)
    module = model.mtp_layer() if layer in model.spec.mtp_layers else model.layer(layer)
    cost.load_bytes = sum(t.nbytes for t in module.state_dict().values())
    cost.add_part(f"{stage}.load", _now(model.device) - started, cost.load_bytes)
    return module


def _forward(
    module: torch.nn.Module,
    streams: StreamStore,
    layer: int,
    chunk: Chunk,
    device: torch.device,
    cost: LayerCost,
    stage: str,
) -> torch.Tensor:
    started = _now(device)
    streams_in = streams.read(layer, chunk).to(device)
    cost.add_part(f"{stage}.read", _now(device) - started, streams_in.nbytes)
    out = run_layer(module, streams_in)
    assert_finite(f"hidden streams leaving layer {layer} (lane {chunk.lane}, rows {chunk.start}-{chunk.stop})", out)
    return out


def _write(streams: StreamStore, layer: int, chunk: Chunk, out: torch.Tensor, cost: LayerCost, stage: str) -> None:
    """Output chunk `chunk` of `layer` (the streams entering layer + 1), timed into cost.parts_s."""
    started = _now(out.device)
    streams.write(layer + 1, chunk, out)
    cost.add_part(f"{stage}.write", _now(out.device) - started, out.nbytes)


def _now(device: torch.device) -> float:
    """The wall clock once the device's queued work is done (so a timed part excludes the work before it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def _summarize(
    model: TextModel,
    rows: TokenRows,
    config: ObserveConfig,
    fp: dict,
    resumed: int | None,
    costs: dict[int | str, LayerCost],
    elapsed: float,
) -> ObservationSummary:
    layers = tuple(replace(_layer_summary(model, config.out, i), cost=costs.get(i)) for i in range(model.num_layers))
    plan = write_prune_plan(config.out, config.keep) if config.keep is not None else None
    tiers = None
    if config.tiers is not None:  # tiers among the kept experts, in their output order
        kept = {int(layer): v for layer, v in json.loads(plan.read_text())["layers"].items()} if plan else None
        tiers = write_tier_plan(config.out, config.tiers, kept).name
    lanes = tuple(LaneSummary(x.name, x.ids.shape[0], x.ids.shape[1], x.use) for x in rows.lanes)
    head_file = hessians_path(config.out, None)
    head = HeadSummary(head_file.name, costs.get("head")) if head_file.is_file() else None
    mtp_file = hessians_path(config.out, model.spec.mtp_layers[0]) if model.spec.mtp_layers else None
    mtp = HeadSummary(mtp_file.name, costs.get("mtp")) if mtp_file is not None and mtp_file.is_file() else None
    peaks = [c.peak_device_bytes for c in costs.values() if c.peak_device_bytes is not None]
    peak_device = max(peaks, default=0) if model.device.type == "cuda" else None
    return ObservationSummary(
        str(config.source),
        str(config.recipe),
        rows.recipe_sha256,
        rows.sha256,
        lanes,
        config.hessians.value,
        config.dense_hessians,
        config.device,
        config.batch_rows,
        fp,
        layers,
        peak_rss_bytes(),
        peak_device,
        round(elapsed, 3),
        resumed,
        plan.name if plan is not None else None,
        tiers,
        config.hessian_weighting.value,
        head,
        mtp,
    )


def _layer_summary(model: TextModel, obs_dir: Path, layer: int) -> LayerSummary:
    mlp, attention = model.spec.mlp_layer_types[layer], model.spec.attention_types[layer]
    hessians = hessians_path(obs_dir, layer)
    hessians_file = hessians.name if hessians.is_file() else None
    if not stats_path(obs_dir, layer).is_file():
        return LayerSummary(layer, "moe" if mlp == "sparse" else "dense", attention, None, hessians_file, 0, 0, 0.0)
    s = LayerStats.load(stats_path(obs_dir, layer))
    return LayerSummary(
        layer,
        "moe",
        attention,
        stats_path(obs_dir, layer).name,
        hessians_file,
        s.tokens,
        int((s.count > 0).sum()),
        s.load_imbalance,
        s.routed_share,
    )


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's VmHWM belongs to the current program image, whereas
    ru_maxrss also counts the parent's pages a forked child held before exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
