"""`glmquant verify-manifest`: every tamper case fails with its own message and exit code 1, unreadable
input exits 2, and an intact artifact exits 0."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import typer
from checkpoint_artifacts import PROVENANCE, VERIFIED_AT, build
from safetensors.torch import save_file
from typer.testing import CliRunner

from glmquant.checkpoint.index import INDEX_NAME, SafetensorsIndex, write_index
from glmquant.checkpoint.layouts import ArtifactPlan
from glmquant.checkpoint.manifest import MANIFEST_NAME, build_manifest, manifest_text, write_manifest
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.cli.verify_manifest import register

SHARD = "retained-00003-of-00015.safetensors"
EXPERTS = "layer-01-part-tail-0.safetensors"


def _app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


def run(*args: object) -> tuple[int, str]:
    """Exit code and output with rich's line wrapping undone."""
    result = CliRunner().invoke(_app(), ["verify-manifest", *map(str, args)])
    return result.exit_code, " ".join(result.output.split())


def report(*args: object) -> tuple[int, dict[str, dict]]:
    result = CliRunner().invoke(_app(), ["verify-manifest", *map(str, args), "--json"])
    return result.exit_code, {c["name"]: c for c in json.loads(result.output)["checks"]}


def test_intact_artifact_passes(tr3_artifact) -> None:
    _, result = tr3_artifact
    code, output = run(result.directory, "--expect-sha256", result.manifest_sha256)
    assert code == 0 and "PASS" in output and "FAIL" not in output
    code, checks = report(result.directory / MANIFEST_NAME, "--fast")
    assert code == 0 and checks["file sha256"]["skipped"]


def test_flipped_byte(tr3_copy: Path) -> None:
    path = tr3_copy / SHARD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    code, checks = report(tr3_copy)
    assert code == 1 and not checks["file sha256"]["ok"]
    assert f"{SHARD}: sha256" in checks["file sha256"]["detail"] and "(modified)" in checks["file sha256"]["detail"]
    assert run(tr3_copy, "--fast")[0] == 0  # headers only: a flipped data byte is what --fast cannot see


def test_truncated_shard(tr3_copy: Path) -> None:
    path = tr3_copy / SHARD
    size = path.stat().st_size
    os.truncate(path, size - 100)
    code, checks = report(tr3_copy, "--fast")
    assert code == 1
    assert f"{SHARD}: {size - 100} bytes, manifest records {size}" in checks["files present"]["detail"]
    assert "run past the end of the data" in checks["index closure"]["detail"]


def test_deleted_file(tr3_copy: Path) -> None:
    (tr3_copy / EXPERTS).unlink()
    code, checks = report(tr3_copy)
    assert code == 1 and checks["files present"]["detail"] == f"{EXPERTS}: missing"
    assert "expected by the config, missing from the files" in checks["config geometry"]["detail"]


def test_extra_weight_file(tr3_copy: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(tr3_copy / "extra.safetensors"))
    code, checks = report(tr3_copy)
    assert code == 1
    assert checks["unlisted files"]["detail"] == "extra.safetensors: weight file not listed in the manifest"
    assert [name for name, c in checks.items() if not c["ok"]] == ["unlisted files"]


def test_files_the_manifest_does_not_cover(tr3_copy: Path) -> None:
    """Every file is vouched for by the manifest, reported, or (a Hub repo's own files) expected; --strict fails
    on the reported ones, and a temporary file of a killed write always fails."""
    manifest = json.loads((tr3_copy / MANIFEST_NAME).read_text())
    assert "MODEL_CARD.md" in [e["path"] for e in manifest["metadata_files"]]
    assert run(tr3_copy, "--strict")[0] == 0
    (tr3_copy / "notes.txt").write_text("hello")
    (tr3_copy / ".x").write_text("")
    (tr3_copy / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (tr3_copy / "README.md").write_text("# hub card\n")
    code, checks = report(tr3_copy, "--fast")
    unlisted = checks["unlisted files"]
    assert code == 0 and unlisted["ok"] and unlisted["warning"]
    assert "not covered by the manifest: .x, notes.txt" in unlisted["detail"]
    assert ".gitattributes (Hub repository attributes), README.md (Hub repository card)" in unlisted["detail"]
    code, checks = report(tr3_copy, "--fast", "--strict")
    assert code == 1 and checks["unlisted files"]["detail"] == "not covered by the manifest (--strict): .x, notes.txt"
    (tr3_copy / "notes.txt").unlink()
    (tr3_copy / ".x").unlink()
    (tr3_copy / f".{SHARD}.tmp-4242").write_bytes(b"half a shard")
    code, checks = report(tr3_copy, "--fast")
    assert code == 1 and checks["unlisted files"]["detail"].startswith(f".{SHARD}.tmp-4242: temporary file")


def test_model_card_and_metadata_files_are_hashed(tr3_copy: Path) -> None:
    (tr3_copy / "MODEL_CARD.md").write_text("# edited card\n")
    code, checks = report(tr3_copy)
    assert code == 1 and "MODEL_CARD.md: " in checks["files present"]["detail"]
    manifest = json.loads((tr3_copy / MANIFEST_NAME).read_text())
    manifest["metadata_files"] = [e for e in manifest["metadata_files"] if e["path"] != "tokenizer.json"]
    (tr3_copy / MANIFEST_NAME).write_text(manifest_text(manifest))  # unpinned, it still hashes consistently
    code, checks = report(tr3_copy, "--fast")
    assert "not covered by the manifest: tokenizer.json" in checks["unlisted files"]["detail"]
    assert report(tr3_copy, "--fast", "--strict")[0] == 1


def test_edited_index(tr3_copy: Path) -> None:
    index = json.loads((tr3_copy / INDEX_NAME).read_text())
    del index["weight_map"]["lm_head.weight"]
    (tr3_copy / INDEX_NAME).write_text(json.dumps(index))
    code, checks = report(tr3_copy, "--fast")
    assert code == 1 and "lm_head.weight (in retained-" in checks["index closure"]["detail"]
    assert "is missing from model.safetensors.index.json" in checks["index closure"]["detail"]


def test_manifest_path_escaping(tr3_copy: Path, tmp_path: Path) -> None:
    manifest = json.loads((tr3_copy / MANIFEST_NAME).read_text())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tr3_copy / EXPERTS, outside)
    manifest["files"][0]["path"] = "../outside.safetensors"
    (tr3_copy / MANIFEST_NAME).write_text(manifest_text(manifest))
    code, checks = report(tr3_copy)
    assert code == 1
    assert "path '../outside.safetensors' escapes the artifact directory" in checks["manifest consistency"]["detail"]
    code, checks = report(tr3_copy / MANIFEST_NAME, "--manifest-only")
    assert code == 1 and "escapes the artifact directory" in checks["manifest consistency"]["detail"]


def test_symlink_out_of_artifact(tr3_copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(tr3_copy / EXPERTS, outside)
    (tr3_copy / EXPERTS).symlink_to(outside)
    code, checks = report(tr3_copy)
    assert code == 1 and "resolves outside the artifact directory" in checks["files present"]["detail"]


def test_wrong_expected_hash(tr3_artifact) -> None:
    _, result = tr3_artifact
    code, output = run(result.directory, "--expect-sha256", "0" * 64, "--fast")
    assert code == 1 and "FAIL" in output
    assert f"manifest sha256 {result.manifest_sha256} (does NOT match the pin)" in output
    code, checks = report(result.directory, "--expect-sha256", "0" * 64, "--fast")
    assert checks["manifest sha256"]["detail"] == f"manifest hashes to {result.manifest_sha256}, expected {'0' * 64}"
    assert [name for name, c in checks.items() if not c["ok"]] == ["manifest sha256"]


def test_usage_errors(tr3_artifact, tmp_path: Path) -> None:
    _, result = tr3_artifact
    code, output = run(result.directory, "--expect-sha256", "xyz")
    assert code == 2 and "must be 64 hex digits" in output
    code, output = run(tmp_path / "nowhere")
    assert code == 2 and "no such artifact directory" in output
    code, output = run(tmp_path / "nowhere", "--manifest-only")
    assert code == 2 and "no such file or directory" in output


def test_missing_or_broken_manifest_fails_verification(tr3_copy: Path) -> None:
    """A missing, truncated or broken EXL3_MANIFEST.json inside an artifact is a failed verification (1)."""
    path = tr3_copy / MANIFEST_NAME
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    for args in ((tr3_copy,), (path, "--manifest-only")):
        code, output = run(*args)
        assert code == 1 and "manifest is not valid JSON" in output and "FAIL 1 of 1 checks failed" in output
    path.write_text("[]")
    code, checks = report(tr3_copy)
    assert code == 1 and "manifest is not a JSON object" in checks["manifest readable"]["detail"]
    path.unlink()
    code, output = run(tr3_copy)
    assert code == 1 and "cannot read manifest" in output


def test_manifest_only(tr3_artifact, tmp_path: Path) -> None:
    _, result = tr3_artifact
    manifest_path = result.directory / MANIFEST_NAME
    code, checks = report(manifest_path, "--manifest-only", "--expect-sha256", result.manifest_sha256)
    assert code == 0 and list(checks) == ["manifest sha256", "manifest consistency"]
    code, output = run(manifest_path, "--manifest-only", "--expect-sha256", result.manifest_sha256)
    assert f"PASS all 2 checks passed manifest sha256 {result.manifest_sha256} (matches the pin)" in output
    manifest = json.loads((result.directory / MANIFEST_NAME).read_text())
    manifest["physical_tensor_bytes"] += 1
    (tmp_path / MANIFEST_NAME).write_text(manifest_text(manifest))
    code, checks = report(tmp_path / MANIFEST_NAME, "--manifest-only")
    assert code == 1 and "physical_tensor_bytes is" in checks["manifest consistency"]["detail"]
    code, output = run(tmp_path / MANIFEST_NAME, "--manifest-only")
    assert "FAIL 1 of 2 checks failed: manifest consistency manifest sha256" in output and "(not pinned)" in output


# The top-level fields of the published 2.0 bpw tr3 release's EXL3_MANIFEST.json, and of its layout block.
RELEASE_PROVENANCE_HASHES = (
    "k3_source_audit_manifest_sha256",
    "k4_audit_manifest_sha256",
    "k4_encoded_status_sha256",
    "selection_audit_manifest_sha256",
    "selection_manifest_sha256",
    "tail_encoded_status_sha256",
    "tail_source_audit_manifest_sha256",
    "tier_bitmap_sha256",
)
RELEASE_FIELDS = (
    "calibration",
    "effective_routed_tier_bpw",
    "files",
    "indexed_tensor_count",
    "layout",
    "method",
    "physical_tensor_bytes",
    "retained_manifest_sha256",
    "retained_tensor_bytes",
    "runtime",
    "schema_version",
    "source",
    "state",
    "structurally_verified_at",
    "target_bpw",
    *RELEASE_PROVENANCE_HASHES,
)


def release_form(manifest: dict) -> dict:
    """Our manifest with exactly the release's fields: no metadata_files, retained_tensor_count, geometry or entry
    kinds; expert entries as the release writes them (tier "k2-k3-tail"), another writer's method block."""
    files = []
    for e in manifest["files"]:
        keep = (
            ("gpu", "logical_expert_count", "shadow_expert_count")
            if e["kind"] == "expert"
            else ("tensor_bytes", "tensor_count")
        )
        entry = {k: e[k] for k in ("path", "bytes", "sha256", *keep)}
        files.append({**entry, "tier": "k2-k3-tail"} if e["kind"] == "expert" else entry)
    n = manifest["layout"]["experts_per_layer"]
    release = {
        **{k: manifest.get(k) for k in RELEASE_FIELDS},
        "files": files,
        "layout": {
            "type": "tr3",
            "tail_experts_per_layer": n,
            "k4_retained_experts_per_layer": 0,
            "shadow_tail_tensors_physically_present_but_unindexed": 0,
        },
        "method": {"claim": manifest["method"]["claim"], "implementation": "the release's own builder"},
    }
    assert sorted(release) == sorted(RELEASE_FIELDS)
    return release


def test_release_manifest_verifies(tr3_copy: Path) -> None:
    """The release's manifest fields alone verify, manifest-only and as a full directory (geometry from
    config.json); the files it does not list are reported, not failed."""
    release = release_form(json.loads((tr3_copy / MANIFEST_NAME).read_text()))
    text = manifest_text(release)
    (tr3_copy / MANIFEST_NAME).write_text(text)
    pin = hashlib.sha256(text.encode()).hexdigest()
    code, output = run(tr3_copy / MANIFEST_NAME, "--manifest-only", "--expect-sha256", pin)
    assert code == 0 and f"PASS all 2 checks passed manifest sha256 {pin} (matches the pin)" in output
    code, checks = report(tr3_copy, "--expect-sha256", pin)
    assert code == 0, {k: c["detail"] for k, c in checks.items() if not c["ok"]}
    assert "not covered by the manifest: " in checks["unlisted files"]["detail"]
    assert "config.json" in checks["unlisted files"]["detail"]
    assert "retained_manifest_sha256 not recomputed" in checks["retained totals"]["detail"]
    release["files"][0]["logical_expert_count"] += 1
    (tr3_copy / MANIFEST_NAME).write_text(manifest_text(release))
    code, checks = report(tr3_copy, "--fast")
    assert code == 1 and "logical_expert_count 3, file has 2" in checks["retained totals"]["detail"]


def _reseal(directory: Path, plan: ArtifactPlan, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Tamper with the expert file's tensors, then rewrite index and manifest so that every size and hash
    matches again: only the structural checks can notice."""
    with SourceCheckpoint.open(directory / EXPERTS) as f:
        tensors = {n: f.read_tensor(n).clone() for n in f.names()}
    edit(tensors)
    save_file(tensors, str(directory / EXPERTS))
    specs = {f.path: parse_header(directory / f.path).specs for f in plan.files}
    weight_map = {s.name: path for path, ss in specs.items() for s in ss}
    total = sum(s.nbytes for ss in specs.values() for s in ss)
    write_index(directory / INDEX_NAME, SafetensorsIndex(weight_map, total))
    metadata = [e["path"] for e in json.loads((directory / MANIFEST_NAME).read_text())["metadata_files"]]
    write_manifest(directory, build_manifest(plan, directory, PROVENANCE, VERIFIED_AT, metadata))


KEY = "model.language_model.layers.1.mlp.experts.0.gate_proj.rank0"


def _add_routed_weight(t: dict[str, torch.Tensor]) -> None:
    t["model.language_model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(512, 128, dtype=torch.bfloat16)


def _widen_trellis(t: dict[str, torch.Tensor]) -> None:
    t[f"{KEY}.trellis"] = torch.zeros(8, 8, 48, dtype=torch.int16)  # K=3 in a K2 artifact


def _drop_marker(t: dict[str, torch.Tensor]) -> None:
    del t[f"{KEY}.mcg"]


@pytest.mark.parametrize(
    "edit,failing,message",
    [
        (
            _add_routed_weight,
            "no routed .weight names",
            f"{KEY[:-6]}.weight ({EXPERTS}): original routed weight of quantized layer 1",
        ),
        (_widen_trellis, "config geometry", f"{KEY}.trellis: I16 [8, 8, 48], config implies I16 [8, 8, 32]"),
        (_drop_marker, "exl3 tensors", f"{KEY}: 0 codebook markers (.mcg/.mul1), expected exactly one"),
    ],
)
def test_sealed_structural_defects(tr3_artifact, tr3_copy: Path, edit, failing: str, message: str) -> None:
    _reseal(tr3_copy, tr3_artifact[0], edit)
    code, checks = report(tr3_copy)
    assert code == 1 and checks["file sha256"]["ok"] and checks["index closure"]["ok"]
    assert not checks[failing]["ok"] and message in checks[failing]["detail"]


def _reseal_metadata(directory: Path, plan: ArtifactPlan) -> None:
    """Rewrite the manifest from `plan` over the files as they are now (metadata files hashed again)."""
    metadata = [e["path"] for e in json.loads((directory / MANIFEST_NAME).read_text())["metadata_files"]]
    write_manifest(directory, build_manifest(plan, directory, PROVENANCE, VERIFIED_AT, metadata))


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
def test_head_bits_are_recorded_and_checked(tiny_source: Path, tmp_path: Path, layout: str) -> None:
    """An artifact with an EXL3 lm_head (`--head-bits`) verifies, its manifest and blocks recording head_bits; a
    block whose head_bits differs from the manifest's, or a manifest without head_bits over files that hold the EXL3
    head, fails the config check even with every hash sealed again."""
    out = tmp_path / "art"
    plan, result = build(tiny_source, out, layout, head_bits=6)
    code, checks = report(out, "--expect-sha256", result.manifest_sha256)
    assert code == 0, {k: c["detail"] for k, c in checks.items() if not c["ok"]}
    assert json.loads((out / MANIFEST_NAME).read_text())["layout"]["head_bits"] == 6
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["head_bits"] == 6
    config["quantization_config"]["head_bits"] = 5
    (out / "config.json").write_text(json.dumps(config))
    qjson = json.loads((out / "quantization_config.json").read_text())
    (out / "quantization_config.json").write_text(json.dumps({**qjson, "head_bits": 5}))
    _reseal_metadata(out, plan)
    code, checks = report(out)
    assert code == 1 and checks["file sha256"]["ok"]
    assert "quantization_config.head_bits is 5, files imply 6" in checks["config geometry"]["detail"]
    _reseal_metadata(out, replace(plan, head_bits=None))  # a manifest that says the head is exact
    code, checks = report(out)
    assert (
        code == 1 and "lm_head.trellis: EXL3 tensor the config does not call for" in checks["config geometry"]["detail"]
    )
