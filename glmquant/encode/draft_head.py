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

from glmquant.arch import load_model_spec
from glmquant.checkpoint.draft_head import DraftHead, write_draft_head
from glmquant.checkpoint.layouts import MARKER_PARTS, RetainedLinear, check_linear_bits, quantizable_head
from glmquant.checkpoint.reader import SourceCheckpoint, assert_finite
from glmquant.encode.layer import UnitInputs, encode_unit
from glmquant.encode.retained import dense_hessian
from glmquant.errors import NumericalError, UsageError
from glmquant.observe.summary import check_observed_from

DEFAULT_DRAFT_HEAD_BITS = 4


def build_draft_head(
    source: str | Path,
    observations: str | Path,
    out: str | Path,
    bits: int = DEFAULT_DRAFT_HEAD_BITS,
    codebook: str = "mcg",
    seed: int = 0,
    device: str = "cpu",
) -> DraftHead:
    """Encode the source's lm_head at K `bits` with its dense Hessian from `observations` (`observe
    --dense-hessians`) into the safetensors file `out` (written whole or not at all)."""
    source, observations, out = Path(source), Path(observations), Path(out)
    check_linear_bits("--bits", bits)
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
        weight = ckpt.read_tensor(head.source).float()
        try:
            assert_finite(head.source, weight)
        except NumericalError as exc:
            raise NumericalError(f"{ckpt.directory / ckpt.shard_of(head.source)}: {exc}") from None
    encoded = encode_unit(UnitInputs([head.key], [(weight, hessian)], [None], [bits]), None, codebook, seed, device)
    described = DraftHead(head.key, bits, codebook, head.in_features, head.out_features)
    write_draft_head(out, described, {name: t.cpu().contiguous() for name, t in encoded.tensors.items()})
    return described
