"""`observe --tuning-tokens` then `encode --tune-scales` on the ONE_MOE model: the observation keeps a sample of
each MoE layer's tokens with the model's routing; the tuned artifact verifies, keeps the encoder's trellis codes and
changes only stored scales, states the tuning in its manifest, lowers the routed experts' output error on the sampled
tokens, and encodes again to the same bytes; an observation without a sample is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from encode_fixtures import EPOCH, QUIET, digests

from glmquant.arch import PROJECTIONS, load_model_spec, table_for
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.encode import EncodeConfig, EncodeResult, encode_artifact
from glmquant.encode.scale_tuning import expert_output
from glmquant.encode.summary import summary_table
from glmquant.errors import UsageError
from glmquant.observe.config import ObserveConfig
from glmquant.observe.hessian_reader import load_layer_hessians
from glmquant.observe.run import observe
from glmquant.runtime.artifact import open_artifact

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tune-scales")]  # three small encodes on one worker
STEPS = 30
SAMPLE = 96  # of the observation's 4 x 64 tokens


@pytest.fixture(scope="module")
def tuning_observations(one_moe_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tune-obs")
    observe(ObserveConfig(source=one_moe_source, out=out, rows=4, tokens=64, tuning_tokens=SAMPLE))
    return out


def _encode(source: Path, observations: Path, out: Path, steps: int) -> EncodeResult:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SOURCE_DATE_EPOCH", EPOCH)
        cfg = EncodeConfig(source=source, out=out, observations=observations, tune_scales=steps)
        result = encode_artifact(cfg, QUIET)
    assert result is not None and result.verification is not None and result.verification.ok
    return result


@pytest.fixture(scope="module")
def encodes(
    one_moe_source: Path, tuning_observations: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[EncodeResult, EncodeResult]:
    """(plain, tuned) encodes of the same observations."""
    root = tmp_path_factory.mktemp("tune-art")
    plain = _encode(one_moe_source, tuning_observations, root / "plain", 0)
    return plain, _encode(one_moe_source, tuning_observations, root / "tuned", STEPS)


@pytest.fixture(scope="module")
def artifacts(encodes: tuple[EncodeResult, EncodeResult]) -> tuple[Path, Path]:
    """(plain, tuned) artifact directories."""
    return encodes[0].artifact.directory, encodes[1].artifact.directory


def _routed_error(artifact: Path, source: Path, observations: Path) -> float:
    """Over the sampled tokens of every MoE layer: |Σ_k g_k (f̂_k - f_k)|² / |Σ_k g_k f_k|², k over each token's
    routed experts (f the BF16 expert, f̂ the artifact's): the routed output's error, which tuning lowers."""
    spec = load_model_spec(source)
    table = table_for(spec)
    art = open_artifact(artifact)
    num = den = 0.0
    with SourceCheckpoint.open(source) as ckpt:
        for layer in spec.moe_layers:
            sample = load_layer_hessians(observations, layer, "natural").sample()
            assert sample is not None
            x = sample.inputs.float()
            got, ref = torch.zeros_like(x), torch.zeros_like(x)
            for expert in range(spec.n_routed_experts):
                token, slot = (sample.expert_ids == expert).nonzero(as_tuple=True)
                g = sample.expert_weights[token, slot][:, None]
                bf16 = {p: ckpt.read_tensor(table.expert_name(layer, expert, p)).float() for p in PROJECTIONS}
                decoded = {p: art.decode_expert(layer, expert, p) for p in PROJECTIONS}
                ref.index_add_(0, token, g * expert_output(bf16, x[token], spec.swiglu_limit))
                got.index_add_(0, token, g * expert_output(decoded, x[token], spec.swiglu_limit))
            num += float((got - ref).square().sum())
            den += float(ref.square().sum())
    art.checkpoint.close()
    return num / den


def test_observation_keeps_the_sampled_tokens_with_their_routing(
    one_moe_source: Path, tuning_observations: Path
) -> None:
    spec = load_model_spec(one_moe_source)
    for layer in spec.moe_layers:
        sample = load_layer_hessians(tuning_observations, layer, "natural").sample()
        assert sample is not None and sample.inputs.shape == (SAMPLE, spec.hidden_size)
        assert sample.expert_ids.shape == sample.expert_weights.shape == (SAMPLE, spec.num_experts_per_tok)
        assert (sample.expert_weights > 0).all() and set(sample.expert_ids.unique().tolist()) <= set(range(2))
        assert torch.unique(sample.inputs.float(), dim=0).shape[0] == SAMPLE  # distinct tokens, not one repeated


def test_tuned_artifact_changes_only_scales_and_lowers_the_routed_error(
    artifacts: tuple[Path, Path], one_moe_source: Path, tuning_observations: Path
) -> None:
    plain, tuned = artifacts
    changed = []
    with SourceCheckpoint.open(plain) as a, SourceCheckpoint.open(tuned) as b:
        assert a.names() == b.names()
        for name in a.names():
            same = torch.equal(a.read_tensor(name), b.read_tensor(name))
            if not same:
                changed.append(name)
    assert changed and all(n.endswith((".suh", ".svh")) and ".mlp.experts." in n for n in changed)
    manifest = (tuned / "EXL3_MANIFEST.json").read_text()
    assert f"{STEPS} Adam steps" in manifest and "Adam" not in (plain / "EXL3_MANIFEST.json").read_text()
    before = _routed_error(plain, one_moe_source, tuning_observations)
    after = _routed_error(tuned, one_moe_source, tuning_observations)
    assert after < before, (before, after)


@pytest.mark.fresh_encodes
def test_tuned_encode_is_reproducible(
    artifacts: tuple[Path, Path], one_moe_source: Path, tuning_observations: Path, tmp_path: Path
) -> None:
    again = _encode(one_moe_source, tuning_observations, tmp_path / "tuned", STEPS)
    assert digests(again.artifact.directory) == digests(artifacts[1])


def test_encode_summary_reports_each_units_tuning(encodes: tuple[EncodeResult, EncodeResult]) -> None:
    """Each MoE layer's summary (the console table and the summary file) holds its units' tuning: every step's
    held-out error from the encoded scales' (step 0) on, the kept step's the lowest of them; the plain encode none."""
    plain, tuned = encodes
    assert all(layer.tuning is None for layer in plain.layers)
    on_disk = json.loads(tuned.summary_path.read_text())["layers"]
    for layer, saved in zip(tuned.layers, on_disk, strict=True):
        assert layer.tuning and saved["tuning"] == layer.tuning
        for unit in layer.tuning:
            curve = unit["heldout_by_step"]
            assert len(curve) == STEPS + 1 and curve[0] == unit["heldout_before"]
            assert unit["heldout_after"] == min(curve) == curve[unit["best_step"]]
            assert (unit["best_step"] > 0) == (unit["experts"] > 0)
        assert layer.tuned_ratio is not None and layer.tuned_ratio < 1
    header = [c.header for c in summary_table(tuned.layers).columns]
    assert "tuned err" in header and "tuned err" not in [c.header for c in summary_table(plain.layers).columns]


def test_observation_without_a_sample_is_refused(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path: Path
) -> None:
    with pytest.raises(UsageError, match=r"no tuning sample for layer \d+ \(observe with --tuning-tokens N\)"):
        encode_artifact(
            EncodeConfig(
                source=one_moe_source, out=tmp_path / "art", observations=one_moe_dense_observations, tune_scales=5
            ),
            QUIET,
        )
    assert not (tmp_path / "art" / "EXL3_MANIFEST.json").exists()
