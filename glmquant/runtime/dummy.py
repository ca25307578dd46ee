"""`--load-format dummy`: an `Artifact` built from a config plus layout and bits (and retained and head bits for the
speed tier), with no weight files.

Its checkpoint is a `DummyCheckpoint` over `plan_artifact`'s prediction, so the runtime sees exactly the tensors
(names, shapes, dtypes) a real artifact of that config would hold, and every loader reads it unchanged; the
values are made on the device they are read on. The config gets the quantization block a real build writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glmquant.arch import load_model_spec, read_config
from glmquant.checkpoint.artifact_config import declared_linear_bits, output_config, quantization_block
from glmquant.checkpoint.dummy import DummyCheckpoint
from glmquant.checkpoint.layouts import TR3_RANKS, plan_artifact
from glmquant.checkpoint.provenance import Provenance
from glmquant.errors import ConfigError
from glmquant.runtime.artifact import Artifact


def dummy_artifact(
    config: str | Path,
    layout: str | None = None,
    bits: int | None = None,
    codebook: str | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    retained_bits: int | None = None,
    head_bits: int | None = None,
    retained_exact_layers: int | None = None,
    retained_layer_bits: tuple[int | None, ...] | None = None,
) -> Artifact:
    """The artifact `plan` predicts for `config` (a config.json or a directory holding one), values on `device`.
    Layout, bits, codebook, retained_bits, head_bits, retained_exact_layers and retained_layer_bits (the speed tier's
    EXL3 retained linears and lm_head, the first layers whose retained linears stay exact, or each layer's K)
    default to what the config's quantization block declares, else tr3 K2 MCG with exact retained linears and head;
    `retained_layer_bits` replaces the declared retained_bits and retained_exact_layers."""
    path = Path(config)
    raw = read_config(path)
    spec = load_model_spec(raw)
    if spec.family != "glm5_next":
        raise ConfigError(f"{path}: the runtime serves glm5_next models, not {spec.family}")
    declared = raw.get("quantization_config") or {}
    layout = layout or ("exllamav3" if declared and "rank_stacked_tp" not in declared else "tr3")
    bits = bits or int(declared.get("bits", 2))
    linears = declared_linear_bits(declared)
    if retained_layer_bits is not None:
        linears = linears._replace(retained_bits=None, retained_exact_layers=0)
    plan = plan_artifact(
        spec,
        layout,
        bits,
        codebook or declared.get("codebook", "mcg"),
        retained_bits=linears.retained_bits if retained_bits is None else retained_bits,
        head_bits=linears.head_bits if head_bits is None else head_bits,
        retained_exact_layers=linears.retained_exact_layers if retained_exact_layers is None else retained_exact_layers,
        retained_layer_bits=linears.retained_layer_bits if retained_layer_bits is None else retained_layer_bits,
    )
    block = quantization_block(plan, Provenance(source_repo="dummy", runtime_status="dummy"))
    checkpoint = DummyCheckpoint(plan, seed, torch.device(device))
    ranks = TR3_RANKS if layout == "tr3" else 1
    return Artifact(
        path if path.is_dir() else path.parent,
        output_config(raw, plan, block),
        spec,
        layout,
        ranks,
        tuple(spec.moe_layers),
        checkpoint,
    )
