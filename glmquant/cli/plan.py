"""`glmquant plan CONFIG`: the predicted artifact, as a rich table or JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from glmquant.arch import load_model_spec
from glmquant.checkpoint.hub import CONFIG_FILES, resolve_source
from glmquant.checkpoint.layouts import parse_layer_bits, plan_artifact
from glmquant.cli.common import HubRevision, JsonFlag, guarded, out, print_json
from glmquant.errors import UsageError
from glmquant.observe.tiers import TierSpec, load_tier_plan, plan_structure_tiers
from glmquant.plan import load_source_shards, plan_to_json, summarize


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


@guarded
def plan(
    config: Annotated[str, typer.Argument(help="config.json, a directory holding one, or a Hub repo id")],
    source_index: Annotated[
        Path | None,
        typer.Option(help="source model.safetensors.index.json (default with a Hub repo id: the repo's)"),
    ] = None,
    layout: Annotated[str, typer.Option(help="tr3 or exllamav3")] = "tr3",
    bits: Annotated[int, typer.Option(help="bits per routed-expert weight (K)")] = 2,
    tier_plan: Annotated[
        Path | None,
        typer.Option(help="per-expert K from an observation's tier_plan.json (observe --tiers; replaces --bits)"),
    ] = None,
    tiers: Annotated[
        str | None,
        typer.Option(
            help="per-layer K by depth (depth:K3=4,K2=rest,K1=4) or named for each MoE layer (layers:K3,K2,...,K1), "
            "as encode --tiers; replaces --bits"
        ),
    ] = None,
    codebook: Annotated[str, typer.Option(help="mcg, mul1 or 3inst")] = "mcg",
    retained_bits: Annotated[
        int | None, typer.Option(help="as encode --retained-bits: the retained linears stored as EXL3 at this K")
    ] = None,
    retained_exact_layers: Annotated[
        int, typer.Option(help="as encode --retained-exact-layers: the first N layers' retained linears stay exact")
    ] = 0,
    retained_layer_bits: Annotated[
        str | None,
        typer.Option(help="as encode --retained-layer-bits: each decoder layer's K (K6,K6,K3,exact,... or K5x11,...)"),
    ] = None,
    head_bits: Annotated[
        int | None, typer.Option(help="as encode --head-bits: lm_head stored as EXL3 at this K")
    ] = None,
    as_json: JsonFlag = False,
    tensors: Annotated[bool, typer.Option(help="with --json: list every tensor of every file")] = True,
    revision: HubRevision = None,
) -> None:
    """Predict every output file, tensor and byte of an artifact from a config alone."""
    resolved = resolve_source(config, revision, CONFIG_FILES)
    repo_index = resolved.path / "model.safetensors.index.json"
    if source_index is None and resolved.repo_id is not None and repo_index.is_file():
        source_index = repo_index
    spec = load_model_spec(resolved.path)
    shards = load_source_shards(source_index) if source_index else None
    if tiers is not None and tier_plan is not None:
        raise UsageError("give --tiers or --tier-plan, not both")
    if tiers is not None:
        structure = TierSpec.parse(tiers)
        expert_bits = plan_structure_tiers(structure, spec.moe_layers, spec.n_routed_experts)
        bits = structure.rest_bits
    elif tier_plan is not None:
        plan_file = load_tier_plan(tier_plan, spec.moe_layers, spec.n_routed_experts)
        expert_bits, bits = plan_file.expert_bits, plan_file.rest_bits
    else:
        expert_bits = None
    result = plan_artifact(
        spec,
        layout,
        bits,
        codebook,
        shards,
        expert_bits=expert_bits,
        retained_bits=retained_bits,
        head_bits=head_bits,
        retained_exact_layers=retained_exact_layers,
        retained_layer_bits=None if retained_layer_bits is None else parse_layer_bits(retained_layer_bits),
    )
    summary = summarize(result)
    if as_json:
        print_json(plan_to_json(result, summary, tensors))
        return
    widths = "/".join(f"K{b}" for b in result.tier_bits)
    table = Table(title=f"{spec.architecture} → {layout} {widths} {codebook}")
    table.add_column("role")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    for r in summary.roles:
        table.add_row(r.role, f"{r.tensors:,}", f"{r.bytes:,}")
    table.add_section()
    table.add_row("[b]indexed tensors", f"[b]{summary.indexed_tensor_count:,}", f"[b]{summary.physical_bytes:,}")
    out.print(table)
    out.print(
        f"files: {summary.file_count} ({summary.expert_file_count} expert shards)   "
        f"MTP layer: {summary.mtp_tensors:,} tensors / {summary.mtp_bytes:,} B   "
        f"decode reads {summary.decode_bytes_per_token:,} B per token"
    )
