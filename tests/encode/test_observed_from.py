"""Observations name the checkpoint they were made from (a hash of its 1-D tensors in their fingerprint), and the
commands that read them beside a source refuse another checkpoint of the same config before any work: encode,
draft-head and the cost passes would otherwise take one model's Hessians and REAP statistics for another's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from encode_fixtures import another_checkpoint
from typer.testing import CliRunner

from glmquant.checkpoint.reader import SourceCheckpoint, vector_tensors_sha256
from glmquant.cli import app
from glmquant.errors import UsageError
from glmquant.observe.checkpointing import resume_point, state_dir, write_state
from glmquant.observe.summary import SOURCE_VECTORS_KEY, SUMMARY_FILE, ObservationSummary, check_observed_from

NORM = "model.language_model.layers.1.post_attention_layernorm.weight"


def test_observations_record_their_sources_vectors(small_source: Path, small_observations: Path) -> None:
    with SourceCheckpoint.open(small_source) as ckpt:
        expected = vector_tensors_sha256(ckpt)
        check_observed_from(small_observations, ckpt)  # their own source passes
    assert ObservationSummary.load(small_observations).fingerprint[SOURCE_VECTORS_KEY] == expected


def test_encode_refuses_observations_of_another_checkpoint_before_any_work(
    small_source: Path, small_observations: Path, tmp_path: Path
) -> None:
    other = another_checkpoint(small_source, tmp_path / "other", NORM)
    recorded = ObservationSummary.load(small_observations).fingerprint[SOURCE_VECTORS_KEY]
    with SourceCheckpoint.open(other) as ckpt:
        assert vector_tensors_sha256(ckpt) != recorded
    out = tmp_path / "artifact"
    command = ["encode", str(other), "--observations", str(small_observations), "--out", str(out)]
    result = CliRunner().invoke(app, command)
    output = " ".join(result.output.split())
    assert result.exit_code != 0 and f"{small_observations} was observed from another checkpoint than {other}" in output
    assert "Traceback" not in output and not out.exists()


def test_older_and_unfinished_observations(small_source: Path, small_observations: Path, tmp_path: Path) -> None:
    """Observations from before the hash was recorded pass (nothing to compare); an unfinished one is checked by
    the fingerprint of its resume state."""
    older = tmp_path / "older"
    shutil.copytree(small_observations, older)
    raw = json.loads((older / SUMMARY_FILE).read_text())
    recorded = raw["fingerprint"].pop(SOURCE_VECTORS_KEY)
    (older / SUMMARY_FILE).write_text(json.dumps(raw))
    other = another_checkpoint(small_source, tmp_path / "other", NORM)
    with SourceCheckpoint.open(other) as ckpt:
        check_observed_from(older, ckpt)
        unfinished = tmp_path / "unfinished"
        write_state(unfinished, {SOURCE_VECTORS_KEY: recorded}, next_layer=1)
        assert (state_dir(unfinished) / "progress.json").is_file()
        with pytest.raises(UsageError, match="was observed from another checkpoint"):
            check_observed_from(unfinished, ckpt)


@pytest.mark.xdist_group("small-artifact")  # pytest-xdist: on the worker that encodes `small_artifact`
def test_an_artifact_given_as_observations_is_named(small_source: Path, small_artifact: Path, tmp_path: Path) -> None:
    """The two directories are easily swapped: encode and the checks say which one was given."""
    with SourceCheckpoint.open(small_source) as ckpt, pytest.raises(UsageError, match="is an artifact .*not observ"):
        check_observed_from(small_artifact, ckpt)
    out = tmp_path / "artifact"
    result = CliRunner().invoke(
        app, ["encode", str(small_source), "--observations", str(small_artifact), "--out", str(out)]
    )
    output = " ".join(result.output.split())
    assert result.exit_code != 0 and f"{small_artifact} is an artifact (it holds EXL3_MANIFEST.json)" in output
    assert not out.exists()


def test_an_observation_from_before_the_hash_resumes(tmp_path: Path) -> None:
    """A resume state whose fingerprint lacks the source's hash (made before it was recorded) resumes; one that
    records another hash is refused, naming the key."""
    older = {"token_rows_sha256": "rows", "glmquant": "0"}
    now = older | {SOURCE_VECTORS_KEY: "abc"}
    write_state(tmp_path / "older", older, next_layer=2)
    state = resume_point(tmp_path / "older", now)
    assert state is not None and state.next_layer == 2
    write_state(tmp_path / "other", older | {SOURCE_VECTORS_KEY: "def"}, next_layer=2)
    with pytest.raises(UsageError, match="source_vectors_sha256: 'def' -> 'abc'"):
        resume_point(tmp_path / "other", now)
