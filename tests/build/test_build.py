"""The fused build (observe and encode layer by layer, Hessians in memory) gives the artifact of observe + encode,
byte for byte, also when killed mid-way and resumed with a tighter stream budget."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from rich.console import Console

import glmquant.encode.layer as encode_layer
from glmquant.build import BuildConfig, build_artifact
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.errors import UsageError
from glmquant.fixtures import TinyModelConfig, build_tiny_checkpoint
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessians import HessianMode
from glmquant.observe.run import observe

QUIET = Console(quiet=True)
ROWS, TOKENS, BATCH = 4, 64, 2


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("build-src"), TinyModelConfig(n_routed_experts=2, num_experts_per_tok=1)
    )


@pytest.fixture(autouse=True)
def _pinned_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1767225600")


def _observe_config(source: Path, obs: Path, **changes) -> ObserveConfig:
    base = dict(
        rows=ROWS, tokens=TOKENS, batch_rows=BATCH, hessians=HessianMode.BOTH, keep=2
    )  # all: the router's least
    return ObserveConfig(source, obs, **{**base, **changes})


def _build_config(source: Path, tmp: Path, **changes) -> BuildConfig:
    return BuildConfig(
        _observe_config(source, tmp / "obs", **changes),
        EncodeConfig(source=source, out=tmp / "artifact", observations=tmp / "obs"),
    )


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def two_step(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """observe (Hessians written to files) then encode: the artifact the fused build must reproduce."""
    tmp = tmp_path_factory.mktemp("two-step")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", "1767225600")
        observe(_observe_config(source, tmp / "obs"))
        encode_artifact(EncodeConfig(source=source, out=tmp / "artifact", observations=tmp / "obs"), QUIET)
    return tmp


def test_fused_build_equals_observe_then_encode(source: Path, two_step: Path, tmp_path: Path) -> None:
    result = build_artifact(_build_config(source, tmp_path), QUIET)
    assert _digests(tmp_path / "artifact") == _digests(two_step / "artifact")
    assert (
        result.encode.artifact.manifest_sha256
        == json.loads((two_step / "artifact.work" / "encode-summary.json").read_text())["manifest_sha256"]
    )
    written = _digests(tmp_path / "obs")
    assert not [n for n in written if "hessians" in n]  # Hessians never left memory
    for name in (
        "token_rows.safetensors",
        "layer-01.stats.safetensors",
        "layer-02.stats.safetensors",
        "prune_plan.json",
    ):
        assert written[name] == _digests(two_step / "obs")[name], name
    assert sorted(p.name for p in (tmp_path / "obs" / "state").iterdir()) == ["progress.json"]


@pytest.mark.fresh_encodes
def test_killed_build_resumes_to_the_same_bytes(
    source: Path, two_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, calls = encode_layer.encode_unit, []  # the tiny model's layers are one work unit each

    def dies_on_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(encode_layer, "encode_unit", dies_on_second_layer)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(_build_config(source, tmp_path), QUIET)
    assert json.loads((tmp_path / "obs" / "state" / "progress.json").read_text())["next_layer"] == 2
    monkeypatch.setattr(encode_layer, "encode_unit", real)
    budget = 4 * 2 * TOKENS * 4 * 128 * 2 * 0.8e-9  # below two layers of streams: the output chunks are recomputed
    with pytest.raises(UsageError, match="below one layer's hidden streams"):
        build_artifact(_build_config(source, tmp_path, stream_budget_gb=budget / 3), QUIET)
    build_artifact(_build_config(source, tmp_path, stream_budget_gb=budget), QUIET)
    assert _digests(tmp_path / "artifact") == _digests(two_step / "artifact")


@pytest.mark.fresh_encodes
def test_killed_device_stream_build_recomputes_its_streams_and_encodes_no_layer_twice(
    source: Path, two_step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device streams without checkpoints: a build killed in its second MoE layer's encode recomputes the streams
    entering that layer from the embeddings and encodes only the layers it had not finished, to the same bytes."""
    real, calls = encode_layer.encode_unit, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first run's second MoE layer
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(encode_layer, "encode_unit", counted)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(_build_config(source, tmp_path, device_streams_every=0), QUIET)
    result = build_artifact(_build_config(source, tmp_path, device_streams_every=0), QUIET)
    assert len(calls) == 3  # the rerun encoded one layer: the second MoE layer
    assert result.observation.streams_recomputed_from == 0
    assert _digests(tmp_path / "artifact") == _digests(two_step / "artifact")


def test_build_refuses_what_it_cannot_do(source: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--prune-plan"):
        BuildConfig(
            _observe_config(source, tmp_path / "obs"),
            EncodeConfig(source=source, out=tmp_path / "a", observations=tmp_path / "obs", keep=1),
        )
    with pytest.raises(UsageError, match="needs them observed"):
        BuildConfig(
            _observe_config(source, tmp_path / "obs", hessians=HessianMode.NATURAL),
            EncodeConfig(source=source, out=tmp_path / "a", observations=tmp_path / "obs", hessians="all"),  # type: ignore[arg-type]  # the config parses option text
        )
    with pytest.raises(UsageError, match="the observations it writes"):
        BuildConfig(
            _observe_config(source, tmp_path / "obs"),
            EncodeConfig(source=source, out=tmp_path / "a", observations=tmp_path / "other"),
        )


def test_build_takes_depth_tiers_but_not_tiers_from_statistics(source: Path, tmp_path: Path) -> None:
    """Depth tiers follow from the model's structure, so a build encodes its first MoE layer at K3 and its last at
    K1 before it has observed the last; tiers ranked by statistics of later layers are refused up front."""
    spec = "depth:K3=1,K2=rest,K1=1"
    encode = EncodeConfig(source=source, out=tmp_path / "artifact", observations=tmp_path / "obs", tiers=spec)  # type: ignore[arg-type]  # the config parses option text
    result = build_artifact(BuildConfig(_observe_config(source, tmp_path / "obs"), encode), QUIET)
    assert result.encode.verification is not None and result.encode.verification.ok
    layout = json.loads((tmp_path / "artifact" / "EXL3_MANIFEST.json").read_text())["layout"]
    assert layout["tier_experts_by_layer"] == {"1": {"k3": 2}, "2": {"k1": 2}}  # the two MoE layers' two experts
    with pytest.raises(UsageError, match="depth or layers tiers: the statistics of the later layers do not exist"):
        BuildConfig(
            _observe_config(source, tmp_path / "obs2"),
            EncodeConfig(source=source, out=tmp_path / "b", observations=tmp_path / "obs2", tiers="share:K2=rest"),  # type: ignore[arg-type]  # the config parses option text
        )


def test_build_tunes_scales_on_the_tokens_it_holds_as_encode_does(source: Path, two_step: Path, tmp_path: Path) -> None:
    """`--tuning-tokens` + `--tune-scales`: the fused build tunes on the sample still in memory and writes the bytes
    of observe + encode with the same options (scales tuned: not the untuned artifact's); without a sample it is
    refused up front."""
    steps = 5
    observe(_observe_config(source, tmp_path / "two" / "obs", tuning_tokens=64))
    tuned_two_step = tmp_path / "two" / "artifact"
    obs = tmp_path / "two" / "obs"
    encode_artifact(EncodeConfig(source=source, out=tuned_two_step, observations=obs, tune_scales=steps), QUIET)
    fused = tmp_path / "fused"
    config = BuildConfig(
        _observe_config(source, fused / "obs", tuning_tokens=64),
        EncodeConfig(source=source, out=fused / "artifact", observations=fused / "obs", tune_scales=steps),
    )
    build_artifact(config, QUIET)
    assert _digests(fused / "artifact") == _digests(tuned_two_step)
    untuned = _digests(two_step / "artifact")
    assert [n for n, d in _digests(fused / "artifact").items() if n.startswith("layer-") and untuned[n] != d]
    with pytest.raises(UsageError, match="give --tuning-tokens N too"):
        BuildConfig(
            _observe_config(source, fused / "obs"),
            EncodeConfig(source=source, out=fused / "artifact", observations=fused / "obs", tune_scales=steps),
        )


@pytest.mark.fresh_encodes
def test_build_with_device_streams_gives_the_same_bytes(source: Path, two_step: Path, tmp_path: Path) -> None:
    build_artifact(_build_config(source, tmp_path, device_streams_every=2), QUIET)
    assert _digests(tmp_path / "artifact") == _digests(two_step / "artifact")
    assert sorted(p.name for p in (tmp_path / "obs" / "state").iterdir()) == ["progress.json"]


def test_a_cuda_device_none_is_visible_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`build --device cuda` without CUDA: one usage line, and neither observations nor artifact are made."""
    import torch
    from typer.testing import CliRunner

    from glmquant.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "source").mkdir()
    args = ["build", str(tmp_path / "source"), "--observations", str(tmp_path / "obs"), "--out", str(tmp_path / "art")]
    result = CliRunner().invoke(app, [*args, "--device", "cuda"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "--device cuda: no CUDA device is visible here" in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
