"""EncodeConfig is typed and checked at the edge: bad options and environment values are refused, naming them,
before any file is read or written."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import glmquant.encode.config as encode_config
from glmquant.checkpoint.layouts import parse_layer_bits
from glmquant.cli import app
from glmquant.encode import EncodeConfig
from glmquant.environment import exl3_backend
from glmquant.errors import UsageError
from glmquant.exl3.refit import REFIT_ROUNDS
from glmquant.exl3.scale_search import DEFAULT_SEARCH
from glmquant.observe.hessians import HessianMode


def _encode(tmp_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["encode", str(tmp_path / "source"), "--out", str(tmp_path / "art"), *args])
    return result.exit_code, " ".join(result.output.split())


def test_observations_or_an_explicit_uncalibrated_flag(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--uncalibrated"):
        EncodeConfig(source=tmp_path, out=tmp_path / "art")
    with pytest.raises(UsageError, match="exclude each other"):
        EncodeConfig(source=tmp_path, out=tmp_path / "art", observations=tmp_path, uncalibrated=True)
    code, output = _encode(tmp_path)
    assert code == 2 and "no --observations" in output and "--uncalibrated" in output
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--hessians", "bogus"], "--hessians must be natural or all, got 'bogus'"),
        (["--hessians", "both"], "--hessians must be natural or all (encode uses one), got 'both'"),
        (["--layout", "tp8"], "--layout must be one of tr3, exllamav3, got 'tp8'"),
        (["--codebook", "mcgx"], "--codebook must be one of mcg, mul1, 3inst, got 'mcgx'"),
        (["--bits", "9"], "--bits must be 1..8, got 9"),
        (["--keep", "0"], "--keep must be a positive integer, got 0"),
        (["--device", "tpu"], "--device must be cpu or cuda"),
        (["--tune-scales", "-1"], "--tune-scales must be 0 or more Adam steps, got -1"),
        (["--tune-scales", "5"], "--tune-scales tunes on the observations' sampled tokens: it needs --observations"),
    ],
)
def test_bad_options_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    code, output = _encode(tmp_path, "--uncalibrated", *args)
    assert code == 2 and message in output and "Traceback" not in output
    assert not (tmp_path / "art").exists()


def test_out_must_be_a_directory_apart_from_the_inputs(tmp_path: Path) -> None:
    """--out never replaces an input's files (the source's config and index) and is a directory, so no OSError
    reaches the user as a traceback."""
    (tmp_path / "a-file").write_text("")
    obs = tmp_path / "obs"
    for out, message in (
        (tmp_path, "holds the source"),
        (tmp_path / "..", "holds the source"),
        (obs, "holds --observations"),
        (tmp_path / "a-file", "is a file; give a directory"),
        (tmp_path / "a-file" / "art", "a-file is a file, not a directory"),
    ):
        with pytest.raises(UsageError, match=message):
            EncodeConfig(source=tmp_path, out=out, observations=obs)
    EncodeConfig(source=tmp_path / "src", out=tmp_path / "art", observations=obs)  # siblings


def test_an_unforeseen_os_error_is_one_line(tiny_source: Path) -> None:
    if not Path("/proc").is_dir():
        pytest.skip("needs /proc, where no directory can be made")
    result = CliRunner().invoke(app, ["encode", str(tiny_source), "--out", "/proc/glmquant-art", "--uncalibrated"])
    assert result.exit_code == 1 and "error: /proc/glmquant-art" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "name,value,message",
    [
        ("GLMQUANT_EXL3_BACKEND", "nope", "GLMQUANT_EXL3_BACKEND='nope' is not an EXL3 backend"),
        ("SOURCE_DATE_EPOCH", "yesterday", "SOURCE_DATE_EPOCH must be whole seconds since 1970, got 'yesterday'"),
        ("GLMQUANT_CACHE_DIR", "__FILE__", "GLMQUANT_CACHE_DIR="),
        ("GLMQUANT_ENCODE_MEMO", "__FILE__", "GLMQUANT_ENCODE_MEMO="),
    ],
)
def test_bad_environment_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(name, str(tmp_path / "a-file") if value == "__FILE__" else value)
    code, output = _encode(tmp_path, "--uncalibrated")
    assert code == 2 and message in output and "Traceback" not in output
    assert not (tmp_path / "art").exists()
    if name in ("GLMQUANT_EXL3_BACKEND", "GLMQUANT_ENCODE_MEMO"):  # also for library callers, who build the config
        with pytest.raises(UsageError, match=name):
            EncodeConfig(source=tmp_path, out=tmp_path / "art", uncalibrated=True)


def test_hessian_mode_is_typed_and_the_fingerprint_stable(tmp_path: Path) -> None:
    as_text = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, hessians="all")  # type: ignore[arg-type]  # the config parses option text
    typed = EncodeConfig(source=tmp_path, out=tmp_path / "b", uncalibrated=True, hessians=HessianMode.ALL)
    assert as_text.hessians is HessianMode.ALL
    assert as_text.fingerprint({}) == typed.fingerprint({})
    natural = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True)
    assert as_text.fingerprint({}) != natural.fingerprint({})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--retained-bits", "1"], "--retained-bits must be 2..8 (4..6 is the speed tier), got 1"),
        (["--retained-bits", "9"], "--retained-bits must be 2..8 (4..6 is the speed tier), got 9"),
        (["--head-bits", "1"], "--head-bits must be 2..8, got 1"),
        (["--head-bits", "9"], "--head-bits must be 2..8, got 9"),
        (
            ["--retained-uncalibrated-fallback"],
            "--retained-uncalibrated-fallback applies to --retained-bits, --retained-layer-bits and --head-bits only",
        ),
        (
            ["--retained-layer-bits", "K4,K9"],
            "--retained-layer-bits entry 1 must be 2..8 (4..6 is the speed tier), got 9",
        ),
        (["--retained-layer-bits", "K4,5"], "--retained-layer-bits: entry 1 ('5') is neither K<bits> nor exact"),
        (["--retained-layer-bits", "exact,EXACT"], "--retained-layer-bits keeps every layer exact"),
        (["--retained-layer-bits", "K4x0,K2"], "--retained-layer-bits: entry 0 ('K4x0') repeats its width 0 times"),
        (["--retained-layer-bits", "K4,Kx3"], "--retained-layer-bits: entry 1 ('Kx3') is neither K<bits> nor exact"),
        (
            ["--retained-layer-bits", "K4,K4", "--retained-bits", "4"],
            "--retained-layer-bits names every layer's K: it replaces --retained-bits and --retained-exact-layers",
        ),
        (["--retained-exact-layers", "1"], "--retained-exact-layers keeps some of the --retained-bits linears exact"),
        (["--retained-bits", "4", "--retained-exact-layers", "-1"], "--retained-exact-layers must be 0 or more"),
    ],
)
def test_bad_retained_bits_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    code, output = _encode(tmp_path, "--uncalibrated", *args)
    assert code == 2 and message in output and "Traceback" not in output
    assert not (tmp_path / "art").exists()


def test_layer_bits_repeat_a_width_over_layers_in_a_row(tmp_path: Path) -> None:
    """`WxN` is W for N layers in a row (exact too, any case): the same widths, so the same job, as the entries
    written out."""
    assert parse_layer_bits("K5x2,K3,exactX2,k2x1") == (5, 5, 3, None, None, 2)
    assert parse_layer_bits("K5x11,K3x7,K2x27") == (5,) * 11 + (3,) * 7 + (2,) * 27
    base = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True)
    texts = ("K4x2,exact", "K4,K4,exact")
    short, written = (replace(base, retained_layer_bits=t) for t in texts)  # type: ignore[arg-type]  # text, parsed
    assert short.retained_layer_bits == (4, 4, None) and short.fingerprint({}) == written.fingerprint({})


def test_retained_bits_shape_the_fingerprint_and_leave_older_jobs_resumable(tmp_path: Path) -> None:
    """--retained-bits, --retained-exact-layers, --retained-layer-bits (as text or parsed), --head-bits and their
    fallback change the job's fingerprint (a resume
    notices); without them the fingerprint is the one a job written before these options existed has (no new keys
    hashed)."""
    base = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True)
    k4 = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_bits=4)
    k5 = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_bits=5)
    fallback = EncodeConfig(
        source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_bits=4, retained_fallback_identity=True
    )
    head = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, head_bits=4)
    both = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_bits=4, head_bits=4)
    first_exact = EncodeConfig(
        source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_bits=4, retained_exact_layers=1
    )
    by_layer = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_layer_bits=(None, 4))
    as_text = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True, retained_layer_bits="exact,K4")  # type: ignore[arg-type]
    assert as_text == by_layer
    tuned = EncodeConfig(source=tmp_path, out=tmp_path / "a", observations=tmp_path, tune_scales=50)
    untuned = EncodeConfig(source=tmp_path, out=tmp_path / "a", observations=tmp_path)
    prints = {c.fingerprint({}) for c in (base, k4, k5, fallback, head, both, first_exact, by_layer)}
    assert len(prints) == 8 and tuned.fingerprint({}) != untuned.fingerprint({})
    now = tuned.fingerprint({}), untuned.fingerprint({})
    with pytest.MonkeyPatch.context() as mp:  # a tuned job begun at another learning rate is not resumed
        mp.setattr(encode_config, "LEARNING_RATE", 2e-3)
        assert tuned.fingerprint({}) != now[0] and untuned.fingerprint({}) == now[1]
    assert k4.retained_bits == 4 and base.retained_bits is None
    # the fingerprint of the default options hashes no retained_* key: the pre-option recipe
    skipped = {"out", "work_dir", "verify", "source", "observations", "prune_plan", "tier_plan", "uncalibrated"}
    skipped |= {"verified_at", "retained_bits", "retained_exact_layers", "head_bits", "retained_fallback_identity"}
    skipped |= {"retained_layer_bits"}
    skipped |= {"tune_scales"}
    old = {k: v.value if hasattr(v, "value") else str(v) for k, v in asdict(base).items() if k not in skipped}
    old["device"] = torch.device(base.device).type
    old["backend"] = exl3_backend() or "auto"
    assert base.fingerprint({}) == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()


def test_tier_specs_keep_the_fingerprint_of_jobs_begun_before_layers_specs(tmp_path: Path) -> None:
    """A `depth:` or `reap:` job has the fingerprint it had before `layers:` specs added their widths to TierSpec
    (the hashes below are those of 3ffdbea), so an interrupted tiered job resumes; `layers:` orders differ."""

    def tiered(tiers: str) -> EncodeConfig:
        return EncodeConfig(source=tmp_path, out=tmp_path / "a", observations=tmp_path, tiers=tiers)  # type: ignore[arg-type]

    if exl3_backend() is not None or torch.device(tiered("reap:K2=rest").device).type != "cpu":
        pytest.skip("the pinned hashes are of the CPU encoder's default backend")
    assert tiered("depth:K3=1,K2=rest,K1=1").fingerprint({}) == (
        "9ab63ed24421cefb063c07fb9ac564872b4857b3c5673fca00f79b89a8f1331d"
    )
    assert tiered("reap:K3=25%,K2=rest").fingerprint({}) == (
        "87faf28c882eef8db893ff35bf8005d30ac11bd81fbe8e818bffb4e4fa1ac00f"
    )
    prints = {tiered(t).fingerprint({}) for t in ("layers:K3,K1", "layers:K1,K3", "depth:K3=1,K2=rest,K1=1")}
    assert len(prints) == 3


def test_the_encoders_own_defaults_shape_the_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Units encoded with another scale-search sample or refit must not be resumed into one artifact with these
    (today's defaults hash no key: the test above)."""
    import glmquant.encode.config as config

    cfg = EncodeConfig(source=tmp_path, out=tmp_path / "a", uncalibrated=True)
    now = cfg.fingerprint({})
    monkeypatch.setattr(config, "DEFAULT_SEARCH", replace(DEFAULT_SEARCH, coarse_stride=3, coarse_min_tiles=0))
    assert cfg.fingerprint({}) != now
    monkeypatch.undo()
    monkeypatch.setattr(config, "REFIT_ROUNDS", REFIT_ROUNDS + 1)
    assert cfg.fingerprint({}) != now


def test_a_cuda_device_none_is_visible_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device cuda on a machine without CUDA is one usage line (not torch's AssertionError from the first unit),
    and no artifact or work directory is made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "obs").mkdir()
    code, output = _encode(tmp_path, "--observations", str(tmp_path / "obs"), "--device", "cuda")
    assert code == 2 and "--device cuda: no CUDA device is visible here" in output and "Traceback" not in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["obs"] and not any((tmp_path / "obs").iterdir())
