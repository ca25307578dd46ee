"""Each decoder layer's retained linears' cost at each K, measured at the model's size, for `encode
--retained-layer-bits`.

The speed tier's KL cost sits in a few layers: on the second seven-layer proxy the widths of least summed cost,
each decoder layer's retained linears measured alone at K3-K6, had half uniform K4's KL at its bytes
(docs/fidelity.md). That measurement takes one build per K and a whole-model forward per (layer, K); on
GLM-5.3-Flash, 4 retained encodes and 180 forwards. As `layer_costs` does for the routed experts, this measures
it from the one speed-tier build a recipe starts from:

- `kl_alone[L]`: the KL (mean per next-token position, against the source) of the source with only decoder layer
  L's retained linears taken from the artifact, in one layer-streamed pass with a fork per layer
  (`layer_costs.layer_kl_alone`; memory (2 + layers) x rows x tokens x hc x H of the compute dtype);
- `error[L][K]`: over L's linears, the summed output error energy tr(E H Eᵀ) (H the linear's dense Hessian
  from `observe --dense-hessians`) of `outputs` evenly spaced output rows of each, encoded at each K with the
  artifact's codebook;
- `cost[L][K] = kl_alone[L] * (error[L][K] / error[L][K_L]) ** g` (K_L: the layer's K in the artifact); exact costs
  0. g = 1 would be the KL's second order; on the second seven-layer proxy each layer's measured KL fell about 2x per
  added bit where these errors fell 3.8x (g about 0.5 in all seven layers), and g = 0.5 chose the widths the direct
  measurement did where g = 1 did not (docs/encode.md), so 0.5 is the default (`--error-exponent`).

The widths of least summed cost within a byte budget (`allocate_widths`, exact allowed) are printed as
`--retained-layer-bits`. lm_head keeps its `--head-bits`; the MTP layer is not in the plain decode path.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glmquant.arch import table_for
from glmquant.checkpoint.layouts import RetainedLinear, layer_bits_text, width_name, width_of
from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.checkpoint.writer import atomic_write_text
from glmquant.encode.retained import dense_hessian
from glmquant.errors import UsageError
from glmquant.exl3 import Codebook, EXL3Tensor, decode_weight, encode_linears
from glmquant.observe.hessian_reader import hessians_path
from glmquant.observe.layer_costs import (
    artifact_manifest_sha256,
    check_built_from,
    check_same_shape,
    damaged_costs_file,
    layer_kl_alone,
    open_for_costs,
    read_costs_file,
    same_layers,
    start_pass,
)
from glmquant.observe.streaming import TextModel
from glmquant.observe.summary import check_observed_from
from glmquant.observe.width_allocation import allocate_widths
from glmquant.runtime.artifact import Artifact

FORMAT = "glmquant.retained_costs.v1"
# the K offered to each layer besides exact: issue 18's speed tier (K4-K6, K3 for a GB10's 30 tok/s) and K2, where
# the layers that cost least give bytes to those that cost most (docs/fidelity.md)
RETAINED_SWEEP_BITS = (2, 3, 4, 5, 6)


@dataclass(frozen=True)
class RetainedCosts:
    """What `measure_retained_costs` found, and the widths it chose; `write` as JSON (FORMAT; errors, costs, bytes
    and widths keyed by "K<bits>" or "exact")."""

    artifact_manifest_sha256: str
    token_rows_sha256: str
    rows: int
    tokens: int
    compute_dtype: str
    outputs_sampled: int  # output rows of each linear encoded at each K (all of a smaller linear's)
    error_exponent: float  # g of cost = kl_alone x (error ratio) ** g
    artifact_bits: dict[int, int]  # each decoder layer's K in the artifact
    kl_alone: dict[int, float]
    error: dict[int, dict[int, float]]  # summed output error energy of the sampled rows, by K
    cost: dict[int, dict[int | None, float]]  # None: exact
    nbytes: dict[int, dict[int | None, int]]  # the layer's stored bytes at each option (whole linears)
    budget_bytes: int
    offered: tuple[int | None, ...]  # the widths the allocation chose among (--widths)
    widths: dict[int, int | None]
    retained_layer_bits: str  # for encode --retained-layer-bits
    predicted_kl: float  # the chosen widths' summed cost
    seconds: dict[str, float]  # wall time of the streamed pass ("kl") and of the sampled encodes ("error")
    format: str = field(default=FORMAT)

    def write(self, path: Path) -> None:
        def named(by_option: dict[Any, Any]) -> dict[str, Any]:
            return {width_name(k): v for k, v in by_option.items()}

        data = asdict(self) | {
            "error": {layer: named(e) for layer, e in self.error.items()},
            "cost": {layer: named(c) for layer, c in self.cost.items()},
            "nbytes": {layer: named(b) for layer, b in self.nbytes.items()},
            "offered": [width_name(k) for k in self.offered],
            "widths": {layer: width_name(k) for layer, k in self.widths.items()},
        }
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> RetainedCosts:
        """A costs file `write` wrote; UsageError naming the file for another file or a damaged one."""
        data = read_costs_file(path, FORMAT, "retained costs")

        def by_layer(d: dict[str, Any], value: Callable[[Any], Any]) -> dict[int, Any]:
            return {int(layer): value(v) for layer, v in d.items()}

        def by_width(d: dict[str, Any]) -> dict[int | None, Any]:
            return {width_of(name): v for name, v in d.items()}

        with damaged_costs_file(path, "retained costs"):
            costs = cls(
                **{
                    **data,
                    "artifact_bits": by_layer(data["artifact_bits"], int),
                    "kl_alone": by_layer(data["kl_alone"], float),
                    "error": by_layer(data["error"], by_width),
                    "cost": by_layer(data["cost"], by_width),
                    "nbytes": by_layer(data["nbytes"], by_width),
                    "offered": tuple(width_of(name) for name in data["offered"]),
                    "widths": by_layer(data["widths"], width_of),
                }
            )
            same_layers(costs.artifact_bits, costs.kl_alone, costs.error, costs.cost, costs.nbytes)
            return costs


def measure_retained_costs(
    source: str | Path,
    observations: str | Path,
    artifact_dir: str | Path,
    *,
    rows: int = 16,
    outputs: int = 256,
    mean_bits: float | None = None,
    error_exponent: float = 0.5,
    offered: Sequence[int | None] | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    batch_rows: int = 4,
    progress: bool = False,
) -> RetainedCosts:
    """Costs of each decoder layer's retained linears of `artifact_dir` (a speed-tier build from `source`) at
    K2-K6 and exact, from `rows` calibration rows of `observations` and `outputs` sampled output rows per linear;
    widths of least summed cost within the retained bytes of mean K `mean_bits` (between the uniform widths'
    bytes; default: the artifact's own retained bytes), chosen among `offered` (default: all; e.g. K2, K4 and exact,
    the K the GEMV core runs, `docs/encode.md`)."""
    if rows < 1 or batch_rows < 1 or outputs < 1:
        raise UsageError(f"--rows, --batch-rows and --outputs must be >= 1, got {rows}, {batch_rows}, {outputs}")
    choices = _checked_choice(mean_bits, error_exponent, offered)
    sweep = RETAINED_SWEEP_BITS
    observations = Path(observations)
    manifest_sha256 = artifact_manifest_sha256(artifact_dir)
    with contextlib.ExitStack() as opened:
        model, artifact = open_for_costs(opened, source, artifact_dir, device, dtype)
        by_layer = _layer_linears(model, artifact, Path(artifact_dir))
        check_built_from(model, artifact, Path(artifact_dir))
        check_observed_from(observations, model.ckpt)
        bits = {layer: _one_bits(linears, Path(artifact_dir), layer) for layer, linears in by_layer.items()}
        _check_dense_hessians(observations, by_layer)  # before the pass, which is the long part
        codebook = artifact.read_linear(by_layer[min(by_layer)][0]).codebook
        token_rows, ids, bar = start_pass(opened, observations, rows, progress)
        forward = bar.add_task(f"forward, {len(by_layer)} forks", total=model.num_layers)
        started = time.monotonic()
        kl = layer_kl_alone(
            model,
            artifact,
            list(by_layer),
            ids,
            batch_rows,
            lambda: bar.advance(forward),
            patch=_retained_patch(model, artifact, by_layer),
        )
        seconds = {"kl": round(time.monotonic() - started, 1)}
        sampled = bar.add_task(f"{outputs} outputs per linear at K{min(sweep)}-K{max(sweep)}", total=len(by_layer))
        error: dict[int, dict[int, float]] = {}
        for layer, linears in by_layer.items():
            error[layer] = output_error_by_bits(
                model, observations, linears, sorted({*sweep, bits[layer]}), outputs, codebook, device
            )
            if not error[layer][bits[layer]] > 0:
                raise UsageError(
                    f"{observations}: layer {layer}'s retained linears give no output error at K{bits[layer]} on "
                    "their dense Hessians; nothing to scale the layer's KL by"
                )
            bar.advance(sampled)
        seconds["error"] = round(time.monotonic() - started - seconds["kl"], 1)
    nbytes = {  # the artifact's own K too, for the default budget, where it is outside the sweep
        layer: _option_bytes(linears, sorted({*sweep, bits[layer]}), codebook) for layer, linears in by_layer.items()
    }
    return RetainedCosts(
        artifact_manifest_sha256=manifest_sha256,
        token_rows_sha256=token_rows.sha256,
        rows=int(ids.shape[0]),
        tokens=int(ids.shape[1]),
        compute_dtype=str(model.dtype).removeprefix("torch."),
        outputs_sampled=outputs,
        artifact_bits=bits,
        kl_alone=kl,
        error=error,
        nbytes=nbytes,
        **_retained_widths(kl, error, bits, nbytes, mean_bits, error_exponent, choices),
        seconds=seconds,
    )


def choose_retained_widths(
    costs: RetainedCosts,
    *,
    mean_bits: float | None = None,
    error_exponent: float = 0.5,
    offered: Sequence[int | None] | None = None,
) -> RetainedCosts:
    """`costs` with its costs at `error_exponent` and its widths of least summed cost within the retained bytes of
    mean K `mean_bits` (default: the artifact's own), among `offered` (default: K2-K6 and exact), from what it
    measured (KL alone, output errors, bytes): no pass, no encode, so other budgets and widths are chosen in
    seconds (`glmquant retained-widths`)."""
    choices = _checked_choice(mean_bits, error_exponent, offered)
    fields = _retained_widths(
        costs.kl_alone, costs.error, costs.artifact_bits, costs.nbytes, mean_bits, error_exponent, choices
    )
    return replace(costs, **fields)


def _retained_widths(
    kl: dict[int, float],
    error: dict[int, dict[int, float]],
    bits: dict[int, int],
    nbytes: dict[int, dict[int | None, int]],
    mean_bits: float | None,
    error_exponent: float,
    choices: tuple[int | None, ...],
) -> dict[str, Any]:
    """The chosen-widths fields of `RetainedCosts` (the costs at `error_exponent`, budget, offered, widths,
    retained_layer_bits, predicted_kl) from what was measured."""
    cost: dict[int, dict[int | None, float]] = {
        layer: {
            None: 0.0,
            **{
                k: kl[layer] * (error[layer][k] / error[layer][bits[layer]]) ** error_exponent
                for k in RETAINED_SWEEP_BITS
            },
        }
        for layer in kl
    }
    budget = _budget(nbytes, bits, mean_bits)
    widths = allocate_widths(cost, nbytes, budget, choices)
    return {
        "error_exponent": error_exponent,
        "cost": cost,
        "budget_bytes": budget,
        "offered": choices,
        "widths": widths,
        "retained_layer_bits": layer_bits_text(k for _, k in sorted(widths.items())),
        "predicted_kl": sum(cost[layer][k] for layer, k in widths.items()),
    }


def _checked_choice(
    mean_bits: float | None, error_exponent: float, offered: Sequence[int | None] | None
) -> tuple[int | None, ...]:
    """The widths offered (default: the sweep's and exact), after the choice's options are checked (UsageError)."""
    if not 0 < error_exponent <= 2:
        raise UsageError(f"--error-exponent must be in (0, 2], got {error_exponent}")
    sweep = RETAINED_SWEEP_BITS
    choices: tuple[int | None, ...] = (*sweep, None) if offered is None else tuple(dict.fromkeys(offered))
    if not choices or any(k is not None and k not in sweep for k in choices):
        names = ",".join(width_name(k) for k in choices) or "nothing"
        raise UsageError(f"--widths takes K{min(sweep)}..K{max(sweep)} and exact, got {names}")
    if mean_bits is not None and not (min(sweep) <= mean_bits <= max(sweep)):
        raise UsageError(f"--mean-bits must be within K{min(sweep)}..K{max(sweep)} for the retained linears")
    return choices


def output_error_by_bits(
    model: TextModel,
    observations: Path,
    linears: Sequence[RetainedLinear],
    widths: Sequence[int],
    outputs: int,
    codebook: Codebook | str,
    device: str,
) -> dict[int, float]:
    """Σ over `linears` of tr(E H Eᵀ) at each K of `widths`: `outputs` evenly spaced output rows of each (all when it
    has no more) encoded with its dense Hessian H, E their decoded weights less the source's."""
    items: list[tuple[torch.Tensor, torch.Tensor]] = []
    for linear in linears:
        weight = model.ckpt.read_tensor(linear.source).float()
        if weight.shape[0] > outputs:
            weight = weight[torch.linspace(0, weight.shape[0] - 1, outputs).round().long()]
        hessian, _ = dense_hessian(observations, linear, False)  # UsageError naming the linear when it has none
        assert hessian is not None  # without the identity fallback dense_hessian returns one or raises
        items.append((weight, hessian))
    on = torch.device(device)
    error = {}
    for k in widths:
        total = 0.0
        for (weight, hessian), encoded in zip(items, encode_linears(items, k, codebook, device=device)):
            e = decode_weight(encoded.tensor.to(on), torch.float32) - weight.to(on)
            total += float(((e @ hessian.to(on)) * e).double().sum())
        error[k] = total
    return error


def _retained_patch(
    model: TextModel, artifact: Artifact, by_layer: dict[int, list[RetainedLinear]]
) -> Callable[[nn.Module, Artifact, int], None]:
    """Puts layer L's decoded retained linears from the artifact into the decoder layer module, in place."""
    prefix = table_for(model.spec).layer_prefix
    paths = {linear.key: path for path, linear in artifact.retained_linear_modules().items()}

    def patch(module: nn.Module, artifact: Artifact, layer: int) -> None:
        for linear in by_layer[layer]:
            held: Any = module.get_submodule(paths[linear.key].removeprefix(prefix(layer)))
            weight = decode_weight(artifact.read_linear(linear, held.weight.device), torch.float32)
            held.weight.copy_(weight.to(held.weight.dtype))

    return patch


def _layer_linears(model: TextModel, artifact: Artifact, path: Path) -> dict[int, list[RetainedLinear]]:
    """The artifact's EXL3 retained linears by decoder layer (lm_head and the MTP layer left out), after checking it
    was built from a model of the source's shape and encodes every decoder layer's."""
    check_same_shape(model, artifact, path, ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    by_layer: dict[int, list[RetainedLinear]] = {}
    for linear in artifact.retained_linears.values():
        if linear.layer is not None and linear.layer < model.num_layers:
            by_layer.setdefault(linear.layer, []).append(linear)
    exact = [layer for layer in range(model.num_layers) if layer not in by_layer]
    if exact:
        raise UsageError(
            f"{path}: decoder layer(s) {exact} keep their retained linears exact; retained costs scale each layer's "
            "KL from its K in the artifact: build with --retained-bits K (e.g. 4)"
        )
    return dict(sorted(by_layer.items()))


def _one_bits(linears: Sequence[RetainedLinear], path: Path, layer: int) -> int:
    widths = {linear.bits for linear in linears}
    if len(widths) != 1:
        raise UsageError(f"{path}: layer {layer}'s retained linears have K {sorted(widths)}; costs need one K a layer")
    return widths.pop()


def _check_dense_hessians(observations: Path, by_layer: dict[int, list[RetainedLinear]]) -> None:
    """Every retained linear's dense Hessian and the calibration rows are in the observations (names only)."""
    if not (observations / "token_rows.json").is_file():
        raise UsageError(
            f"{observations}: no token_rows.json; retained costs need the observations' calibration rows (give "
            "`glmquant observe --dense-hessians`'s output, not an artifact)"
        )
    for layer, linears in by_layer.items():
        path = hessians_path(observations, layer)
        names = set(parse_header(path).tensors) if path.is_file() else set()
        missing = [linear.source for linear in linears if f"dense.{linear.source}.sum" not in names]
        if missing:
            raise UsageError(
                f"{path} lacks the dense Hessians of {missing}: retained costs need the observations the speed tier "
                "was encoded with (observe --dense-hessians)"
            )


def _option_bytes(
    linears: Sequence[RetainedLinear], widths: Sequence[int], codebook: Codebook | str
) -> dict[int | None, int]:
    """A layer's stored bytes at each K (EXL3) and exact (BF16)."""
    out: dict[int | None, int] = {None: sum(2 * lin.in_features * lin.out_features for lin in linears)}
    for k in widths:
        out[k] = sum(EXL3Tensor.storage_bytes(lin.in_features, lin.out_features, k, codebook) for lin in linears)
    return out


def _budget(nbytes: dict[int, dict[int | None, int]], bits: dict[int, int], mean_bits: float | None) -> int:
    """The retained bytes to allocate: the artifact's own, or those of mean K `mean_bits`, linear between the
    uniform widths around it (stored bytes are linear in K)."""
    if mean_bits is None:
        return sum(nbytes[layer][k] for layer, k in bits.items())
    low, high = math.floor(mean_bits), math.ceil(mean_bits)
    at = {k: sum(by_option[k] for by_option in nbytes.values()) for k in (low, high)}
    return round(at[low] + (mean_bits - low) * (at[high] - at[low]))
