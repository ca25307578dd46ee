"""The token sample `observe --tuning-tokens` keeps for `encode --tune-scales`: which tokens; the option's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmquant.errors import UsageError
from glmquant.observe.config import ObserveConfig, fingerprint
from glmquant.observe.tuning_sample import TuningSampler


def test_sampler_keeps_every_stride_th_token_across_batches_up_to_its_limit() -> None:
    """Positions 0, 3, 6, ... of the concatenated batches (whatever their sizes), at most `limit`, with their routing
    rows; the same tokens in one batch or in several."""
    x = torch.arange(40, dtype=torch.float32)[:, None].repeat(1, 4)
    ids, weights = torch.arange(80).reshape(40, 2), torch.rand(40, 2)
    split = TuningSampler(limit=10, stride=3)
    for lo, hi in ((0, 7), (7, 8), (8, 20), (20, 40)):
        split.add(x[lo:hi], ids[lo:hi], weights[lo:hi])
    whole = TuningSampler(limit=10, stride=3)
    whole.add(x, ids, weights)
    a, b = split.result(), whole.result()
    assert a is not None and b is not None
    assert a.inputs[:, 0].tolist() == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]
    assert torch.equal(a.expert_ids, ids[0:30:3]) and torch.equal(a.expert_weights, weights[0:30:3])
    assert all(torch.equal(s, t) for s, t in zip(a.tensors().values(), b.tensors().values()))
    assert TuningSampler.over(limit=10, tokens=95).stride == 9 and TuningSampler.over(10, 5).stride == 1


def test_sample_routed_to_experts_keeps_their_tokens_and_slots() -> None:
    sampler = TuningSampler(limit=4, stride=1)
    sampler.add(
        torch.eye(4),
        torch.tensor([[0, 2], [1, 0], [2, 3], [3, 1]]),
        torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]]),
    )
    sample = sampler.result()
    assert sample is not None
    mine = sample.routed_to([0, 1])
    assert torch.equal(mine.inputs, torch.eye(4)[[0, 1, 3]])
    assert torch.equal(mine.expert_ids, torch.tensor([[0, -1], [1, 0], [-1, 1]]))
    assert torch.equal(mine.expert_weights, torch.tensor([[0.1, 0.0], [0.3, 0.4], [0.0, 0.8]]))
    assert sample.routed_to([5]).inputs.shape == (0, 4)


def test_tuning_tokens_are_checked_and_leave_older_fingerprints_alone(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--tuning-tokens must be 0 or more, got -1"):
        ObserveConfig(tmp_path / "source", tmp_path / "obs", tuning_tokens=-1)
    with pytest.raises(UsageError, match="use it with --hessians natural or both, not all"):
        ObserveConfig(tmp_path / "source", tmp_path / "obs", hessians="all", tuning_tokens=8)  # type: ignore[arg-type]
    plain = fingerprint(ObserveConfig(tmp_path / "source", tmp_path / "obs"), "rows", torch.bfloat16, False, "vectors")
    sampled = fingerprint(
        ObserveConfig(tmp_path / "source", tmp_path / "obs", tuning_tokens=64), "rows", torch.bfloat16, False, "vectors"
    )
    assert "tuning_tokens" not in plain and sampled == {**plain, "tuning_tokens": 64}
