"""`observe`: calibration rows through the model one decoder layer at a time, collecting per MoE layer the
REAP statistics and expert Hessians; resumable after a kill at any point (checkpointing.py).

Per layer: load only that layer's weights, push every lane's rows through it `batch_rows` at a time
(reading the streams entering the layer from disk, writing the streams leaving it), with hooks feeding
the statistics (lanes that `use: reap`) and Hessians (lanes that `use: hessians`), then save, commit
and free the layer. Memory: one layer + one batch of streams + the layer's accumulators.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from glmquant.calibration import TokenRows, load_recipe, reuse_or_build
from glmquant.checkpoint.reader import assert_finite
from glmquant.observe.capture import CaptureTargets, LayerCapture
from glmquant.observe.checkpointing import (
    clean_stale,
    drop_hidden,
    hidden_path,
    read_hidden,
    resume_point,
    write_hidden,
    write_state,
)
from glmquant.observe.config import ObserveConfig, fingerprint
from glmquant.observe.hessian_reader import hessians_path
from glmquant.observe.hessians import HessianAccumulator, HessianMode
from glmquant.observe.prune import write_prune_plan
from glmquant.observe.routing import RoutingParams
from glmquant.observe.stats import ExpertStats, LayerStats, stats_path
from glmquant.observe.streaming import TextModel, run_layer
from glmquant.observe.summary import LaneSummary, LayerSummary, ObservationSummary


def observe(config: ObserveConfig, progress: bool = False) -> ObservationSummary:
    """Run (or resume, or just re-summarize) an observation; returns what observations.json records."""
    from transformers import AutoTokenizer

    started = time.monotonic()
    config.out.mkdir(parents=True, exist_ok=True)
    model = TextModel.open(config.source, config.device)
    recipe = load_recipe(config.recipe).with_shape(config.rows, config.tokens)
    rows = reuse_or_build(recipe, AutoTokenizer.from_pretrained(str(config.source)), config.out)
    fp = fingerprint(config, rows.sha256, model.dtype)
    clean_stale(config.out)
    resumed = resume_point(config.out, fp)
    with model.ckpt, _progress(progress) as bar:
        if resumed is None:
            rows.save(config.out)
            _embed(model, rows, config, fp)
        layers = bar.add_task("layers", total=model.num_layers, completed=resumed or 0)
        batches = bar.add_task("rows", total=sum(lane.ids.shape[0] for lane in rows.lanes))
        for layer in range(resumed or 0, model.num_layers):
            bar.reset(batches, description=f"layer {layer}")
            _observe_layer(model, rows, config, layer, lambda n: bar.advance(batches, n))
            write_state(config.out, fp, layer + 1)
            drop_hidden(config.out, layer)
            bar.advance(layers)
    drop_hidden(config.out, model.num_layers)  # the final streams are not an output
    summary = _summarize(model, rows, config, fp, resumed, time.monotonic() - started)
    summary.save(config.out)
    return summary


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    disable=not enabled)


def _embed(model: TextModel, rows: TokenRows, config: ObserveConfig, fp: dict) -> None:
    """Streams entering layer 0 for every lane, then the first resume point."""
    for lane in rows.lanes:
        shape = (*lane.ids.shape, model.cfg.hc_mult, model.cfg.hidden_size)
        write_hidden(hidden_path(config.out, lane.name, 0), shape, model.dtype,
                     model.embed(lane.ids.split(config.batch_rows)))
    write_state(config.out, fp, 0)


def _observe_layer(model: TextModel, rows: TokenRows, config: ObserveConfig, layer: int, advance) -> None:
    module = model.layer(layer)
    spec, device = model.spec, model.device
    moe = spec.mlp_layer_types[layer] == "sparse"
    uses = {use for lane in rows.lanes for use in lane.use}
    stats = ExpertStats(spec.n_routed_experts, spec.num_experts_per_tok, device) if moe and "reap" in uses else None
    mode = config.hessians if moe else HessianMode.NONE
    hessians = None
    if "hessians" in uses and (mode is not HessianMode.NONE or config.dense_hessians):
        hessians = HessianAccumulator(mode, spec.n_routed_experts, spec.hidden_size, spec.moe_intermediate_size,
                                      device)
    with LayerCapture(module, model.plan(layer), RoutingParams.from_spec(spec)) as capture:
        for lane in rows.lanes:
            capture.targets = CaptureTargets(stats if "reap" in lane.use else None,
                                             hessians if "hessians" in lane.use else None, config.dense_hessians)
            shape = (*lane.ids.shape, model.cfg.hc_mult, model.cfg.hidden_size)
            source = hidden_path(config.out, lane.name, layer)
            write_hidden(hidden_path(config.out, lane.name, layer + 1), shape, model.dtype,
                         _forward(module, source, lane.ids.shape[0], config.batch_rows, device, layer, advance))
    if stats is not None:
        stats.result().save(stats_path(config.out, layer))
    if hessians is not None and not hessians.empty:
        hessians.save(hessians_path(config.out, layer), layer)
    del module, stats, hessians
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _forward(module: torch.nn.Module, source: Path, n_rows: int, step: int, device: torch.device, layer: int,
             advance) -> Iterator[torch.Tensor]:
    for start in range(0, n_rows, step):
        stop = min(start + step, n_rows)
        out = run_layer(module, read_hidden(source, start, stop).to(device))
        assert_finite(f"hidden streams leaving layer {layer} (rows {start}-{stop})", out)
        advance(stop - start)
        yield out


def _summarize(model: TextModel, rows: TokenRows, config: ObserveConfig, fp: dict, resumed: int | None,
               elapsed: float) -> ObservationSummary:
    layers = tuple(_layer_summary(model, config.out, i) for i in range(model.num_layers))
    plan = write_prune_plan(config.out, config.keep).name if config.keep is not None else None
    lanes = tuple(LaneSummary(x.name, x.ids.shape[0], x.ids.shape[1], x.use) for x in rows.lanes)
    peak_device = torch.cuda.max_memory_allocated() if model.device.type == "cuda" else None
    return ObservationSummary(
        str(config.source), str(config.recipe), rows.recipe_sha256, rows.sha256, lanes, config.hessians.value,
        config.dense_hessians, config.device, config.batch_rows, fp, layers,
        peak_rss_bytes(), peak_device, round(elapsed, 3), resumed, plan)


def _layer_summary(model: TextModel, obs_dir: Path, layer: int) -> LayerSummary:
    mlp, attention = model.spec.mlp_layer_types[layer], model.spec.attention_types[layer]
    hessians = hessians_path(obs_dir, layer)
    hessians_file = hessians.name if hessians.is_file() else None
    if not stats_path(obs_dir, layer).is_file():
        return LayerSummary(layer, "moe" if mlp == "sparse" else "dense", attention, None, hessians_file, 0, 0, 0.0)
    s = LayerStats.load(stats_path(obs_dir, layer))
    return LayerSummary(layer, "moe", attention, stats_path(obs_dir, layer).name, hessians_file, s.tokens,
                        int((s.count > 0).sum()), s.load_imbalance)


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
