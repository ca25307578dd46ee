"""Layer streaming reproduces transformers' full-model forward, holding one decoder layer at a time.

Tolerance: none. The streamed path runs transformers' own modules in the same dtype and order, so the
last hidden state is bit-identical to the full model's when both see the same row batches. (Grouping
rows differently changes BF16 GEMM blocking, hence last bits; that is why batch_rows is part of an
observation's fingerprint.)
"""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from observe_helpers import observe_config

from glmquant.errors import ConfigError
from glmquant.observe import streaming
from glmquant.observe.hessians import HessianMode
from glmquant.observe.run import observe
from glmquant.observe.streaming import stream_final_hidden


@pytest.fixture(scope="module")
def full_model(tiny_source: Path):
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(str(tiny_source), dtype=torch.bfloat16).eval()


def _ids(rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 300, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def test_stream_equals_full_model(tiny_source: Path, full_model) -> None:
    ids = _ids(3, 40)  # 40 tokens > index_topk 8: the sparse MLA layer really is sparse
    with torch.no_grad():
        want = full_model.model(input_ids=ids).last_hidden_state
    got = stream_final_hidden(tiny_source, ids)
    assert got.shape == (3, 40, 128) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_stream_in_row_batches_equals_full_model_per_batch(tiny_source: Path, full_model) -> None:
    ids = _ids(4, 24, seed=1)
    with torch.no_grad():
        want = torch.cat([full_model.model(input_ids=part).last_hidden_state for part in ids.split(1)])
    assert torch.equal(stream_final_hidden(tiny_source, ids, batch_rows=1), want)


def _track_layers(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Record every decoder layer built; fail if one is built while an earlier one is still alive."""
    alive: list[weakref.ref] = []
    original = streaming.load_decoder_layer

    def tracked(*args, **kwargs):
        gc.collect()
        assert not [r for r in alive if r() is not None], "a previous decoder layer is still in memory"
        alive.append(weakref.ref(module := original(*args, **kwargs)))
        return module

    monkeypatch.setattr(streaming, "load_decoder_layer", tracked)
    return alive


def test_one_decoder_layer_alive_at_a_time(tiny_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alive = _track_layers(monkeypatch)
    stream_final_hidden(tiny_source, _ids(2, 16))
    assert len(alive) == 3


def test_shared_indexer_layers_are_refused(tiny_source: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_source, tmp_path / "shared-indexer"))
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["indexer_types"] = ["full", "full", "shared"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="shared"):
        stream_final_hidden(copy, _ids(1, 8))


def test_observe_holds_one_decoder_layer_at_a_time(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive = _track_layers(monkeypatch)
    observe(observe_config(tiny_source, tmp_path, rows=2, tokens=16, hessians=HessianMode.NONE, keep=None))
    assert len(alive) == 3
