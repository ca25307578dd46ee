"""`glmquant draft-head SOURCE --observations OBS --out FILE`: an EXL3 copy of lm_head for the MTP drafter only
(`serve --speculative-config '{"method": "mtp", "draft_head": FILE}'`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from glmquant.checkpoint.hub import resolve_source
from glmquant.cli.common import HubRevision, guarded, out
from glmquant.encode.draft_head import DEFAULT_DRAFT_HEAD_BITS, DEFAULT_MTP_EXPERT_BITS, build_draft_head


def register(app: typer.Typer) -> None:
    app.command("draft-head")(draft_head)


@guarded
def draft_head(
    source: Annotated[str, typer.Argument(help="BF16 source checkpoint (directory or Hub id)")],
    observations: Annotated[
        Path, typer.Option(help="observations with lm_head's dense Hessian (observe --dense-hessians)")
    ],
    out_file: Annotated[Path, typer.Option("--out", help="draft-head safetensors file to write")],
    bits: Annotated[
        int, typer.Option(help="K of the copy (K4 kept the proxy's MTP acceptance)")
    ] = DEFAULT_DRAFT_HEAD_BITS,
    codebook: Annotated[str, typer.Option(help="EXL3 codebook: mcg, mul1 or 3inst")] = "mcg",
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    mtp_bits: Annotated[
        int | None,
        typer.Option(
            help="also encode the MTP layer's linears at this K (its routed experts at --mtp-expert-bits); the "
            "drafts then read this copy instead of the artifact's BF16 MTP layer"
        ),
    ] = None,
    mtp_expert_bits: Annotated[
        int | None,
        typer.Option(help=f"K of the MTP layer's routed experts, with --mtp-bits (default {DEFAULT_MTP_EXPERT_BITS})"),
    ] = None,
    revision: HubRevision = None,
) -> None:
    """Encode lm_head at K with its dense Hessian into a file the MTP drafter reads instead of the artifact's head
    (and, with --mtp-bits, the MTP layer itself); the verify keeps the artifact's tensors, so speculative output stays
    the artifact's greedy decoding."""
    head = build_draft_head(
        resolve_source(source, revision).path,
        observations,
        out_file,
        bits,
        codebook,
        0,
        device,
        mtp_bits,
        mtp_expert_bits,
    )
    mtp = (
        ""
        if head.mtp is None
        else (f", MTP layer {head.mtp.layer} at K{head.mtp.bits} (routed experts K{head.mtp.expert_bits})")
    )
    out.print(
        f"draft head: lm_head {head.out_features} x {head.in_features} at K{head.bits} ({head.codebook}){mtp} written "
        f'to {out_file}; serve with --speculative-config \'{{"method": "mtp", "draft_head": "{out_file}"}}\''
    )
