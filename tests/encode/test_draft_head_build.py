"""`glmquant draft-head`: an EXL3 copy of lm_head encoded with its dense Hessian, written as one safetensors file the
MTP drafter reads (ONE_MOE's source and dense observations); the same inputs give the same bytes, and bad input is
refused naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from encode_fixtures import another_checkpoint
from typer.testing import CliRunner

from glmquant.checkpoint.draft_head import DRAFT_HEAD_FORMAT, read_draft_head
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.safetensors_format import parse_header
from glmquant.cli import app
from glmquant.encode.draft_head import build_draft_head
from glmquant.errors import CheckpointFormatError, UsageError
from glmquant.exl3 import decode_weight
from glmquant.observe.hessian_reader import load_dense_hessian

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
