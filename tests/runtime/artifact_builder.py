"""Test artifacts without the (slow) encoder: the project's own writer lays out a tiny source checkpoint in
the tr3 or exllamav3 layout with random but valid EXL3 experts, sized like an initialized model's weights;
`write_reference` turns an artifact back into a source-named checkpoint whose experts are the decoded EXL3
weights (float32), which transformers' own `from_pretrained` loads as the reference model."""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from glmquant.arch import PROJECTIONS, load_model_spec, table_for
from glmquant.checkpoint.artifact_writer import finalize_artifact, write_artifact_files
from glmquant.checkpoint.layouts import PlannedFile, plan_artifact
from glmquant.checkpoint.provenance import Provenance
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.exl3 import Codebook, EXL3Tensor, decode_weight
from glmquant.runtime.artifact import open_artifact


def random_exl3(in_features: int, out_features: int, gen: torch.Generator, bits: int = 2) -> EXL3Tensor:
    """Random trellis; scales chosen so the decoded weight has rms ~ 0.6/sqrt(in) (an initialized model's)."""
    kp, np_ = -(-in_features // 128) * 128, -(-out_features // 128) * 128
    trellis = torch.randint(-32768, 32768, (kp // 16, np_ // 16, 16 * bits), generator=gen, dtype=torch.int32)
    sign = lambda n: torch.randint(0, 2, (n,), generator=gen) * 2 - 1  # noqa: E731
    suh = (sign(kp) * 0.6 / in_features**0.5).half()
    svh = (sign(np_) * (0.75 + 0.5 * torch.rand(np_, generator=gen))).half()
    return EXL3Tensor(trellis.to(torch.int16), suh, svh, Codebook.MCG, in_features, out_features)


def random_experts(planned: PlannedFile) -> Mapping[str, torch.Tensor]:
    """EXL3 parts for every expert slice of a planned file, seeded by the file name (reproducible)."""
    gen = torch.Generator().manual_seed(zlib.crc32(planned.path.encode()))
    out: dict[str, torch.Tensor] = {}
    for t in planned.tensors:
        if t.part == "trellis":
            out.update(random_exl3(t.expert.in_features, t.expert.out_features, gen).tensors(t.name.removesuffix(".trellis")))
    return out


def build_artifact(source: Path, out: Path, layout: str) -> Path:
    with SourceCheckpoint.open(source) as ckpt:
        plan = plan_artifact(load_model_spec(ckpt.config_path), layout, source_shards=ckpt.locations)
        write_artifact_files(plan, ckpt, random_experts, out)
        finalize_artifact(plan, ckpt, out, Provenance(source_repo="glmquant/tiny"), verified_at="2026-01-01T00:00:00Z")
    return out


def write_reference(artifact_dir: Path, out: Path) -> Path:
    """The artifact's weights under source names, experts dequantized (rank slices concatenated)."""
    artifact = open_artifact(artifact_dir)
    spec, table = artifact.spec, table_for(artifact.spec)
    tensors = {n: artifact.checkpoint.read_tensor(n) for n in artifact.checkpoint.names()
               if ".mlp.experts." not in n or n.endswith(".weight")}
    for layer in artifact.quantized_layers:
        for e in range(spec.n_routed_experts):
            for proj in PROJECTIONS:
                parts = [decode_weight(artifact.read_expert(layer, e * artifact.ranks + r, proj), torch.float32)
                         for r in range(artifact.ranks)]
                tensors[table.expert_name(layer, e, proj)] = torch.cat(parts, dim=1 if proj == "down_proj" else 0)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {k: v for k, v in json.loads((artifact_dir / "config.json").read_text()).items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config))
    for f in artifact_dir.iterdir():
        if f.suffix in (".jinja", ".json") and f.name.startswith(("tokenizer", "chat_template", "generation", "preprocessor")):
            shutil.copy(f, out / f.name)
    return out
