"""`glmquant draft-head`: an EXL3 copy of lm_head encoded with its dense Hessian, written as one safetensors file the
MTP drafter reads (ONE_MOE's source and dense observations); the same inputs give the same bytes, and bad input is
refused naming what is wrong."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from encode_fixtures import another_checkpoint
from typer.testing import CliRunner

from glmquant.arch import load_model_spec
from glmquant.checkpoint.draft_head import DRAFT_HEAD_FORMAT, DraftMtp, read_draft_head, read_draft_mtp
from glmquant.checkpoint.layouts import quantizable_mtp
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.cli import app
from glmquant.encode.draft_head import build_draft_head
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3 import decode_weight
from glmquant.observe.hessian_reader import load_dense_hessian, load_layer_hessians

pytestmark = [pytest.mark.slow]  # ONE_MOE's dense observations


def test_cli_writes_a_k4_copy_of_lm_head_that_reads_back(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    out = tmp_path / "draft_head.safetensors"
    result = CliRunner().invoke(
        app, ["draft-head", str(one_moe_source), "--observations", str(one_moe_dense_observations), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert '"draft_head"' in result.output
    header = parse_header(out)
    assert header.metadata is not None and header.metadata["format"] == DRAFT_HEAD_FORMAT
    assert header.metadata["bits"] == "4"
    with SourceCheckpoint.open(one_moe_source) as source:
        weight = source.read_tensor("lm_head.weight").float()
    tensor = read_draft_head(out, weight.shape[1], weight.shape[0], "cpu")
    assert tensor.bits == 4
    decoded = decode_weight(tensor, torch.float32)
    hessian = load_dense_hessian(one_moe_dense_observations, None, "lm_head.weight").mean()
    assert hessian is not None
    error = decoded - weight

    def energy(e: torch.Tensor) -> float:
        return float(((e @ hessian) * e).sum())

    # K4 on the head's own inputs: the output error a few percent of the output energy, not a made-up tensor's
    assert energy(error) < 0.05 * energy(weight)


@pytest.mark.fresh_encodes
def test_the_same_inputs_give_the_same_bytes_and_k_sets_the_size(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    paths = [tmp_path / f"{name}.safetensors" for name in ("a", "b", "k2")]
    for path, bits in zip(paths, (4, 4, 2)):
        build_draft_head(one_moe_source, one_moe_dense_observations, path, bits=bits)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    trellis = {p.name: parse_header(p).tensors["lm_head.trellis"].spec.shape for p in (paths[0], paths[2])}
    assert trellis["a.safetensors"][-1] == 64 and trellis["k2.safetensors"][-1] == 32  # 16 x K per 16 x 16 tile


def test_bad_input_is_refused_naming_it(
    one_moe_source: Path, one_moe_dense_observations: Path, small_observations: Path, tmp_path: Path
) -> None:
    out = tmp_path / "head.safetensors"
    with pytest.raises(UsageError, match=r"^draft-head: lm_head.weight needs its dense Hessian"):
        build_draft_head(one_moe_source, small_observations, out)  # observed without --dense-hessians
    with pytest.raises(UsageError, match=r"--bits must be 2..8"):
        build_draft_head(one_moe_source, one_moe_dense_observations, out, bits=9)
    with pytest.raises(UsageError, match=r"its directory .*missing does not exist"):
        build_draft_head(one_moe_source, one_moe_dense_observations, tmp_path / "missing" / "head.safetensors")
    no_mtp = tmp_path / "no-mtp"
    shutil.copytree(one_moe_source, no_mtp)
    config = json.loads((no_mtp / "config.json").read_text())
    config["text_config"]["num_nextn_predict_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"has no MTP layer to draft with"):
        build_draft_head(no_mtp, one_moe_dense_observations, out)
    assert not out.exists()


def test_a_file_of_another_kind_or_model_is_refused_at_load(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    out = tmp_path / "head.safetensors"
    head = build_draft_head(one_moe_source, one_moe_dense_observations, out)
    with pytest.raises(UsageError, match=r"an lm_head of 320 x 128 .* the model's is 640 x 128: it was built from"):
        read_draft_head(out, head.in_features, 640, "cpu")
    shard = next(one_moe_source.glob("model-*.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"not a draft-head file"):
        read_draft_head(shard, head.in_features, head.out_features, "cpu")
    with pytest.raises(UsageError, match=r"no such file"):
        read_draft_head(tmp_path / "absent.safetensors", head.in_features, head.out_features, "cpu")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(out.read_bytes()[:-100])
    with pytest.raises(CheckpointFormatError, match=r"truncated\.safetensors"):
        read_draft_head(truncated, head.in_features, head.out_features, "cpu")


def test_observations_of_another_checkpoint_are_refused(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    other = another_checkpoint(one_moe_source, tmp_path / "other", "model.language_model.norm.weight")
    out = tmp_path / "draft_head.safetensors"
    with pytest.raises(UsageError, match=f"{one_moe_dense_observations} was observed from another checkpoint"):
        build_draft_head(other, one_moe_dense_observations, out)
    assert not out.exists()


def test_mtp_bits_add_the_mtp_layer_encoded_with_its_own_hessians(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    """`--mtp-bits 4`: the MTP layer's linears at K4 with their dense Hessians, its routed experts at K2 with their
    natural ones (observe --dense-hessians captures both); the CLI writes the library's bytes (the same inputs give
    the same bytes)."""
    paths = [tmp_path / f"{name}.safetensors" for name in ("a", "b")]
    head = build_draft_head(one_moe_source, one_moe_dense_observations, paths[0], mtp_bits=4, mtp_expert_bits=2)
    argv = ["draft-head", str(one_moe_source), "--observations", str(one_moe_dense_observations)]
    result = CliRunner().invoke(app, [*argv, "--out", str(paths[1]), "--mtp-bits", "4", "--mtp-expert-bits", "2"])
    assert result.exit_code == 0, result.output
    assert "MTP layer 2 at K4 (routed experts K2)" in result.output
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert head.mtp == DraftMtp(2, 4, 2, 2)  # ONE_MOE: MTP layer 2, two routed experts
    spec = load_model_spec(one_moe_source / "config.json")
    mtp = read_draft_mtp(paths[0], spec, "cpu")
    assert mtp is not None and sorted(mtp.linears) == sorted(
        t.name.removesuffix(".weight") for t in quantizable_mtp(spec)
    )
    assert any(key.endswith("eh_proj") for key in mtp.linears)
    with pytest.raises(UsageError, match=r"holds MTP layer 2 with 2 routed experts, .* with 4: it was built from"):
        read_draft_mtp(paths[0], replace(spec, n_routed_experts=4), "cpu")  # another model's
    prefix = "model.language_model.layers.2."
    errors = {}
    with SourceCheckpoint.open(one_moe_source) as source:
        for key, tensor in mtp.linears.items():
            hessian = load_dense_hessian(one_moe_dense_observations, 2, f"{key}.weight").mean()
            assert tensor.bits == 4 and hessian is not None
            errors[key] = _weighted_error(tensor, source.read_tensor(f"{key}.weight").float(), hessian)
        natural = load_layer_hessians(one_moe_dense_observations, 2, "natural")
        for e, projections in enumerate(mtp.experts):
            for proj, tensor in projections.items():
                hessian = (natural.down(e) if proj == "down_proj" else natural.gate_up(e)).mean()
                assert tensor.bits == 2 and hessian is not None
                weight = source.read_tensor(f"{prefix}mlp.experts.{e}.{proj}.weight").float()
                errors[f"{e}.{proj}"] = _weighted_error(tensor, weight, hessian)
    # the output error against the output energy on each tensor's own inputs (measured: K4 at most 2.1e-3, K2 2.8e-2)
    assert max(v for k, v in errors.items() if k.startswith(prefix)) < 0.01, errors
    assert max(v for k, v in errors.items() if not k.startswith(prefix)) < 0.06, errors


def _weighted_error(tensor, weight: torch.Tensor, hessian: torch.Tensor) -> float:
    error = decode_weight(tensor, torch.float32) - weight
    return float(((error @ hessian) * error).sum() / ((weight @ hessian) * weight).sum())


def test_mtp_bits_refuse_bad_input_naming_it(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    out = tmp_path / "draft.safetensors"
    with pytest.raises(UsageError, match=r"--mtp-bits must be 2..8, got 9"):
        build_draft_head(one_moe_source, one_moe_dense_observations, out, mtp_bits=9)
    with pytest.raises(UsageError, match=r"--mtp-expert-bits sets .* it needs --mtp-bits"):
        build_draft_head(one_moe_source, one_moe_dense_observations, out, mtp_expert_bits=3)
    with pytest.raises(UsageError, match=r"--mtp-expert-bits must be 1..8, got 0"):
        build_draft_head(one_moe_source, one_moe_dense_observations, out, mtp_bits=4, mtp_expert_bits=0)
    before = Path(shutil.copytree(one_moe_dense_observations, tmp_path / "before-mtp"))
    (before / "layer-02.hessians.safetensors").unlink()  # as observed before the MTP layer's Hessians existed
    with pytest.raises(UsageError, match=r"layer-02\.hessians\.safetensors is missing: .* no Hessians of the MTP"):
        build_draft_head(one_moe_source, before, out, mtp_bits=4)
    assert not out.exists()
    build_draft_head(one_moe_source, before, out)  # the head alone needs none of them
    assert read_draft_mtp(out, load_model_spec(one_moe_source / "config.json"), "cpu") is None
