"""A drafter's own lm_head: an EXL3 copy of the source's lm_head that only the MTP drafter reads (`glmquant
draft-head`, then `--speculative-config '{"draft_head": FILE}'`).

Each drafted token reads the MTP layer and an lm_head; with the faithful layout's BF16 head (2.04 GB on GLM-5.3-Flash)
the drafts cost what MTP gains on a bandwidth-bound machine (docs/speculative.md). The verify keeps the artifact's
own head and decides every token, so a coarser drafter's head changes how many drafts are accepted, never the output.
On the second seven-layer proxy a K4 copy kept the MTP acceptance (0.722 against the BF16 head's 0.710 at one
draft). The file is one safetensors file beside the artifact, not part of it: the artifact, its manifest and its
ExLlamaV3 export stay as they are, and a server may take it or not.
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.progress import track

from glmquant.arch import ModelSpec, load_model_spec
from glmquant.checkpoint.draft_head import DraftHead, DraftMtp, write_draft_head
from glmquant.checkpoint.layouts import (
    MARKER_PARTS,
    RetainedLinear,
    check_linear_bits,
    expert_slices,
    quantizable_head,
    quantizable_mtp,
)
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode.config import DEFAULT_EXPERTS_PER_UNIT
from glmquant.encode.hessians import HessianSource
from glmquant.encode.layer import UnitInputs, encode_unit, read_slices
from glmquant.encode.retained import dense_hessian
from glmquant.errors import UsageError
from glmquant.observe.hessian_reader import hessians_path
from glmquant.observe.hessians import HessianMode
from glmquant.observe.summary import ObservationSummary, check_observed_from

DEFAULT_DRAFT_HEAD_BITS = 4
DEFAULT_MTP_EXPERT_BITS = 2  # the artifact's own routed experts' K


def build_draft_head(
    source: str | Path,
    observations: str | Path,
    out: str | Path,
    bits: int = DEFAULT_DRAFT_HEAD_BITS,
    codebook: str = "mcg",
    seed: int = 0,
    device: str = "cpu",
    mtp_bits: int | None = None,
    mtp_expert_bits: int | None = None,
) -> DraftHead:
    """Encode the source's lm_head at K `bits` with its dense Hessian from `observations` (`observe
    --dense-hessians`) into the safetensors file `out` (written whole or not at all); with `mtp_bits`, also the MTP
    layer's linears at that K and its routed experts at `mtp_expert_bits` (default 2), each with its own Hessians from
    the same observations."""
    source, observations, out = Path(source), Path(observations), Path(out)
    check_linear_bits("--bits", bits)
    if mtp_bits is None and mtp_expert_bits is not None:
        raise UsageError("--mtp-expert-bits sets the K of the MTP layer's experts: it needs --mtp-bits")
    if mtp_expert_bits is None:
        mtp_expert_bits = DEFAULT_MTP_EXPERT_BITS
    if mtp_bits is not None:
        check_linear_bits("--mtp-bits", mtp_bits)
        if not 1 <= mtp_expert_bits <= 8:
            raise UsageError(f"--mtp-expert-bits must be 1..8, got {mtp_expert_bits}")
    if codebook not in MARKER_PARTS:
        raise UsageError(f"--codebook must be one of {', '.join(MARKER_PARTS)}, got {codebook!r}")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: its directory {out.parent} does not exist")
    spec = load_model_spec(source / "config.json")
    if not spec.mtp_layers:
        raise UsageError(f"{source}: {spec.architecture} has no MTP layer to draft with (num_nextn_predict_layers 0)")
    try:  # their messages name encode's --head-bits; this command has its own name
        head = RetainedLinear.of(quantizable_head(spec), bits)
        hessian, _ = dense_hessian(observations, head, False)
    except UsageError as exc:
        raise UsageError(str(exc).replace("--head-bits: ", "draft-head: ", 1)) from None
    with SourceCheckpoint.open(source) as ckpt:
        check_observed_from(observations, ckpt)
        weight = ckpt.read_finite_float(head.source)
        mtp = None if mtp_bits is None else _check_mtp_observed(spec, observations)
        encoded = encode_unit(UnitInputs([head.key], [(weight, hessian)], [None], [bits]), None, codebook, seed, device)
        tensors = _on_host(encoded.tensors)
        if mtp is not None:
            assert mtp_bits is not None
            tensors |= _encode_mtp_layer(
                spec, ckpt, observations, mtp, mtp_bits, mtp_expert_bits, codebook, seed, device
            )
    copy = None if mtp is None or mtp_bits is None else DraftMtp(mtp, mtp_bits, mtp_expert_bits, spec.n_routed_experts)
    described = DraftHead(head.key, bits, codebook, head.in_features, head.out_features, copy)
    write_draft_head(out, described, tensors)
    return described


def _check_mtp_observed(spec: ModelSpec, observations: Path) -> int:
    """The MTP layer's index, once the observations hold its Hessians (UsageError naming the file otherwise)."""
    layer = spec.mtp_layers[0]
    path = hessians_path(observations, layer)
    if not path.is_file():
        raise UsageError(
            f"draft-head --mtp-bits: {path} is missing: {observations} holds no Hessians of the MTP layer (layer "
            f"{layer}); observe with --dense-hessians into a new --out (observations made before the MTP layer's "
            "Hessians were captured lack them)"
        )
    return layer


def _encode_mtp_layer(
    spec: ModelSpec,
    ckpt: SourceCheckpoint,
    observations: Path,
    layer: int,
    bits: int,
    expert_bits: int,
    codebook: str,
    seed: int,
    device: str,
) -> dict[str, torch.Tensor]:
    """The MTP layer's EXL3 tensors: its linears at `bits` with their dense Hessians, its routed experts at
    `expert_bits` with their own (natural where observed, the all-token ones for an expert without tokens)."""
    mode = ObservationSummary.load(observations).hessians
    if mode == HessianMode.NONE.value:
        raise UsageError(
            f"draft-head --mtp-bits: {observations} holds no routed-expert Hessians (observed with --hessians none)"
        )
    linears = [RetainedLinear.of(t, bits) for t in quantizable_mtp(spec)]
    items = []
    for linear in linears:
        try:
            hessian, _ = dense_hessian(observations, linear, False)
        except UsageError as exc:
            raise UsageError(str(exc).replace(f"{linear.option}: ", "draft-head --mtp-bits: ", 1)) from None
        items.append((ckpt.read_finite_float(linear.source), hessian))
    names = [x.key for x in linears]
    found = _on_host(encode_unit(UnitInputs(names, items, [None] * len(items)), bits, codebook, seed, device).tensors)
    hessians = HessianSource(observations, "all" if mode == HessianMode.ALL.value else "natural").layer(layer)
    experts = range(spec.n_routed_experts)
    for first in track(experts[::DEFAULT_EXPERTS_PER_UNIT], description="MTP experts", transient=True):
        unit = [
            s for e in experts[first : first + DEFAULT_EXPERTS_PER_UNIT] for s in expert_slices(spec, layer, e, e, None)
        ]
        inputs, _ = read_slices(spec, layer, unit, ckpt, hessians)
        found |= _on_host(encode_unit(inputs, expert_bits, codebook, seed, device).tensors)
    return found


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One unit's encoded tensors in host memory, moved as each unit is done so the device holds one unit's."""
    return {name: t.cpu().contiguous() for name, t in tensors.items()}
