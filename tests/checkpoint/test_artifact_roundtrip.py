"""Both layouts written from the tiny source (placeholder EXL3 tensors), then read back and verified."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from checkpoint_artifacts import PROVENANCE, VERIFIED_AT, build, placeholder_experts

from glmquant.arch import load_model_spec
from glmquant.checkpoint.artifact_config import TR3_KEYS
from glmquant.checkpoint.artifact_writer import finalize_artifact, write_artifact_files
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.manifest import MANIFEST_NAME, manifest_text
from glmquant.checkpoint.provenance import build_timestamp
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.tensor import EXL3Tensor

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(params=["tr3", "exllamav3"])
def artifact(request: pytest.FixtureRequest):
    return request.getfixturevalue("tr3_artifact" if request.param == "tr3" else "exl3_artifact")


def test_full_verification_passes(artifact) -> None:
    plan, result = artifact
    report = verify_artifact(result.directory, expect_sha256=result.manifest_sha256, show_progress=False)
    assert report.ok, report.failure_summary()
    assert [c.name for c in report.checks] == [
        "manifest sha256",
        "manifest consistency",
        "files present",
        "file sha256",
        "unlisted files",
        "index closure",
        "no routed .weight names",
        "exl3 tensors",
        "config geometry",
        "retained totals",
    ]
    assert not any(c.skipped or c.warning for c in report.checks)


def test_plan_predicts_written_sizes(artifact) -> None:
    plan, result = artifact
    written = {f.path: (result.directory / f.path).stat().st_size for f in plan.files}
    assert written == {f.path: f.size for f in plan.files}
    assert result.physical_bytes == sum(f.size for f in plan.files)


def test_retained_bytes_identical_and_exl3_readable(artifact, tiny_source: Path) -> None:
    plan, result = artifact
    with SourceCheckpoint.open(tiny_source) as src, SourceCheckpoint.open(result.directory) as out:
        retained = [t for f in plan.files for t in f.tensors if t.source is not None]
        assert retained and all(out.read_raw(t.name) == src.read_raw(t.source) for t in retained)
        trellis = next(t for f in plan.files for t in f.tensors if t.part == "trellis")
        key = trellis.name.removesuffix(".trellis")
        parts = {n: out.read_tensor(n) for n in out.names() if n.startswith(key + ".")}
        x = EXL3Tensor.from_tensors(parts, key, trellis.expert.in_features, trellis.expert.out_features)
        assert x.codebook is Codebook.MCG and x.bits == 2


def test_manifest_bytes_and_model_card(artifact) -> None:
    _, result = artifact
    raw = (result.directory / MANIFEST_NAME).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == result.manifest_sha256
    manifest = json.loads(raw)
    assert raw.decode() == manifest_text(manifest) and manifest["schema_version"] == 2
    assert manifest["structurally_verified_at"] == VERIFIED_AT and manifest["state"] == "STRUCTURAL_PASS"
    assert [f["path"] for f in manifest["files"]] == sorted(f["path"] for f in manifest["files"])
    assert manifest["source"]["manifest_sha256"] == "a" * 64
    assert manifest["calibration"]["token_rows_sha256"] == "c" * 64
    card = (result.directory / "MODEL_CARD.md").read_bytes()
    entry = next(e for e in manifest["metadata_files"] if e["path"] == "MODEL_CARD.md")
    assert entry["sha256"] == hashlib.sha256(card).hexdigest() and b"verify-manifest" in card


def test_small_files_copied(artifact, tiny_source: Path) -> None:
    _, result = artifact
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
    ):
        assert (result.directory / name).read_bytes() == (tiny_source / name).read_bytes(), name


def test_tr3_config_matches_reference_keys(tr3_artifact) -> None:
    _, result = tr3_artifact
    reference = json.loads((DATA / "reference_tr3_quantization_config.json").read_text())
    config_text = (result.directory / "config.json").read_text()
    config = json.loads(config_text)
    block = config["quantization_config"]
    assert set(block) == set(reference) == TR3_KEYS
    assert config_text == json.dumps(config, indent=2, sort_keys=True) + "\n"
    assert {
        k: block[k]
        for k in (
            "bits",
            "codebook",
            "k2_experts_per_layer",
            "k3_experts_per_layer",
            "archive_tensor_parallel_size",
            "effective_routed_tier_bpw",
            "format",
        )
    } == {
        "bits": 2,
        "codebook": "mcg",
        "k2_experts_per_layer": 4,
        "k3_experts_per_layer": 0,
        "archive_tensor_parallel_size": 4,
        "effective_routed_tier_bpw": 2.0,
        "format": reference["format"],
    }
    assert block["session_calibration_manifest_sha256"] == "b" * 64 and block["source_manifest_sha256"] == "a" * 64
    assert json.loads((result.directory / "quantization_config.json").read_text()) == block


def test_exllamav3_config_and_storage(exl3_artifact) -> None:
    plan, result = exl3_artifact
    assert len(plan.files) > 1 and all(f.path.startswith("model-") for f in plan.files)
    block = json.loads((result.directory / "config.json").read_text())["quantization_config"]
    assert block == {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": 2.0,
        "head_bits": 16,
        "calibration": {"rows": 8, "cols": 64},
        "out_scales": "auto",
        "codebook": "mcg",
        "mtp_bits": 16,
    }
    storage = json.loads((result.directory / "quantization_config.json").read_text())["tensor_storage"]
    expert = storage["model.language_model.layers.1.mlp.experts.3.down_proj"]
    assert expert["quant_format"] == "exl3" and expert["bits_per_weight"] == 2
    assert expert["mcg_multiplier"] == 0xCBAC1FED
    assert expert["stored_tensors"]["model.language_model.layers.1.mlp.experts.3.down_proj.trellis"] == {
        "shape": [32, 8, 32],
        "n_bytes": 16384,
        "dtype": "torch.int16",
    }
    assert "quant_format" not in storage["lm_head"]


def test_rebuild_is_byte_identical(tr3_artifact, tiny_source: Path, tmp_path: Path) -> None:
    _, first = tr3_artifact
    _, again = build(tiny_source, tmp_path / "again", "tr3")
    assert again.manifest_sha256 == first.manifest_sha256
    for path in first.directory.iterdir():
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name


def test_pruned_build_slices_router_rows(tiny_source: Path, tmp_path: Path) -> None:
    keep = dict.fromkeys((1, 2, 3), (3, 1))  # MoE layers 1, 2 and the MTP layer 3
    plan, result = build(tiny_source, tmp_path / "pruned", "tr3", keep=keep)
    assert verify_artifact(result.directory, result.manifest_sha256, show_progress=False).ok
    config = json.loads((result.directory / "config.json").read_text())
    assert config["text_config"]["n_routed_experts"] == 2 and config["quantization_config"]["k2_experts_per_layer"] == 2
    with SourceCheckpoint.open(tiny_source) as src, SourceCheckpoint.open(result.directory) as out:
        for name in (
            "model.language_model.layers.1.mlp.gate.weight",
            "model.language_model.layers.3.mlp.gate.e_score_correction_bias",
        ):
            assert torch.equal(out.read_tensor(name), src.read_tensor(name)[[3, 1]])
        mtp = "model.language_model.layers.3.mlp.experts.{}.up_proj.weight"
        assert out.read_raw(mtp.format(0)) == src.read_raw(mtp.format(3))


def test_unverifiable_artifact_gets_no_manifest(tiny_source: Path, tmp_path: Path) -> None:
    with SourceCheckpoint.open(tiny_source) as source:
        plan = plan_artifact(load_model_spec(source.config_path), "tr3", source_shards=source.locations)
        write_artifact_files(plan, source, placeholder_experts, tmp_path)
        (tmp_path / "layer-02-part-tail-1.safetensors").unlink()
        with pytest.raises(CheckpointFormatError, match="layer-02-part-tail-1.safetensors"):
            finalize_artifact(plan, source, tmp_path, PROVENANCE, verified_at=VERIFIED_AT)
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_build_timestamp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")
    assert build_timestamp() == "2026-01-01T00:00:00Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "soon")
    with pytest.raises(UsageError, match="SOURCE_DATE_EPOCH"):
        build_timestamp()
