"""MODEL_CARD.md: what the artifact is and how to check a download of it.

The card is one of the files EXL3_MANIFEST.json hashes, so it cannot carry the manifest's own SHA-256 (the
structural hash): that pin is published beside the artifact (encode and the demo print it) and checked with
`verify-manifest --expect-sha256`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glmquant.checkpoint.writer import atomic_write_text

MODEL_CARD_NAME = "MODEL_CARD.md"


def artifact_model_name(manifest: Mapping[str, Any]) -> str:
    """The artifact's model name: its source's name with the quantization, e.g. `GLM-5.3-Flash-EXL3-2bit`."""
    return f"{manifest['source']['repo_id'].rstrip('/').split('/')[-1]}-EXL3-{manifest['layout']['bits']}bit"


def model_card_text(manifest: Mapping[str, Any]) -> str:
    """A short README-style card summarising the manifest (written before the card's own entry is added)."""
    layout, geo, source = manifest["layout"], manifest["geometry"], manifest["source"]
    gib = manifest["physical_tensor_bytes"] / 1024**3
    lines = [
        f"# {source['repo_id']} — EXL3 {layout['bits']}-bit ({layout['type']} layout)",
        "",
        f"Routed experts of {len(layout['quantized_layers'])} MoE layers ({geo['n_routed_experts']} experts each) are "
        f"EXL3 K{layout['bits']} with the {layout['codebook']} codebook; every other tensor is copied "
        "byte-for-byte from the source.",
        "",
        "| | |",
        "|---|---|",
        f"| Source | {source['repo_id']} @ {source['revision'] or 'unpinned'} |",
        f"| Weight files | {len(manifest['files'])} ({manifest['physical_tensor_bytes']:,} bytes, {gib:.2f} GiB) |",
        f"| Indexed tensors | {manifest['indexed_tensor_count']:,} |",
        f"| Retained tensor bytes | {manifest['retained_tensor_bytes']:,} |",
        f"| Effective routed bpw | {manifest['effective_routed_tier_bpw']} (target {manifest['target_bpw']}) |",
        f"| State | {manifest['state']} at {manifest['structurally_verified_at']} |",
        "",
        "Verify a download (every file's size and SHA-256, index closure, EXL3 tensor shapes, config) against the",
        "structural SHA-256 (the SHA-256 of `EXL3_MANIFEST.json`) published with the artifact; this card is one of",
        "the files the manifest hashes, so the pin cannot be written here:",
        "",
        "```",
        "glmquant verify-manifest . --expect-sha256 <published structural SHA-256> --strict",
        "```",
        "",
    ]
    return "\n".join(lines)


def write_model_card(artifact_dir: str | Path, manifest: Mapping[str, Any]) -> Path:
    """Write MODEL_CARD.md from the manifest's facts."""
    path = Path(artifact_dir) / MODEL_CARD_NAME
    atomic_write_text(path, model_card_text(manifest))
    return path
