"""`encode --head-bits K` without `--retained-bits`, end to end on a micro model (the small model's shape with one MoE
layer of 128-wide experts, so its routed experts encode in seconds): observe captures lm_head's Hessian (the final
norm's output over every calibration token), encode stores lm_head as one EXL3 tensor in the file that held it and
everything else as before, writes what `plan --head-bits` predicts, verifies, encodes the same bytes again, its decode
is close to the BF16 head in the Hessian's metric, and both runtimes give the same logits, close to those of the same
artifact with its exact head back. A missing head Hessian is refused (named) or, with the fallback, the head encoded
uncalibrated; a head tied to the embedding is refused by plan, encode and a dummy load.
With `--retained-bits` and in the tr3 layout: test_retained_bits.py."""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from encode_fixtures import QUIET, assert_verify_manifest_cli, observed, tiny_source
from indexer_ties import indexer_ties_to_earlier_pool
from rich.console import Console
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from glmquant.arch import load_model_spec, read_config, source_tensors
from glmquant.calibration import TokenRows
from glmquant.checkpoint.layouts import plan_artifact
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.cli import app
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.layer import UnitInputs, encode_unit
from glmquant.encode.retained import encode_retained_file, retained_linears
from glmquant.encode.run import EncodeResult
from glmquant.errors import UsageError
from glmquant.exl3.decode import decode_weight
from glmquant.exl3.encode import proxy_error
from glmquant.fixtures import TinyModelConfig
from glmquant.observe.hessian_reader import hessians_path, load_dense_hessian
from glmquant.observe.streaming import stream_final_hidden
from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.dummy import dummy_artifact
from glmquant.runtime.engine import Engine, EngineDecoder
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import load_model
from glmquant.runtime.mtp import load_mtp
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear

pytestmark = [
    pytest.mark.slow,  # one encode of the micro model: its routed experts and its head
    pytest.mark.xdist_group("head-bits"),  # under pytest-xdist (`make test`) one worker builds the module fixtures
]

MICRO = TinyModelConfig(num_hidden_layers=2, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=128)
HEAD_K = 4
HEAD = "lm_head.weight"
PROMPT = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]])
F32 = RuntimeOptions(dtype="float32")


@pytest.fixture(scope="module")
def micro_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_source(tmp_path_factory, "micro-src", MICRO)


@pytest.fixture(scope="module")
def micro_observations(micro_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return observed(micro_source, tmp_path_factory, "micro-obs", dense_hessians=True)


@pytest.fixture(scope="module")
def head_tier(micro_source: Path, micro_observations: Path, tmp_path_factory: pytest.TempPathFactory) -> EncodeResult:
    cfg = EncodeConfig(
        source=micro_source,
        out=tmp_path_factory.mktemp("head-tier") / "art",
        observations=micro_observations,
        layout="exllamav3",
        head_bits=HEAD_K,
        verified_at="2026-01-01T00:00:00Z",
    )
    result = encode_artifact(cfg, QUIET)
    assert result is not None
    return result


def test_observe_captures_the_heads_input(micro_source: Path, micro_observations: Path) -> None:
    """`head.hessians.safetensors` holds Σ x xᵀ of lm_head's input over every token of the Hessian lanes: x the
    model's last hidden state (final norm after the streams' mean), as streaming the rows through the model gives."""
    path = hessians_path(micro_observations, None)
    assert path.name == "head.hessians.safetensors"
    with SourceCheckpoint.open(path) as f:
        assert set(f.names()) == {"dense.lm_head.weight.sum", "dense.lm_head.weight.count"}
        assert (f.headers[path.name].metadata or {})["layer"] == "head"
    rows = TokenRows.load(micro_observations)
    batch_rows = json.loads((micro_observations / "observations.json").read_text())["batch_rows"]
    lanes = [lane.ids for lane in rows.lanes if "hessians" in lane.use]
    x = torch.cat([stream_final_hidden(micro_source, ids, batch_rows=batch_rows) for ids in lanes])
    x = x.reshape(-1, MICRO.hidden_size).float()
    ids = torch.cat([ids.flatten() for ids in lanes])
    head = load_dense_hessian(micro_observations, None, HEAD)
    assert head.count == ids.numel()
    torch.testing.assert_close(head.sum, x.T @ x, rtol=1e-4, atol=1e-3)


def test_head_only_artifact_is_the_plan_and_verifies(micro_source: Path, head_tier: EncodeResult) -> None:
    """Exactly the files `plan --head-bits` predicts, lm_head as one EXL3 tensor at K in the file that held it, every
    other retained tensor the source's bytes; the manifest and both configs record head_bits (and no retained_bits);
    verify-manifest passes against the pinned hash."""
    art = head_tier.artifact.directory
    spec = load_model_spec(micro_source)
    plan = plan_artifact(spec, "exllamav3", head_bits=HEAD_K)
    assert plan.head_bits == HEAD_K and plan.retained_bits is None
    for f in plan.files:
        assert (art / f.path).stat().st_size == f.size, f.path
        with SourceCheckpoint.open(art / f.path) as ckpt:
            assert {n: (ckpt.spec(n).dtype, tuple(ckpt.spec(n).shape)) for n in ckpt.names()} == {
                t.name: (t.dtype, t.shape) for t in f.tensors
            }
    result = CliRunner().invoke(
        app, ["plan", str(micro_source), "--layout", "exllamav3", "--head-bits", str(HEAD_K), "--json"]
    )
    assert result.exit_code == 0, result.output
    predicted = json.loads(result.stdout)
    assert predicted["head_bits"] == HEAD_K and "retained_bits" not in predicted
    assert sorted((f["path"], f["bytes"]) for f in predicted["files"]) == sorted(
        (p.name, p.stat().st_size) for p in art.glob("*.safetensors")
    )
    with SourceCheckpoint.open(micro_source) as source, SourceCheckpoint.open(art) as ckpt:
        linears = [n.removesuffix(".trellis") for n in ckpt.names() if n.endswith(".trellis") and ".experts." not in n]
        assert linears == ["lm_head"] and HEAD not in ckpt
        assert ckpt.spec("lm_head.trellis").shape == (128 // 16, 384 // 16, 16 * HEAD_K)  # in 128; out 320, padded
        for t in source_tensors(spec):
            if t.role.value != "routed_expert" and t.name != HEAD:
                assert ckpt.read_raw(t.name) == source.read_raw(t.name), t.name
    manifest = json.loads((art / "EXL3_MANIFEST.json").read_text())
    assert manifest["layout"]["head_bits"] == HEAD_K and "retained_bits" not in manifest["layout"]
    assert sum(e["exl3_linear_count"] for e in manifest["files"]) == len(spec.moe_layers) * 2 * 3 + 1
    qc = json.loads((art / "quantization_config.json").read_text())
    assert qc["head_bits"] == read_config(art)["quantization_config"]["head_bits"] == HEAD_K
    assert qc["tensor_storage"]["lm_head"]["quant_format"] == "exl3"
    assert qc["tensor_storage"]["lm_head"]["bits_per_weight"] == HEAD_K
    assert_verify_manifest_cli(head_tier)


@pytest.mark.fresh_encodes
def test_head_decodes_close_in_its_hessian_metric_and_encodes_the_same_bytes_again(
    micro_source: Path, micro_observations: Path, head_tier: EncodeResult
) -> None:
    """The stored head decodes to within a small proxy error tr(E H Eᵀ)/tr(W H Wᵀ) of the BF16 head (H its input's
    Hessian; measured 2.2e-3, 4.8e-3 when encoded with an identity Hessian); encoding it again, alone, gives the bytes
    on disk."""
    art = open_artifact(head_tier.artifact.directory)
    decoded = decode_weight(art.read_linear(art.retained_linears["lm_head"]), torch.float32)
    hessian = load_dense_hessian(micro_observations, None, HEAD).mean()
    with SourceCheckpoint.open(micro_source) as source:
        weight = source.read_tensor(HEAD).float()
        error = proxy_error(weight, decoded, hessian)
        assert 0 < error < 5e-3, error
        head_file = next(f for f in plan_artifact(art.spec, "exllamav3", head_bits=HEAD_K).files if retained_linears(f))
        assert [lin.source for lin in retained_linears(head_file)] == [HEAD]
        again = encode_retained_file(head_file, source, micro_observations, False, "mcg", 0, "cpu")
    assert [r.fallback for r in again.reports] == [None]
    with pytest.raises(ValueError, match="no K for lm_head"):  # the head's K comes with its inputs, or not at all
        encode_unit(UnitInputs(["lm_head"], [(weight, hessian)], [None]), None, "mcg", 0, "cpu")
    assert set(again.tensors) == {f"lm_head.{part}" for part in ("trellis", "suh", "svh", "mcg")}
    for name, tensor in again.tensors.items():
        assert torch.equal(tensor, art.checkpoint.read_tensor(name)), name
    art.checkpoint.close()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q)."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_both_runtimes_run_the_head_alike_close_to_the_exact_head(micro_source: Path, head_tier: EncodeResult) -> None:
    """transformers' modules (the head an `Exl3Linear`, which the MTP layer shares) and the engine give the same
    logits for the prompt and three greedy steps, and the MTP layer's draft logits alike; those logits are close to the
    same artifact's with the exact head (the K4 head costs less than the K2 routed experts do: mean KL 1.2e-4 against
    1.4e-3, measured)."""
    artifact = open_artifact(head_tier.artifact.directory)
    loaded = load_model(artifact, F32)
    head = loaded.model.get_submodule("lm_head")
    assert isinstance(head, Exl3Linear) and head.bits == HEAD_K and head.source == HEAD
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, a, out: seen.append(out[0, -1].clone()))
    params = SamplingParams(max_tokens=4)
    try:
        with indexer_ties_to_earlier_pool():
            expected = generate(loaded.model, PromptInputs(PROMPT), params, lambda ids: "").token_ids
    finally:
        hook.remove()
    engine = Engine.load(artifact, F32, max_batch=1, max_len=64, mtp=True)
    decoder = EngineDecoder(engine)
    logits = [decoder.prefill(PromptInputs(PROMPT)).clone()]
    for token in expected[:-1]:
        logits.append(decoder.step(token).clone())
    assert [int(x.argmax()) for x in logits] == list(expected)
    for ours, theirs in zip(logits, seen, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    mtp = load_mtp(loaded)  # the MTP layer's logits go through the same EXL3 head
    assert mtp._lm_head[0] is head
    g = torch.Generator().manual_seed(0)
    hidden, ids = torch.randn(1, 6, MICRO.hidden_size, generator=g), torch.randint(0, 300, (1, 6), generator=g)
    with torch.no_grad():
        want, _ = mtp(hidden, ids, mtp.new_cache())
    got, _ = engine.draft(0, hidden[0], ids[0], 0)
    torch.testing.assert_close(got, want[0], rtol=0, atol=1e-5)

    with torch.no_grad():
        quantized = loaded.model(input_ids=PROMPT).logits[0].float()
        with SourceCheckpoint.open(micro_source) as source:
            head.weight = source.read_tensor(HEAD).float()  # the exact head back
        exact = loaded.model(input_ids=PROMPT).logits[0].float()
    from transformers import Glm5NextForConditionalGeneration

    reference = Glm5NextForConditionalGeneration.from_pretrained(str(micro_source), dtype=torch.float32).eval()
    with torch.no_grad():
        source_logits = reference(input_ids=PROMPT).logits[0].float()
    head_cost, routed_cost = _kl(exact, quantized), _kl(source_logits, exact)
    assert 0 < head_cost < routed_cost, (head_cost, routed_cost)
    # top-1 flips follow near-ties of the random model's logits, which differ between CPUs' matmul kernels (11 of 12
    # kept on one machine, 9 on another): the head must keep at least as many as the routed experts' K2 does (6 here)
    kept = int((exact.argmax(-1) == quantized.argmax(-1)).sum())
    assert kept >= int((source_logits.argmax(-1) == exact.argmax(-1)).sum()) and kept > PROMPT.shape[1] // 2


def test_a_missing_head_hessian_is_refused_naming_it_or_encoded_with_the_fallback(
    micro_source: Path, micro_observations: Path, tmp_path: Path
) -> None:
    """Observations without lm_head's Hessian (observed before it was captured): refused before anything is
    written, naming lm_head.weight and the file and saying to observe into a new --out; with
    --retained-uncalibrated-fallback lm_head is encoded with an identity Hessian (the warning names it) and stored as
    EXL3 in an artifact that verifies."""
    obs = tmp_path / "obs"
    shutil.copytree(micro_observations, obs)
    hessians_path(obs, None).unlink()
    out = tmp_path / "art"
    cfg = EncodeConfig(source=micro_source, out=out, observations=obs, layout="exllamav3", head_bits=HEAD_K)
    missing = r"--head-bits: lm_head\.weight needs its dense Hessian \(.*head\.hessians.*into a new --out"
    with pytest.raises(UsageError, match=missing):
        encode_artifact(cfg, QUIET)
    assert not out.exists() and not (tmp_path / "art.work").exists()
    warnings = io.StringIO()
    result = encode_artifact(replace(cfg, retained_fallback_identity=True), Console(file=warnings, width=300))
    assert result is not None and result.verification is not None and result.verification.ok
    assert "lm_head: no_dense_hessian:identity" in warnings.getvalue()
    with SourceCheckpoint.open(out) as ckpt:
        assert "lm_head.trellis" in ckpt and HEAD not in ckpt


def _tied_copy(source: Path, out: Path) -> Path:
    """`source` as a checkpoint whose head is tied to its embedding: the config says so and lm_head.weight is gone."""
    shutil.copytree(source, out)
    config = read_config(out)
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"].pop(HEAD)
    tensors = load_file(shard)
    del tensors[HEAD]
    save_file(tensors, shard, metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_a_head_tied_to_the_embedding_is_refused(micro_source: Path, tmp_path: Path) -> None:
    """tie_word_embeddings: there is no head of its own to encode; plan, encode (before writing anything) and a dummy
    load refuse --head-bits, saying why."""
    tied = _tied_copy(micro_source, tmp_path / "tied")
    spec = load_model_spec(tied)
    assert spec.tie_word_embeddings
    why = "ties lm_head to the input embedding"
    with pytest.raises(UsageError, match=why):
        plan_artifact(spec, "tr3", head_bits=HEAD_K)
    assert plan_artifact(spec, "tr3", retained_bits=HEAD_K).head_bits is None
    result = CliRunner().invoke(app, ["plan", str(tied), "--head-bits", str(HEAD_K)])
    assert result.exit_code == 2 and "the head is the embedding" in " ".join(result.output.split())
    out = tmp_path / "art"
    with pytest.raises(UsageError, match=why):
        encode_artifact(EncodeConfig(source=tied, out=out, uncalibrated=True, head_bits=HEAD_K), QUIET)
    assert not out.exists() and not (tmp_path / "art.work").exists()
    with pytest.raises(UsageError, match=why):
        dummy_artifact(tied, "tr3", head_bits=HEAD_K)
