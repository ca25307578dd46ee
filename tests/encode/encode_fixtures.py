"""What the encode tests share: the sources' shapes, a quiet console, building, observing and tier-encoding a source,
a file-digest helper and the verify-manifest CLI check."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.cli import app
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.run import EncodeResult
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe

QUIET = Console(quiet=True)
SMALL = TinyModelConfig(n_routed_experts=2, num_experts_per_tok=1)
# the speed tier's source, and any test that one MoE layer serves: two layers (a dense KDA layer, then an MLA/DSA MoE
# layer with a shared expert) hold every kind of retained linear that SMALL's three do (23 linears of its 35); its
# experts stay 512 wide, so tr3's rank slices are whole 128-wide EXL3 tensors (128-wide experts would pad each slice:
# 8 stored bits per weight at K2)
ONE_MOE = replace(SMALL, num_hidden_layers=2)
EPOCH = "1767225600"  # SOURCE_DATE_EPOCH of the encodes compared byte for byte: 2026-01-01T00:00:00Z


def another_checkpoint(source: Path, out: Path, norm: str) -> Path:
    """A copy of `source` at `out` with the 1-D tensor `norm` scaled by 1.5: another checkpoint of the same config
    and index."""
    shutil.copytree(source, out)
    with SourceCheckpoint.open(out) as ckpt:
        shard = out / ckpt.shard_of(norm)
    tensors = load_file(str(shard))
    tensors[norm] = tensors[norm] * 1.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return out


def tiny_source(factory: pytest.TempPathFactory, name: str, config: TinyModelConfig) -> Path:
    return build_tiny_checkpoint(factory.mktemp(name), config)


def observed(source: Path, factory: pytest.TempPathFactory, name: str, **options: Any) -> Path:
    """Observations of `source` over 4 rows of 64 tokens; `options` more ObserveConfig fields (dense_hessians,
    hessians, tiers)."""
    out = factory.mktemp(name)
    observe(ObserveConfig(source=source, out=out, rows=4, tokens=64, **options))
    return out


def encode_tiered(source: Path, observations: Path, out: Path, tiers: str, **options: Any) -> Path:
    """The artifact of `source` in `out` with expert tiers (option text, as `encode --tiers` takes it) and a fixed
    verification time; `options` more EncodeConfig fields."""
    config = EncodeConfig(
        source=source,
        out=out,
        observations=observations,
        tiers=tiers,  # type: ignore[arg-type]  # the config parses option text
        verified_at="2026-01-01T00:00:00Z",
        **options,
    )
    encode_artifact(config, QUIET)
    return out


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_verify_manifest_cli(result: EncodeResult) -> None:
    """The encode's own verification passed, and `glmquant verify-manifest` passes against the manifest hash it
    reported (the pinned-hash check a user runs)."""
    assert result.verification is not None and result.verification.ok
    art = result.artifact.directory
    verified = CliRunner().invoke(
        app, ["verify-manifest", str(art), "--expect-sha256", result.artifact.manifest_sha256]
    )
    assert verified.exit_code == 0, verified.output
