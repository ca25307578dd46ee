"""Each MoE layer's cost at each bit width, measured at the model's size, for `encode --tiers layers:...`.

On the six-MoE-layer proxy the widths of least summed cost, each layer's cost being the KL it causes alone (every
other layer exact) at K1-K4, beat every allocation by depth (docs/fidelity.md). Measuring that directly takes one
artifact per K and a forward per (layer, K). This measures it from the one artifact a build makes anyway:

- `kl_alone[L]`: the KL (mean per next-token position, against the source) of the source model with only layer
  L's routed experts taken from the artifact. One layer-streamed pass: the source's streams and one stream per MoE
  layer, which forks from the source's at its layer (memory: (2 + MoE layers) x rows x tokens x hc x H of the
  compute dtype, one layer, the head in float32 and one row's float32 logits twice);
- `error[L][K]`: the layer's MoE output error on the observations' tuning sample (`observe --tuning-tokens`), with
  a few of its experts (spread over their token counts) encoded at each K with their own natural Hessians and the
  encoder's defaults, untuned (so the ratio describes an untuned build with natural Hessians);
- `cost[L][K] = kl_alone[L] * error[L][K] / error[L][K_L]` (K_L: the layer's width in the artifact), the KL
  scaling with the output error's energy as it does to second order. On the six-MoE-layer proxy the ratios were
  alike across layers (K1/K2 11.5-14.9, K3/K2 0.140-0.147, K4/K2 0.029-0.032) where the KL at K2 differed 630x,
  and these costs chose the widths the direct measurement did.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress

from glmquant.arch import PROJECTIONS, table_for
from glmquant.calibration.token_rows import TokenRows
from glmquant.checkpoint.hashing import sha256_file
from glmquant.checkpoint.manifest import MANIFEST_NAME
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.devices import device_type
from glmquant.encode.hessians import HessianSource
from glmquant.encode.scale_tuning import expert_output
from glmquant.errors import UsageError
from glmquant.exl3 import decode_weight, encode_linears
from glmquant.observe.hessian_reader import hessians_path
from glmquant.observe.run import progress_bar
from glmquant.observe.streaming import TextModel, run_layer
from glmquant.observe.summary import check_observed_from
from glmquant.observe.tiers import TierSpec, allocate_layer_widths
from glmquant.observe.tuning_sample import TENSORS as TUNING_TENSORS
from glmquant.observe.tuning_sample import RoutedSample
from glmquant.runtime.artifact import Artifact, open_artifact

FORMAT = "glmquant.layer_costs.v1"
SWEEP_BITS = (1, 2, 3, 4)


@dataclass(frozen=True)
class LayerCosts:
    """What `measure_layer_costs` found, and the widths it chose; `write`/`load` as JSON (FORMAT)."""

    artifact_manifest_sha256: str
    token_rows_sha256: str
    rows: int
    tokens: int
    compute_dtype: str
    experts_sampled: dict[int, int]  # per MoE layer: --experts, or fewer where fewer experts had sampled tokens
    artifact_bits: dict[int, int]  # each MoE layer's K in the artifact
    kl_alone: dict[int, float]
    error: dict[int, dict[int, float]]  # sampled experts' MoE output error energy (sum of squares) by K
    cost: dict[int, dict[int, float]]
    mean_bits: float
    widths: dict[int, int]
    tiers: str  # `layers:...` for encode --tiers
    predicted_kl: float  # the chosen widths' summed cost
    seconds: dict[str, float]  # wall time of the streamed pass ("kl") and of the sampled encodes ("error")
    format: str = field(default=FORMAT)

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> LayerCosts:
        """A costs file `write` wrote; UsageError naming the file for another file or a damaged one."""
        data = read_costs_file(path, FORMAT, "layer costs")

        def by_layer(d: dict[str, Any], inner: bool = False) -> dict[int, Any]:
            return {int(k): ({int(b): float(x) for b, x in v.items()} if inner else v) for k, v in d.items()}

        with damaged_costs_file(path, "layer costs"):
            costs = cls(
                **{
                    **data,
                    "artifact_bits": by_layer(data["artifact_bits"]),
                    "kl_alone": by_layer(data["kl_alone"]),
                    "error": by_layer(data["error"], inner=True),
                    "cost": by_layer(data["cost"], inner=True),
                    "widths": by_layer(data["widths"]),
                    "experts_sampled": by_layer(data["experts_sampled"]),
                }
            )
            same_layers(costs.artifact_bits, costs.kl_alone, costs.error, costs.cost)
            return costs


def read_costs_file(path: Path, fmt: str, what: str) -> dict[str, Any]:
    """The JSON object of a costs file of format `fmt`; UsageError naming the file for an unreadable one or another
    format."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable {what} file ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"{path}: not a {what} file (format {found!r}, expected {fmt!r})")
    return data


def same_layers(*by_layer: dict[int, Any]) -> None:
    """ValueError unless every table of a costs file has the same layers (what choosing widths again reads)."""
    layers = [sorted(table) for table in by_layer]
    if any(other != layers[0] for other in layers[1:]):
        raise ValueError(f"its tables name different layers: {layers}")


@contextlib.contextmanager
def damaged_costs_file(path: Path, what: str) -> Iterator[None]:
    """A costs file of the right format whose fields do not parse is refused naming it (UsageError)."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{path}: a damaged {what} file ({type(exc).__name__}: {exc})") from None


def measure_layer_costs(
    source: str | Path,
    observations: str | Path,
    artifact_dir: str | Path,
    *,
    rows: int = 16,
    experts: int = 8,
    mean_bits: float | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    batch_rows: int = 4,
    progress: bool = False,
) -> LayerCosts:
    """Costs of each MoE layer of `artifact_dir` (built from `source`) at K1-K4, from `rows` calibration rows of
    `observations` and `experts` sampled experts per layer; widths of least summed cost at `mean_bits` (default: the
    artifact's mean K over its MoE layers)."""
    if rows < 1 or experts < 1 or batch_rows < 1:
        raise UsageError(f"--rows, --experts and --batch-rows must be >= 1, got {rows}, {experts}, {batch_rows}")
    _check_mean_bits(mean_bits)
    observations = Path(observations)
    manifest_sha256 = artifact_manifest_sha256(artifact_dir)
    with contextlib.ExitStack() as opened:
        model, artifact = open_for_costs(opened, source, artifact_dir, device, dtype)
        layers = _check_artifact(model, artifact, Path(artifact_dir))
        check_built_from(model, artifact, Path(artifact_dir))
        check_observed_from(observations, model.ckpt)
        bits = {layer: _layer_bits(artifact, layer) for layer in layers}
        _check_observations(observations, layers)  # before the pass, which is the long part
        token_rows, ids, bar = start_pass(opened, observations, rows, progress)
        forward = bar.add_task(f"forward, {len(layers)} forks", total=model.num_layers)
        started = time.monotonic()
        kl = layer_kl_alone(model, artifact, layers, ids, batch_rows, lambda: bar.advance(forward))
        seconds = {"kl": round(time.monotonic() - started, 1)}
        hessians = HessianSource(observations, "natural")
        sampled = bar.add_task(f"{experts} experts per layer at K1-K4", total=len(layers))
        error: dict[int, dict[int, float]] = {}
        picked: dict[int, list[int]] = {}
        for layer in layers:
            sweep = sorted({*SWEEP_BITS, bits[layer]})  # the artifact's own K is the ratios' denominator
            picked[layer], error[layer] = output_error_by_bits(model, artifact, hessians, layer, experts, sweep, device)
            if not error[layer][bits[layer]] > 0:
                raise UsageError(
                    f"{observations}: layer {layer}'s sampled experts {picked[layer]} give no output error at "
                    f"K{bits[layer]} on its tuning sample; nothing to scale the layer's KL by"
                )
            bar.advance(sampled)
        seconds["error"] = round(time.monotonic() - started - seconds["kl"], 1)
    cost = {layer: {k: kl[layer] * e / error[layer][bits[layer]] for k, e in error[layer].items()} for layer in layers}
    return LayerCosts(
        artifact_manifest_sha256=manifest_sha256,
        token_rows_sha256=token_rows.sha256,
        rows=int(ids.shape[0]),
        tokens=int(ids.shape[1]),
        compute_dtype=str(model.dtype).removeprefix("torch."),
        experts_sampled={layer: len(picked[layer]) for layer in layers},
        artifact_bits=bits,
        kl_alone=kl,
        error=error,
        cost=cost,
        **_layer_widths(cost, bits, mean_bits),
        seconds=seconds,
    )


def _check_mean_bits(mean_bits: float | None) -> None:
    if mean_bits is not None and not (min(SWEEP_BITS) <= mean_bits <= max(SWEEP_BITS)):
        raise UsageError(f"--mean-bits must be within K{min(SWEEP_BITS)}..K{max(SWEEP_BITS)} for the MoE layers")


def choose_layer_widths(costs: LayerCosts, mean_bits: float | None = None) -> LayerCosts:
    """`costs` with the widths of least summed cost at mean K `mean_bits` (default: the artifact's mean K over its
    MoE layers), from what it measured: no pass, no encode (`glmquant layer-widths`)."""
    return replace(costs, **_layer_widths(costs.cost, costs.artifact_bits, mean_bits))


def _layer_widths(cost: dict[int, dict[int, float]], bits: dict[int, int], mean_bits: float | None) -> dict[str, Any]:
    """The chosen-widths fields of `LayerCosts` (mean_bits, widths, tiers, predicted_kl) for costs `cost`."""
    _check_mean_bits(mean_bits)
    layers = sorted(cost)
    budget = mean_bits if mean_bits is not None else sum(bits.values()) / len(bits)
    widths = allocate_layer_widths(cost, budget)
    return {
        "mean_bits": budget,
        "widths": widths,
        "tiers": TierSpec.of_widths([widths[layer] for layer in layers]).text,
        "predicted_kl": sum(cost[layer][widths[layer]] for layer in layers),
    }


def open_for_costs(
    opened: contextlib.ExitStack, source: str | Path, artifact_dir: str | Path, device: str, dtype: str
) -> tuple[TextModel, Artifact]:
    """The source opened for streaming in `dtype` (auto: the model's) and the artifact, both closed with `opened`."""
    device_type(device)
    model = TextModel.open(source, device, None if dtype == "auto" else parse_dtype(dtype))
    opened.enter_context(model.ckpt)
    artifact = open_artifact(artifact_dir)
    opened.callback(artifact.checkpoint.close)
    return model, artifact


def check_built_from(model: TextModel, artifact: Artifact, path: Path) -> None:
    """UsageError unless the artifact's byte-for-byte copies of the source's 1-D tensors (norms, biases, KDA's
    decay parameters) equal the source's: costs against another checkpoint of the same config would measure the
    two models' difference, not the quantization's."""
    source, copies = model.ckpt, artifact.checkpoint
    assert isinstance(copies, SourceCheckpoint)  # open_artifact reads the artifact's files
    for name in copies.names():
        if name not in source or len(source.spec(name).shape) != 1 or copies.spec(name) != source.spec(name):
            continue  # not a copy of a source tensor (EXL3 parts, pruned router rows) or not a small one
        if copies.read_raw(name) != source.read_raw(name):
            raise UsageError(
                f"{path} was not built from this source: its copy of {name} differs from "
                f"{source.shard_of(name)}'s; give the checkpoint the artifact was encoded from"
            )


def start_pass(
    opened: contextlib.ExitStack, observations: Path, rows: int, progress: bool
) -> tuple[TokenRows, torch.Tensor, Progress]:
    """The observations' token rows, the first `rows` calibration rows and a progress bar, under no_grad until
    `opened` closes."""
    token_rows = TokenRows.load(observations)
    ids = calibration_rows(token_rows, rows, observations)
    bar = opened.enter_context(progress_bar(progress))
    opened.enter_context(torch.no_grad())
    return token_rows, ids, bar


@torch.no_grad()
def layer_kl_alone(
    model: TextModel,
    artifact: Artifact,
    layers: Sequence[int],
    ids: torch.Tensor,
    batch_rows: int,
    advance: Callable[[], None] = lambda: None,
    patch: Callable[[torch.nn.Module, Artifact, int], None] | None = None,
) -> dict[int, float]:
    """Mean KL(source || source with only layer L's routed experts from `artifact`) per next-token position, for
    each L of `layers`, in one pass holding the source's streams and one forked stream per layer reached. `patch`
    puts other weights of the artifact into the decoder layer module instead (the retained linears')."""
    patch = patch or _load_experts

    def through(module: torch.nn.Module, streams: torch.Tensor) -> torch.Tensor:
        return torch.cat([run_layer(module, part) for part in streams.split(batch_rows)])

    source = torch.cat(list(model.embed(ids.split(batch_rows))))
    forks: dict[int, torch.Tensor] = {}
    for index in range(model.num_layers):
        module = model.layer(index)
        after = through(module, source)
        for layer in list(forks):  # one fork's old and new streams at a time
            forks[layer] = through(module, forks[layer])
        if index in layers:
            patch(module, artifact, index)
            forks[index] = through(module, source)
        source = after
        del module
        advance()
    head = model.head_weight().float()

    def logprobs(streams: torch.Tensor) -> torch.Tensor:  # float32 from the final norm on
        return F.log_softmax(F.linear(model.collapse(streams).float(), head), -1)

    total = dict.fromkeys(forks, 0.0)
    for row in range(ids.shape[0]):  # one row's reference log-probabilities at a time
        reference = logprobs(source[row : row + 1])
        for layer, streams in forks.items():
            total[layer] += float((reference.exp() * (reference - logprobs(streams[row : row + 1]))).sum())
    out = {layer: value / (ids.shape[0] * ids.shape[1]) for layer, value in total.items()}
    bad = [layer for layer, value in out.items() if not math.isfinite(value)]
    if bad:
        raise UsageError(f"{artifact.path}: the weights of layer(s) {bad} make the logits non-finite")
    return out


def output_error_by_bits(
    model: TextModel,
    artifact: Artifact,
    hessians: HessianSource,
    layer: int,
    count: int,
    widths: Sequence[int],
    device: str,
) -> tuple[list[int], dict[int, float]]:
    """The experts picked and their MoE output error energy (summed over the tuning sample's tokens): `count`
    experts of `layer` (all that have sampled tokens, if fewer), spread
    over the sample's token counts, each encoded at every K of `widths` with its own Hessians (the artifact's
    codebook), against their source weights."""
    view = hessians.layer(layer)
    sample = view.sample()
    if sample is None:
        raise UsageError(
            f"{hessians.observations}: layer {layer} has no tuning sample; observe with --tuning-tokens N (e.g. 4096)"
        )
    tokens = torch.bincount(sample.expert_ids.flatten(), minlength=model.spec.n_routed_experts)
    ranked = [e for e in torch.argsort(tokens, descending=True, stable=True).tolist() if tokens[e] > 0]
    n = min(count, len(ranked))
    picked = sorted({ranked[round(i * (len(ranked) - 1) / max(n - 1, 1))] for i in range(n)})
    table = table_for(model.spec)
    source = {
        e: {p: model.ckpt.read_tensor(table.expert_name(layer, e, p)).float() for p in PROJECTIONS} for e in picked
    }
    items = []
    for e in picked:
        h = view.expert(e)
        items += [(source[e][p], h.down if p == "down_proj" else h.gate_up) for p in PROJECTIONS]
    on = torch.device(device)  # the outputs where the encoder ran
    mine = RoutedSample(*(t.to(on) for t in sample.routed_to(picked).tensors().values()))
    reference = _moe_output(
        {e: {p: w.to(on) for p, w in ws.items()} for e, ws in source.items()}, mine, model.spec.swiglu_limit
    )
    codebook = artifact.read_expert(layer, 0, "down_proj").codebook
    error = {}
    for k in widths:
        encoded = iter(encode_linears(items, k, codebook, device=device))
        weights = {
            e: {p: decode_weight(next(encoded).tensor.to(on), torch.float32) for p in PROJECTIONS} for e in picked
        }
        error[k] = float(((_moe_output(weights, mine, model.spec.swiglu_limit) - reference) ** 2).sum())
    return picked, error


def _moe_output(
    weights: dict[int, dict[str, torch.Tensor]], sample: RoutedSample, swiglu_limit: float | None
) -> torch.Tensor:
    """Σ over each token's slots routed to one of `weights`' experts of routing weight x expert output: [n, H]."""
    x = sample.inputs.float()
    out = torch.zeros_like(x)
    for e, w in weights.items():
        token, slot = (sample.expert_ids == e).nonzero(as_tuple=True)
        if token.numel():
            routed = sample.expert_weights[token, slot, None] * expert_output(w, x[token], swiglu_limit)
            out.index_add_(0, token, routed)
    return out


def _load_experts(module: torch.nn.Module, artifact: Artifact, layer: int) -> None:
    """Put the artifact's decoded routed experts of `layer` into the decoder layer module, in place."""
    experts: Any = module.get_submodule("mlp.experts")  # transformers' stacked experts: gate_up_proj, down_proj
    for e in range(artifact.spec.n_routed_experts):
        w = {p: artifact.decode_expert(layer, e, p, device=experts.down_proj.device) for p in PROJECTIONS}
        experts.gate_up_proj[e] = torch.cat((w["gate_proj"], w["up_proj"])).to(experts.gate_up_proj)
        experts.down_proj[e] = w["down_proj"].to(experts.down_proj)


def _layer_bits(artifact: Artifact, layer: int) -> int:
    """The one K of every routed expert of `layer` (from the tensor headers); a layer of several is refused."""
    widths = {
        artifact.checkpoint.spec(f"{artifact.expert_prefix(layer, v, p)}.trellis").shape[-1] // 16
        for v in range(artifact.virtual_experts)
        for p in PROJECTIONS
    }
    if len(widths) != 1:
        raise UsageError(
            f"{artifact.path}: layer {layer}'s experts have K {sorted(widths)}; layer costs need one K per layer (a "
            "uniform build, or tiers by layer)"
        )
    return widths.pop()


def _check_artifact(model: TextModel, artifact: Artifact, path: Path) -> list[int]:
    """The MoE layers the artifact quantized, after checking that it was built from a model of the source's shape
    with every expert kept."""
    fields = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_hidden_layers")
    check_same_shape(
        model,
        artifact,
        path,
        fields,
        ": another model, or pruned experts (layer costs compare every expert of a layer)",
    )
    return list(artifact.quantized_layers)


def check_same_shape(model: TextModel, artifact: Artifact, path: Path, fields: Sequence[str], why: str = "") -> None:
    """UsageError naming each of the specs' `fields` where the artifact differs from the source model."""
    theirs, ours = artifact.spec, model.spec
    differ = [
        f"{k} {getattr(theirs, k)} vs {getattr(ours, k)}" for k in fields if getattr(theirs, k) != getattr(ours, k)
    ]
    if differ:
        raise UsageError(f"{path} does not match the source ({', '.join(differ)}){why}")


def _check_observations(observations: Path, layers: Sequence[int]) -> None:
    """Every MoE layer's natural Hessians and tuning sample are in the observations (names only, nothing read)."""
    for layer in layers:
        path = hessians_path(observations, layer)
        if not path.is_file():
            raise UsageError(f"{path} is missing: layer costs need the observations the artifact was encoded with")
        names = set(parse_header(path).tensors)
        missing = [n for n in ("natural.gate_up.sum", "natural.down.sum", *TUNING_TENSORS) if n not in names]
        if missing:
            raise UsageError(
                f"{path} lacks {missing}: layer costs need natural Hessians and a tuning sample (observe with "
                "--hessians natural or both and --tuning-tokens N, e.g. 4096)"
            )


def calibration_rows(token_rows: TokenRows, rows: int, observations: Path) -> torch.Tensor:
    """The first `rows` rows of the first lane that feeds Hessians (calibration text, never held-out text)."""
    lanes = [lane for lane in token_rows.lanes if "hessians" in lane.use]
    if not lanes:
        raise UsageError(f"{observations}: no calibration lane feeds Hessians")
    ids = lanes[0].ids.long()
    if ids.shape[0] < rows:
        raise UsageError(f"{observations}: lane {lanes[0].name!r} has {ids.shape[0]} rows, fewer than --rows {rows}")
    return ids[:rows]


def parse_dtype(name: str) -> torch.dtype:
    found = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name)
    if found is None:
        raise UsageError(f"--dtype must be auto, float32 or bfloat16, not {name!r}")
    return found


def artifact_manifest_sha256(artifact_dir: str | Path) -> str:
    path = Path(artifact_dir) / MANIFEST_NAME
    if not path.is_file():
        raise UsageError(f"{path} is missing: costs are measured on a finished artifact (encode's output)")
    return sha256_file(path)
