"""A killed observation resumes from the last finished layer and ends byte-identical to an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from observe_helpers import ROWS, TOKENS, killed_at_layer_2, observe_config

from glmquant.arch import load_model_spec
from glmquant.errors import GlmquantError, UsageError
from glmquant.observe import run
from glmquant.observe.hessians import HessianMode
from glmquant.observe.run import observe
from glmquant.observe.summary import ObservationSummary

OUTPUTS = (
    "token_rows.safetensors",
    "token_rows.json",
    "layer-00.hessians.safetensors",
    "layer-01.stats.safetensors",
    "layer-01.hessians.safetensors",
    "layer-02.stats.safetensors",
    "layer-02.hessians.safetensors",
    "head.hessians.safetensors",
    "layer-03.hessians.safetensors",  # the MTP layer's
    "prune_plan.json",
)


def _assert_same_outputs(a: Path, b: Path) -> None:
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert sorted(p.name for p in (b / "state").iterdir()) == ["progress.json"]  # hidden streams cleaned up


def test_killed_between_layers_resumes_identically(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed_at_layer_2(monkeypatch, observe_config(tiny_source, tmp_path))
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 2
    assert not (tmp_path / "layer-02.stats.safetensors").exists()
    (tmp_path / "state" / "streams-03").mkdir()
    (tmp_path / "state" / "streams-03" / ".mix-00001.safetensors.tmp-4242").write_bytes(b"half a file from a SIGKILL")
    summary = observe(observe_config(tiny_source, tmp_path))
    assert summary.resumed_from_layer == 2
    _assert_same_outputs(observed, tmp_path)


def test_killed_inside_a_layer_leaves_nothing_half_written(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, calls = run.run_layer, []

    def dies_on_fourth_batch(module, streams):
        calls.append(1)
        if len(calls) == 4:  # layer 1, second batch: mid-way through writing its output streams
            raise RuntimeError("killed")
        return original(module, streams)

    monkeypatch.setattr(run, "run_layer", dies_on_fourth_batch)
    with pytest.raises(RuntimeError, match="killed"):
        observe(observe_config(tiny_source, tmp_path))
    leftovers = [p.name for p in (tmp_path / "state").iterdir() if ".tmp-" in p.name]
    assert leftovers == [] and not (tmp_path / "layer-01.stats.safetensors").exists()
    monkeypatch.setattr(run, "run_layer", original)
    assert observe(observe_config(tiny_source, tmp_path)).resumed_from_layer == 1
    _assert_same_outputs(observed, tmp_path)


def test_other_settings_are_refused_and_keep_may_change(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "_observe_pass", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        observe(observe_config(tiny_source, tmp_path))
    with pytest.raises(UsageError, match="hessians: 'both' -> 'natural'"):
        observe(observe_config(tiny_source, tmp_path, hessians=HessianMode.NATURAL))
    with pytest.raises(UsageError, match="batch_rows"):
        observe(observe_config(tiny_source, tmp_path, batch_rows=1))
    rows_before = (tmp_path / "token_rows.json").read_bytes()
    with pytest.raises(UsageError, match="token_rows_sha256"):
        observe(observe_config(tiny_source, tmp_path, rows=5))
    assert (tmp_path / "token_rows.json").read_bytes() == rows_before  # the refused run overwrote nothing
    copy = Path(shutil.copytree(observed, tmp_path / "finished"))
    finished = observe(observe_config(tiny_source, copy, keep=3))
    assert finished.resumed_from_layer == 3  # nothing left to run: only the prune plan is redone
    assert len(json.loads((copy / "prune_plan.json").read_text())["layers"]["1"]) == 3
    assert (copy / "layer-01.stats.safetensors").read_bytes() == (observed / "layer-01.stats.safetensors").read_bytes()


def _from_before(observed: Path, out: Path, output: str, key: str) -> Path:
    """A copy of the finished observation as observe made it before it wrote `output` and recorded `key` in the
    fingerprint."""
    old = Path(shutil.copytree(observed, out))
    (old / output).unlink()
    progress = old / "state" / "progress.json"
    state = json.loads(progress.read_text())
    del state["fingerprint"][key]
    progress.write_text(json.dumps(state))
    return old


def test_an_observation_from_before_the_head_hessian_is_refused_naming_why(
    tiny_source: Path, observed: Path, tmp_path: Path
) -> None:
    """observations.json records lm_head's Hessian (its file, what capturing it cost); an observation finished before
    observe captured it (its state's fingerprint without `head_hessian`) is refused rather than resumed as done,
    which would leave it without one: the refusal names head_hessian and a new --out."""
    summary = ObservationSummary.load(observed)
    assert summary.fingerprint["head_hessian"] is True
    assert summary.head is not None and summary.head.hessians_file == "head.hessians.safetensors"
    assert summary.head.cost is not None and summary.head.cost.observe_s > 0
    old = _from_before(observed, tmp_path / "old", "head.hessians.safetensors", "head_hessian")
    with pytest.raises(UsageError, match=r"head_hessian: None -> True.*use a new --out \(or delete .*state"):
        observe(observe_config(tiny_source, old))
    resumed = observe(observe_config(tiny_source, Path(shutil.copytree(observed, tmp_path / "new"))))
    assert resumed.resumed_from_layer == 3 and resumed.head == replace(summary.head, cost=None)  # done earlier


def test_an_observation_from_before_the_mtp_hessians_resumes_without_them(
    tiny_source: Path, observed: Path, tmp_path: Path
) -> None:
    """Unlike lm_head's, the MTP layer's Hessians are only read by `draft-head --mtp-bits`, which names what is
    missing: an observation whose state predates them (no `mtp_hessians` in its fingerprint) still resumes, and a
    finished one stays without them."""
    old = _from_before(observed, tmp_path / "old", "layer-03.hessians.safetensors", "mtp_hessians")
    resumed = observe(observe_config(tiny_source, old))
    assert resumed.resumed_from_layer == 3 and resumed.mtp is None
    assert not (old / "layer-03.hessians.safetensors").exists()
    assert ObservationSummary.load(observed).mtp is not None


def test_killed_in_the_mtp_pass_redoes_it_identically(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP layer's Hessians are taken after lm_head's, before the last layer's progress is recorded: a run killed
    there resumes at the last layer from its final streams and ends byte-identical."""
    original = run._observe_mtp

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_observe_mtp", killed)
    with pytest.raises(KeyboardInterrupt):
        observe(observe_config(tiny_source, tmp_path))
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 2
    assert not (tmp_path / "layer-03.hessians.safetensors").exists()
    monkeypatch.setattr(run, "_observe_mtp", original)
    assert observe(observe_config(tiny_source, tmp_path)).resumed_from_layer == 2
    _assert_same_outputs(observed, tmp_path)


def test_stream_budget_keeps_the_disk_down_and_the_outputs_identical(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the budget at one layer's streams plus one chunk, outputs that do not fit are recomputed after the
    layer's results are saved; the stream files never exceed the budget and every output is unchanged."""
    from glmquant.observe.streams import StreamStore

    config = observe_config(tiny_source, tmp_path)
    assert config.rows is not None and config.tokens is not None
    shape = (config.rows, config.tokens)
    probe = StreamStore(tmp_path, [("mix", *shape)], config.batch_rows, (4, 128), torch.bfloat16, None)
    budget = probe.layer_bytes + max(probe.chunk_bytes(c) for c in probe.chunks)
    peaks, real_write = [], StreamStore.write

    def write(self, layer, chunk, streams) -> None:
        real_write(self, layer, chunk, streams)
        peaks.append(self.on_disk())

    monkeypatch.setattr(StreamStore, "write", write)
    summary = observe(observe_config(tiny_source, tmp_path, stream_budget_gb=budget / 1e9))
    assert max(peaks) <= budget and max(peaks) > probe.layer_bytes
    recomputed = [layer.cost.recomputed_chunks if layer.cost else None for layer in summary.layers]
    assert recomputed == [1, 1, 1]  # of 2 chunks per layer
    _assert_same_outputs(observed, tmp_path)


def test_full_disk_is_named_leaves_nothing_half_written_and_resumes(
    tiny_source: Path, observed: Path, tmp_path: Path, full_disk
) -> None:
    full_disk(r"^mix-00001")  # a stream chunk (the second one of the embeddings)
    with pytest.raises(GlmquantError, match=r"mix-00001\.safetensors: disk full while writing"):
        observe(observe_config(tiny_source, tmp_path))
    assert not list(tmp_path.rglob("*.tmp-*"))
    full_disk(r"^layer-02\.hessians")  # space freed, then the disk fills up again under a Hessian file
    with pytest.raises(GlmquantError, match=r"layer-02\.hessians\.safetensors: disk full while writing"):
        observe(observe_config(tiny_source, tmp_path))
    assert not list(tmp_path.rglob("*.tmp-*")) and not (tmp_path / "layer-02.hessians.safetensors").exists()
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 2
    full_disk("")
    assert observe(observe_config(tiny_source, tmp_path)).resumed_from_layer == 2
    _assert_same_outputs(observed, tmp_path)


def test_device_streams_give_the_same_outputs_and_resume_from_their_checkpoint(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams held in memory (each output chunk replacing its input) with a checkpoint every layer: a kill at layer 2
    resumes from the checkpoint of layer 2, and every output is byte-identical to a run with disk streams."""
    from glmquant.observe.streams import StreamStore

    disk_writes: list[int] = []
    real_write = StreamStore.write

    def write(self, layer, chunk, streams) -> None:
        disk_writes.append(layer)
        real_write(self, layer, chunk, streams)

    monkeypatch.setattr(StreamStore, "write", write)
    killed_at_layer_2(monkeypatch, observe_config(tiny_source, tmp_path, device_streams_every=1))
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 2
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["progress.json", "streams-02"]  # the newest only
    assert sorted(set(disk_writes)) == [1, 2]  # only the checkpoints went to disk
    with pytest.raises(UsageError, match="streams"):  # the streams' place is part of the fingerprint
        observe(observe_config(tiny_source, tmp_path))
    summary = observe(observe_config(tiny_source, tmp_path, device_streams_every=1))
    assert summary.resumed_from_layer == 2
    _assert_same_outputs(observed, tmp_path)


def test_device_streams_without_checkpoints_recompute_a_killed_runs_streams_from_the_embeddings(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N = 0 writes no checkpoint; a run killed at layer 2 recomputes the streams entering it from the embeddings (a
    forward through layers 0 and 1, whose results it keeps) and ends byte-identical."""
    killed_at_layer_2(monkeypatch, observe_config(tiny_source, tmp_path, device_streams_every=0))
    state = json.loads((tmp_path / "state" / "progress.json").read_text())
    assert (state["next_layer"], state["checkpoint"]) == (2, None)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["progress.json"]
    observed_layers: list[int] = []
    real_pass = run._observe_pass

    def observe_pass(model, rows, config, streams, layer, *rest):
        observed_layers.append(layer)
        return real_pass(model, rows, config, streams, layer, *rest)

    monkeypatch.setattr(run, "_observe_pass", observe_pass)
    summary = observe(observe_config(tiny_source, tmp_path, device_streams_every=0))
    assert (summary.resumed_from_layer, summary.streams_recomputed_from) == (2, 0)
    assert observed_layers[0] == 2  # layers 0 and 1 only run forward
    assert all(layer.cost is None or not layer.cost.parts_bytes.get("advance.checkpoint") for layer in summary.layers)
    _assert_same_outputs(observed, tmp_path)


def _checkpoint_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("streams-checkpoint")]


def test_device_stream_checkpoints_are_written_while_the_layers_results_are_saved(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint of the streams entering layer L + 1 starts as soon as layer L's observing pass has held them
    all, and is written while the layer's results are saved (a build encodes the layer there): a checkpoint chunk
    reaches the disk inside `save`. Its bytes are the same; the run records the writer's time and its own wait."""
    from glmquant.observe.streams import StreamStore

    real_write, real_save = StreamStore.write, run.ObservationFiles.save
    saving, written = threading.Event(), threading.Event()
    gated: set[int] = set()
    seen_in_save: list[int | None] = []

    def write(self, layer, chunk, streams) -> None:  # the checkpoint writer's (device streams write nothing else)
        if layer not in gated:  # a checkpoint's first chunk waits until the layer's results are being saved
            gated.add(layer)
            assert saving.wait(30), f"the checkpoint of layer {layer} was written outside the results' saving"
        real_write(self, layer, chunk, streams)
        written.set()

    def save(self, layer, stats, hessians) -> None:
        written.clear()
        saving.set()
        # layers 0 and 1 are followed by a checkpoint (of layers 1 and 2), whose first chunk is written meanwhile
        if layer is not None and layer < 2 and written.wait(30):
            seen_in_save.append(layer)
        real_save(self, layer, stats, hessians)
        saving.clear()

    monkeypatch.setattr(StreamStore, "write", write)
    monkeypatch.setattr(run.ObservationFiles, "save", save)
    summary = observe(observe_config(tiny_source, tmp_path, device_streams_every=1))
    assert seen_in_save == [0, 1]
    _assert_same_outputs(observed, tmp_path)
    spec = load_model_spec(tiny_source / "config.json")
    streams_bytes = ROWS * TOKENS * int(spec.text["hc_mult"]) * spec.hidden_size * 2  # BF16, without file headers
    for layer in summary.layers[:2]:
        cost = layer.cost
        assert cost is not None
        assert cost.parts_bytes["checkpoint.write"] == cost.parts_bytes["advance.checkpoint"]
        assert streams_bytes < cost.parts_bytes["checkpoint.write"] < streams_bytes + 2 * 1024  # two chunk files
        assert cost.parts_s["checkpoint.write"] > 0
    assert not _checkpoint_threads()


def test_a_checkpoint_that_fails_or_is_interrupted_is_never_recorded_and_its_writer_stops(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_disk
) -> None:
    """A full disk under a checkpoint chunk is named in a warning when the run waits for the checkpoint, which is
    skipped: its files deleted, the run going on. Ctrl-C while the layer's results are saved stops the writer after
    its chunk. Neither leaves a writer running, a half-written file or the unfinished checkpoint as a resume point:
    the previous checkpoint (or the embeddings) stays it, and the layers done since keep their results. Where the
    disk has no room for another checkpoint none is written and the run goes on. Every run ends byte-identical."""
    from glmquant.observe.streams import StreamStore

    job = observe_config(tiny_source, tmp_path / "full", device_streams_every=1)
    full_disk(r"^mix-00001")  # the second chunk of every checkpoint (no other stream file is written)
    with pytest.warns(UserWarning) as warned:
        observe(job)
    messages = [str(w.message) for w in warned if "checkpoint skipped" in str(w.message)]
    assert len(messages) == 2 and "streams-01/mix-00001.safetensors: disk full while writing" in messages[0]
    assert "recomputes the streams from the embeddings" in messages[0]
    assert not _checkpoint_threads() and not list(job.out.rglob("*.tmp-*"))
    _assert_same_outputs(observed, job.out)
    full_disk("")

    job = observe_config(tiny_source, tmp_path, device_streams_every=1)

    real_write, real_save = StreamStore.write, run.ObservationFiles.save
    written: list[int] = []

    def slow_write(self, layer, chunk, streams) -> None:
        written.append(layer)
        time.sleep(0.5)  # the interrupt below comes while the first chunk is written
        real_write(self, layer, chunk, streams)

    def interrupted(self, layer, stats, hessians) -> None:
        if layer == 1:  # the checkpoint of layer 2 is under way
            raise KeyboardInterrupt
        real_save(self, layer, stats, hessians)

    monkeypatch.setattr(StreamStore, "write", slow_write)
    monkeypatch.setattr(run.ObservationFiles, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        observe(job)  # layer 0 and its checkpoint, then layer 1
    assert not _checkpoint_threads() and not list(tmp_path.rglob("*.tmp-*"))
    assert not (tmp_path / "state" / "streams-02" / "mix-00001.safetensors").exists()  # stopped after the first
    state = json.loads((tmp_path / "state" / "progress.json").read_text())
    assert (state["next_layer"], state["checkpoint"]) == (1, 1)
    assert (tmp_path / "state" / "streams-01").is_dir()  # kept beside the unfinished one: the disk had room

    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: SimpleNamespace(total=1 << 40, used=1 << 40, free=1024))
    with pytest.raises(KeyboardInterrupt):
        observe(job)  # resumes from layer 1 and is interrupted at the same place, before any checkpoint began
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 1
    assert not (tmp_path / "state" / "streams-02").exists()
    monkeypatch.setattr(run.ObservationFiles, "save", real_save)
    written.clear()
    summary = observe(job)  # no room for another checkpoint: none is written, and none is waited for
    assert (summary.resumed_from_layer, summary.streams_recomputed_from, written) == (1, 1, [])
    assert not _checkpoint_threads()
    _assert_same_outputs(observed, tmp_path)


def test_a_run_failing_beside_its_failed_checkpoint_names_both(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_disk
) -> None:
    """The run's own error is raised, with the checkpoint writer's (here a full disk) added as a note."""
    full_disk(r"^mix-00000")

    def failing_save(self, layer, stats, hessians) -> None:
        time.sleep(1.0)  # the writer's first chunk fails meanwhile
        raise RuntimeError("the encode failed")

    monkeypatch.setattr(run.ObservationFiles, "save", failing_save)
    with pytest.raises(RuntimeError, match="the encode failed") as failed:
        observe(observe_config(tiny_source, tmp_path, device_streams_every=1))
    assert "streams-01/mix-00000.safetensors: disk full while writing" in "\n".join(failed.value.__notes__)
    assert not _checkpoint_threads()


def test_the_older_checkpoint_is_deleted_while_the_run_goes_on(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the checkpoint of layer 2 is recorded, layer 1's (tens of GB on the model) is deleted on a thread of its
    own: layer 2's observing pass starts before that deletion ends, and the run still ends with only its record."""
    real_rmtree, real_pass = shutil.rmtree, run._observe_pass
    deleting, release = threading.Event(), threading.Event()
    started_meanwhile: list[int] = []

    def slow_rmtree(path, ignore_errors=False) -> None:
        if Path(path).name == "streams-01":
            deleting.set()
            release.wait(30)
        real_rmtree(path, ignore_errors=ignore_errors)

    def observe_pass(model, rows, config, streams, layer, *rest):
        if layer == 2 and deleting.is_set() and not release.is_set():
            started_meanwhile.append(layer)
            release.set()
        return real_pass(model, rows, config, streams, layer, *rest)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    monkeypatch.setattr(run, "_observe_pass", observe_pass)
    observe(observe_config(tiny_source, tmp_path, device_streams_every=1))
    assert started_meanwhile == [2] and not _checkpoint_threads()
    _assert_same_outputs(observed, tmp_path)


def test_a_run_killed_after_its_last_layer_deletes_its_checkpoints_when_run_again(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed between recording its last layer and deleting its checkpoints (tens of GB on the model): run again, it
    has nothing left to observe and deletes them."""
    from glmquant.observe.streams import DeviceStreamStore

    real_write_state, real_drop = run.write_state, DeviceStreamStore.drop_checkpoints
    layers = load_model_spec(tiny_source / "config.json").num_hidden_layers
    recorded_last: list[bool] = []

    def write_state(obs, fingerprint, next_layer, committed=False, checkpoint=None) -> None:
        real_write_state(obs, fingerprint, next_layer, committed, checkpoint)
        recorded_last.append(next_layer == layers)

    def drop_checkpoints(self, keep=None, wait=True) -> None:
        if recorded_last and recorded_last[-1]:
            raise KeyboardInterrupt
        real_drop(self, keep, wait)

    monkeypatch.setattr(run, "write_state", write_state)
    monkeypatch.setattr(DeviceStreamStore, "drop_checkpoints", drop_checkpoints)
    job = observe_config(tiny_source, tmp_path, device_streams_every=1)
    with pytest.raises(KeyboardInterrupt):
        observe(job)
    assert [p.name for p in (tmp_path / "state").glob("streams-*")]  # the last checkpoint, left behind
    monkeypatch.setattr(DeviceStreamStore, "drop_checkpoints", real_drop)
    assert observe(job).resumed_from_layer == layers
    assert not list((tmp_path / "state").glob("streams-*")) and not _checkpoint_threads()
    _assert_same_outputs(observed, tmp_path)


def test_a_checkpoint_begun_after_the_results_keeps_the_older_one_where_one_more_fits(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free space for one layer's streams but not two: no checkpoint begins beside the results (they need room too),
    but the one begun after them keeps the older as the resume point until it is written; a kill meanwhile resumes
    from the older."""
    from glmquant.observe.streams import StreamStore

    spec = load_model_spec(tiny_source / "config.json")
    layer_bytes = ROWS * TOKENS * int(spec.text["hc_mult"]) * spec.hidden_size * 2
    free = SimpleNamespace(total=1 << 40, used=1 << 40, free=layer_bytes * 3 // 2)
    monkeypatch.setattr(run.shutil, "disk_usage", lambda path: free)
    real_write = StreamStore.write

    def write(self, layer, chunk, streams) -> None:
        if layer == 2:
            raise KeyboardInterrupt  # in the writer, raised where the run waits for it
        real_write(self, layer, chunk, streams)

    monkeypatch.setattr(StreamStore, "write", write)
    job = observe_config(tiny_source, tmp_path, device_streams_every=1)
    with pytest.raises(KeyboardInterrupt):
        observe(job)
    assert json.loads((tmp_path / "state" / "progress.json").read_text())["next_layer"] == 1
    assert (tmp_path / "state" / "streams-01").is_dir() and not _checkpoint_threads()
    monkeypatch.setattr(StreamStore, "write", real_write)
    assert observe(job).resumed_from_layer == 1
    _assert_same_outputs(observed, tmp_path)


def test_recomputed_streams_serve_a_committed_layer_an_older_state_and_a_missing_checkpoint(
    tiny_source: Path, observed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while advancing layer 2 (its results saved), a run without checkpoints recomputes layers 0 and 1 and
    advances layer 2 without observing it again; a progress file from before checkpoints were named resumes from its
    layer's checkpoint; one naming a checkpoint that is gone recomputes from the embeddings, with a warning. Every
    run ends byte-identical."""
    real_advance, real_pass = run._advance, run._observe_pass
    observed_layers: list[int] = []
    killed: list[int] = []

    def advance(model, streams, layer, *rest):
        if layer == 2 and not killed:
            killed.append(layer)
            raise KeyboardInterrupt
        return real_advance(model, streams, layer, *rest)

    def observe_pass(model, rows, config, streams, layer, *rest):
        observed_layers.append(layer)
        return real_pass(model, rows, config, streams, layer, *rest)

    monkeypatch.setattr(run, "_advance", advance)
    job = observe_config(tiny_source, tmp_path / "committed", device_streams_every=0)
    with pytest.raises(KeyboardInterrupt):
        observe(job)
    state = json.loads((job.out / "state" / "progress.json").read_text())
    assert (state["next_layer"], state["committed"], state["checkpoint"]) == (2, True, None)
    monkeypatch.setattr(run, "_observe_pass", observe_pass)
    summary = observe(job)
    assert (summary.resumed_from_layer, summary.streams_recomputed_from) == (2, 0)
    assert observed_layers == [] and summary.streams_recompute_s is not None  # layer 2 (the last) only advanced
    _assert_same_outputs(observed, job.out)
    monkeypatch.setattr(run, "_advance", real_advance)

    job = observe_config(tiny_source, tmp_path / "older", device_streams_every=1)
    killed_at_layer_2(monkeypatch, job)
    progress = job.out / "state" / "progress.json"
    older = {k: v for k, v in json.loads(progress.read_text()).items() if k != "checkpoint"}
    progress.write_text(json.dumps(older))  # as a run before checkpoints were named wrote it
    assert observe(job).streams_recomputed_from == 2
    _assert_same_outputs(observed, job.out)

    job = observe_config(tiny_source, tmp_path / "gone", device_streams_every=1)
    killed_at_layer_2(monkeypatch, job)
    shutil.rmtree(job.out / "state" / "streams-02")
    with pytest.warns(UserWarning, match=r"streams-02: the checkpoint the run recorded is not all there"):
        summary = observe(job)
    assert (summary.resumed_from_layer, summary.streams_recomputed_from) == (2, 0)
    _assert_same_outputs(observed, job.out)
