"""The speed tier (`encode --retained-bits K`, `--head-bits K`): the retained linears and lm_head of a planned file
EXL3-encoded, each at its K.

Each linear (attention projections, shared experts, dense MLPs: `quantizable_retained`; lm_head:
`quantizable_head`) is encoded with its own Hessian, the one `observe --dense-hessians` captured for its checkpoint
weight name over all calibration tokens (lm_head's: the final norm's output, in `head.hessians.safetensors`).
A linear without one is refused with its name, unless the job asked for the uncalibrated fallback
(`--retained-uncalibrated-fallback`) or is uncalibrated as a whole. One planned file's linears are encoded in one
batched call per K (`encode_linears` gives each tensor the result it would get alone, so the bytes do not depend
on the grouping) and handed to the writer by output name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from glmquant.checkpoint.layouts import ArtifactPlan, PlannedFile, RetainedLinear
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.layer import EncodedLayer, UnitInputs, encode_unit
from glmquant.errors import UsageError
from glmquant.observe.hessian_reader import hessians_path, load_dense_hessian


def retained_linears(planned: PlannedFile) -> list[RetainedLinear]:
    """The distinct retained linears stored as EXL3 in one planned file, in file order."""
    return list(dict.fromkeys(t.linear for t in planned.tensors if t.linear is not None))


def dense_hessian(
    observations: Path | None, linear: RetainedLinear, fallback_identity: bool
) -> tuple[torch.Tensor | None, str | None]:
    """(E[x xᵀ] of the linear's input, fallback label); the label names the fallback taken, None when calibrated."""
    if observations is None:
        return None, "uncalibrated"
    problem = None
    path = hessians_path(observations, linear.layer)
    if not path.is_file():
        problem = f"{path}: no Hessians for " + ("lm_head's input" if linear.layer is None else f"layer {linear.layer}")
    else:
        try:
            mean = load_dense_hessian(observations, linear.layer, linear.source).mean()
        except UsageError as exc:
            problem = str(exc)
        else:
            if mean is not None:
                return mean, None
            problem = f"the dense Hessian of {linear.source} saw no calibration token"
    if fallback_identity:
        return None, "no_dense_hessian:identity"
    raise UsageError(
        f"{linear.option}: {linear.source} needs its dense Hessian ({problem}); observe again with --dense-hessians "
        f"into a new --out (observe adds none to {observations}: it refuses a rerun with other settings; or delete "
        f"{observations}/state to redo it there from the start), or pass --retained-uncalibrated-fallback to encode "
        "it uncalibrated"
    )


def check_dense_hessians(plan: ArtifactPlan, observations: Path | None, fallback_identity: bool) -> None:
    """Fail before any encoding when a retained linear lacks its Hessian (and no fallback was asked for)."""
    if observations is None or fallback_identity:
        return
    for f in plan.files:
        for linear in retained_linears(f):
            dense_hessian(observations, linear, fallback_identity)


def encode_retained_file(
    planned: PlannedFile,
    source: SourceCheckpoint,
    observations: Path | None,
    fallback_identity: bool,
    codebook: str,
    seed: int,
    device: str,
) -> EncodedLayer:
    """Every EXL3 retained linear of one planned file, each at its K, encoded in one call per K."""
    linears = retained_linears(planned)
    items: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    fallbacks: list[str | None] = []
    for linear in linears:
        weight = source.read_finite_float(linear.source)
        hessian, fallback = dense_hessian(observations, linear, fallback_identity)
        items.append((weight, hessian))
        fallbacks.append(fallback)
    inputs = UnitInputs([lin.key for lin in linears], items, fallbacks, [lin.bits for lin in linears])
    return encode_unit(inputs, None, codebook, seed, device)  # each linear's K is in the inputs


def retained_encoder(
    plan: ArtifactPlan,
    source: SourceCheckpoint,
    observations: Path | None,
    fallback_identity: bool,
    seed: int,
    device: str,
    on_encoded: Callable[[EncodedLayer], None] | None = None,
) -> Callable[[PlannedFile], Mapping[str, torch.Tensor]]:
    """What `write_retained_shards` asks for each file: its EXL3 retained linears' stored tensors, by name."""

    def encode(planned: PlannedFile) -> Mapping[str, torch.Tensor]:
        encoded = encode_retained_file(planned, source, observations, fallback_identity, plan.codebook, seed, device)
        if on_encoded is not None:
            on_encoded(encoded)
        return {name: t.cpu() for name, t in encoded.tensors.items()}

    return encode
