"""Calibration recipes -> packed token rows (with their SHA-256 for provenance)."""

from glmquant.calibration.build import build_token_rows, reuse_or_build, tokenizer_sha256
from glmquant.calibration.recipe import Lane, Recipe, SourceSpec, load_recipe
from glmquant.calibration.token_rows import LaneRows, TokenRows

__all__ = [
    "Lane",
    "LaneRows",
    "Recipe",
    "SourceSpec",
    "TokenRows",
    "build_token_rows",
    "load_recipe",
    "reuse_or_build",
    "tokenizer_sha256",
]
