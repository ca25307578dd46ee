"""The token rows a calibration actually used, saved so a run can be reproduced and its provenance hashed.

`token_rows.safetensors` holds one int32 tensor `lane.<name>` [rows, tokens] per lane (metadata
format=glmquant.token_rows.v1); `token_rows.json` records the recipe, its hash, each lane's row sources
and SHA-256, and `token_rows_sha256`: the SHA-256 of all lanes' int32 little-endian row-major bytes
concatenated in recipe order (the value that goes into the artifact manifest's provenance).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import TensorSpec
from glmquant.checkpoint.tensor_bytes import tensor_to_bytes
from glmquant.checkpoint.writer import atomic_write_text, write_safetensors
from glmquant.errors import UsageError

ROWS_FILE = "token_rows.safetensors"
INFO_FILE = "token_rows.json"
FORMAT = "glmquant.token_rows.v1"


@dataclass(frozen=True)
class LaneRows:
    name: str
    use: tuple[str, ...]  # what the lane feeds: "hessians", "reap"
    ids: torch.Tensor  # [rows, tokens] int32
    row_sources: tuple[str, ...]  # the source each row was packed from

    @property
    def sha256(self) -> str:
        return hashlib.sha256(tensor_to_bytes(self.ids)).hexdigest()


@dataclass(frozen=True)
class TokenRows:
    lanes: tuple[LaneRows, ...]
    recipe: Mapping[str, Any]  # the resolved recipe (Recipe.describe())
    recipe_sha256: str
    tokenizer_sha256: str
    sources: Mapping[str, Mapping[str, Any]]  # per source: data file SHA-256, epochs used

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for lane in self.lanes:
            digest.update(tensor_to_bytes(lane.ids))
        return digest.hexdigest()

    def lane(self, name: str) -> LaneRows:
        return next(lane for lane in self.lanes if lane.name == name)

    def info(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "token_rows_sha256": self.sha256,
            "recipe_sha256": self.recipe_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "recipe": self.recipe,
            "sources": self.sources,
            "lanes": [
                {
                    "name": lane.name,
                    "use": list(lane.use),
                    "rows": lane.ids.shape[0],
                    "tokens": lane.ids.shape[1],
                    "sha256": lane.sha256,
                    "row_sources": list(lane.row_sources),
                }
                for lane in self.lanes
            ],
        }

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"lane.{lane.name}": lane.ids.to(torch.int32).contiguous() for lane in self.lanes}
        specs = [TensorSpec(k, "I32", tuple(v.shape)) for k, v in tensors.items()]
        write_safetensors(out_dir / ROWS_FILE, specs, lambda s: tensors[s.name], {"format": FORMAT})
        atomic_write_text(out_dir / INFO_FILE, json.dumps(self.info(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, out_dir: Path) -> TokenRows:
        """Read saved rows back, checking them against the SHA-256 recorded beside them."""
        try:
            info = json.loads((out_dir / INFO_FILE).read_text(encoding="utf-8"))
            with SourceCheckpoint.open(out_dir / ROWS_FILE) as f:
                tensors = {name: f.read_tensor(name) for name in f.names()}
            lanes = tuple(
                LaneRows(x["name"], tuple(x["use"]), tensors[f"lane.{x['name']}"], tuple(x["row_sources"]))
                for x in info["lanes"]
            )
            rows = cls(lanes, info["recipe"], info["recipe_sha256"], info["tokenizer_sha256"], info["sources"])
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{out_dir}: unreadable token rows ({exc})") from None
        if rows.sha256 != info["token_rows_sha256"]:
            raise UsageError(f"{out_dir / ROWS_FILE}: token bytes do not match the SHA-256 in {INFO_FILE}")
        return rows
