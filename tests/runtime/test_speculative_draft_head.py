"""A drafter's own lm_head (`--speculative-config '{"draft_head": FILE}'`, a file from `glmquant draft-head`): the
drafts' logits come from it on the engine and on transformers' modules, the verify keeps the artifact's head, so
greedy output stays plain greedy decoding's (float32, the tiny tr3 artifact, a K3 copy of its lm_head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glmquant.checkpoint.draft_head import DraftHead, read_draft_head, read_draft_mtp, write_draft_head
from glmquant.encode.draft_head import build_draft_head
from glmquant.errors import UsageError
from glmquant.exl3 import decode_weight, encode_linears
from glmquant.observe.config import ObserveConfig
from glmquant.observe.run import observe
from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.engine import Engine, EngineDecoder
from glmquant.runtime.engine.experts import LayerExperts
from glmquant.runtime.engine.linears import Exl3Proj
from glmquant.runtime.engine.loaded import load_engine
from glmquant.runtime.engine.mtp import DenseExperts
from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import load_model
from glmquant.runtime.mtp_decoder import MtpDecoder
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear
from glmquant.runtime.speculative import SpeculativeConfig

# pytest-xdist: the module on one worker, so `mtp_draft` (observe, then draft-head --mtp-bits) is built once
pytestmark = pytest.mark.xdist_group("mtp-draft")

PROMPT = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))
TOKENS = 12


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def draft_head(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A K3 copy of the artifact's lm_head, uncalibrated (the runtime reads any draft-head file alike)."""
    artifact = open_artifact(artifacts["tr3"])
    weight = artifact.checkpoint.read_tensor("lm_head.weight").float()
    artifact.checkpoint.close()
    [encoded] = encode_linears([(weight, None)], 3)
    path = tmp_path_factory.mktemp("draft-head") / "head.safetensors"
    head = DraftHead("lm_head", 3, "mcg", weight.shape[1], weight.shape[0])
    write_draft_head(path, head, encoded.tensor.tensors("lm_head"))
    return path


@pytest.fixture(scope="module")
def mtp_draft(tiny_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product path: observe --dense-hessians, then draft-head --bits 3 --mtp-bits 4 (routed experts K2) of the
    source the tr3 artifact was built from."""
    observations = tmp_path_factory.mktemp("mtp-obs")
    observe(ObserveConfig(source=tiny_source, out=observations, rows=4, tokens=32, dense_hessians=True))
    path = tmp_path_factory.mktemp("mtp-draft") / "draft.safetensors"
    build_draft_head(tiny_source, observations, path, bits=3, mtp_bits=4, mtp_expert_bits=2)
    return path


def _options(draft_head: Path, k: int = 2, **fields) -> RuntimeOptions:
    return RuntimeOptions(dtype="float32", speculative_config=SpeculativeConfig("mtp", k, str(draft_head)), **fields)


def test_engine_drafts_read_the_draft_head(artifacts: dict[str, Path], draft_head: Path) -> None:
    """The engine's draft logits are the MTP layer's normed output times the draft head's decoded weight, not the
    artifact's lm_head."""
    artifact = open_artifact(artifacts["tr3"])
    options = RuntimeOptions(dtype="float32")
    with_head = Engine.load(artifact, options, max_batch=1, max_len=32, mtp=True, draft_head=draft_head)
    without = Engine.load(artifact, options, max_batch=1, max_len=32, mtp=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, with_head.cfg.hidden, generator=g)
    ids = torch.randint(0, with_head.cfg.vocab, (5,), generator=g)
    (logits, out), (target_logits, target_out) = with_head.draft(0, hidden, ids, 0), without.draft(0, hidden, ids, 0)
    torch.testing.assert_close(out, target_out, rtol=0, atol=0)  # the same MTP layer
    assert with_head.mtp is not None
    normed = with_head.prefill_run.ops.rms_norm(out, with_head.mtp.head_norm, with_head.cfg.rms_eps)
    head = decode_weight(read_draft_head(draft_head, with_head.cfg.hidden, with_head.cfg.vocab, "cpu"), torch.float32)
    torch.testing.assert_close(logits, F.linear(normed, head), rtol=0, atol=1e-5)
    assert (logits - target_logits).abs().max() > 1e-3  # a K3 copy: other logits than the artifact's head gives


@pytest.mark.parametrize("k", [1, 2])
def test_engine_speculation_with_a_draft_head_equals_plain_greedy(
    artifacts: dict[str, Path], draft_head: Path, k: int
) -> None:
    artifact = open_artifact(artifacts["tr3"])
    plain_engine = Engine.load(artifact, RuntimeOptions(dtype="float32"), max_batch=1, max_len=32)
    plain = generate(EngineDecoder(plain_engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    loaded = load_engine(artifact, _options(draft_head, k, model_impl="glmquant"), max_seqs=1, max_len=32)
    assert loaded.engine.mtp is not None and loaded.engine.mtp.head is not None
    with loaded.session() as decoder:
        assert isinstance(decoder, EngineMtpDecoder)
        spec = generate(decoder, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids
    assert spec.speculative is not None and spec.speculative.drafted == k * spec.speculative.steps


def test_transformers_path_drafts_with_the_draft_head(artifacts: dict[str, Path], draft_head: Path) -> None:
    loaded = load_model(artifacts["tr3"], _options(draft_head))
    assert loaded.mtp is not None
    head = loaded.mtp._lm_head[0]
    assert isinstance(head, Exl3Linear) and head.bits == 3 and head is not loaded.model.lm_head
    plain = generate(loaded.model, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    spec = generate(MtpDecoder(loaded.model, loaded.mtp, 2), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids


@pytest.mark.slow
def test_drafts_read_the_mtp_copy_on_both_model_implementations(artifacts: dict[str, Path], mtp_draft: Path) -> None:
    """With a draft file that holds the MTP layer (`--mtp-bits`), the engine's drafts equal transformers' MTP module
    filled from the same copy (decoded), and differ from the artifact's BF16 MTP layer's; the engine keeps none of
    the artifact's MTP experts."""
    artifact = open_artifact(artifacts["tr3"])
    options = RuntimeOptions(dtype="float32")
    copied = Engine.load(artifact, options, max_batch=1, max_len=32, mtp=True, draft_head=mtp_draft)
    artifact_layer = Engine.load(artifact, options, max_batch=1, max_len=32, mtp=True)
    assert copied.mtp is not None and isinstance(copied.mtp.experts, DenseExperts)
    mtp_copy = read_draft_mtp(mtp_draft, artifact.spec, "cpu")
    assert mtp_copy is not None
    want_down = decode_weight(mtp_copy.experts[1]["down_proj"], torch.float32)
    torch.testing.assert_close(copied.mtp.experts.down[1], want_down, rtol=0, atol=0)
    module = load_model(artifacts["tr3"], _options(mtp_draft)).mtp
    assert module is not None
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 13, copied.cfg.hidden, generator=g)
    ids = torch.randint(0, copied.cfg.vocab, (1, 13), generator=g)
    with torch.no_grad():
        want_logits, want_out = module(hidden, ids, module.new_cache())
    logits, out = copied.draft(0, hidden[0], ids[0], 0)
    torch.testing.assert_close(out, want_out[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, want_logits[0], rtol=0, atol=1e-5)
    _, artifact_out = artifact_layer.draft(0, hidden[0], ids[0], 0)
    assert (out - artifact_out).abs().max() > 1e-3  # the K4/K2 copy, not the artifact's layer


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_speculation_with_the_mtp_copy_equals_plain_greedy(artifacts: dict[str, Path], mtp_draft: Path, k: int) -> None:
    artifact = open_artifact(artifacts["tr3"])
    plain_engine = Engine.load(artifact, RuntimeOptions(dtype="float32"), max_batch=1, max_len=32)
    plain = generate(EngineDecoder(plain_engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    loaded = load_engine(artifact, _options(mtp_draft, k, model_impl="glmquant"), max_seqs=1, max_len=32)
    with loaded.session() as decoder:
        spec = generate(decoder, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids
    model = load_model(artifacts["tr3"], _options(mtp_draft, k))
    assert model.mtp is not None
    spec = generate(MtpDecoder(model.model, model.mtp, k), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids


@pytest.mark.slow
def test_an_artifact_that_pruned_its_mtp_experts_refuses_the_copy(
    tiny_source: Path, mtp_draft: Path, tmp_path: Path
) -> None:
    """The copy holds every routed expert of the source; an artifact whose MTP layer keeps fewer (`--keep` prunes it
    with the MoE layers) would route its router's rows to the wrong experts, so the copy is refused naming both."""
    from glmquant.arch import load_model_spec
    from glmquant.checkpoint.artifact_writer import finalize_artifact, write_artifact_files
    from glmquant.checkpoint.layouts import plan_artifact
    from glmquant.checkpoint.provenance import Provenance
    from glmquant.checkpoint.reader import SourceCheckpoint
    from glmquant.fixtures.random_artifact import random_experts

    spec = load_model_spec(tiny_source / "config.json")
    keep = {layer: [0, 1, 3] for layer in spec.moe_layers + spec.mtp_layers}
    out = tmp_path / "pruned"
    with SourceCheckpoint.open(tiny_source) as ckpt:
        plan = plan_artifact(spec, "tr3", source_shards=ckpt.locations, keep=keep)
        write_artifact_files(plan, ckpt, random_experts, out)
        finalize_artifact(plan, ckpt, out, Provenance(source_repo="glmquant/tiny"), verified_at="2026-01-01T00:00:00Z")
    with pytest.raises(UsageError, match=r"holds MTP layer 3 with 4 routed experts, .* with 3: .* the artifact pruned"):
        Engine.load(open_artifact(out), RuntimeOptions(dtype="float32"), max_len=32, mtp=True, draft_head=mtp_draft)


def test_draft_head_enters_through_the_speculative_config(artifacts: dict[str, Path], tmp_path: Path) -> None:
    parsed = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2, "draft_head": "h.safetensors"}')
    assert parsed == SpeculativeConfig("mtp", 2, "h.safetensors")
    assert SpeculativeConfig.parse(json.dumps(parsed.as_json())) == parsed
    assert SpeculativeConfig("mtp", 2).as_json() == {"method": "mtp", "num_speculative_tokens": 2}  # vLLM's keys
    for bad in ('{"draft_head": 3}', '{"draft_head": ""}'):
        with pytest.raises(UsageError, match=r"draft_head must be a file path"):
            SpeculativeConfig.parse(bad)
    with pytest.raises(UsageError, match=r"absent\.safetensors: no such file"):
        load_model(artifacts["tr3"], _options(tmp_path / "absent.safetensors"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_drafts_with_the_exl3_draft_head(artifacts: dict[str, Path], draft_head: Path) -> None:
    """On CUDA with the Triton backends the draft head is an `Exl3Proj` run by the EXL3 kernels: the drafts' logits
    are the decoded copy's (float32 within the kernels' fp16 rounding), and greedy output with k = 1, 2, eager and
    in CUDA graphs, equals plain greedy."""
    options = RuntimeOptions(device="cuda", dtype="float32", backend="triton")
    artifact = open_artifact(artifacts["tr3"])
    engine = Engine.load(artifact, options, max_batch=1, max_len=64, mtp=True, draft_head=draft_head)
    assert engine.mtp is not None and isinstance(engine.mtp.head, Exl3Proj)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, engine.cfg.hidden, generator=g).cuda()
    logits, out = engine.draft(0, hidden, torch.tensor([5, 6, 7]), 0)
    normed = engine.prefill_run.ops.rms_norm(out, engine.mtp.head_norm, engine.cfg.rms_eps)
    head = decode_weight(read_draft_head(draft_head, engine.cfg.hidden, engine.cfg.vocab, "cuda"), torch.float32)
    want = F.linear(normed, head)
    assert float((logits - want).norm() / want.norm()) < 2e-3
    _assert_speculation_is_plain_greedy(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_drafts_with_the_exl3_mtp_copy(artifacts: dict[str, Path], mtp_draft: Path) -> None:
    """On CUDA with the Triton backends the copy's linears are `Exl3Proj`s (every one, with no dense threshold) and its
    routed experts one `fused_moe` stack: the drafts equal the decoded copy's on the CPU (float32 within the kernels'
    fp16 rounding), and greedy output with k = 1, 2, eager and in CUDA graphs, equals plain greedy."""
    artifact = open_artifact(artifacts["tr3"])
    options = RuntimeOptions(device="cuda", dtype="float32", backend="triton", dense_linear_max_weights=0)
    engine = Engine.load(artifact, options, max_batch=1, max_len=64, mtp=True, draft_head=mtp_draft)
    assert engine.mtp is not None and isinstance(engine.mtp.eh_proj, Exl3Proj)
    assert isinstance(engine.mtp.experts, LayerExperts)
    decoded = Engine.load(
        artifact, RuntimeOptions(dtype="float32"), max_batch=1, max_len=64, mtp=True, draft_head=mtp_draft
    )
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, engine.cfg.hidden, generator=g)
    ids = torch.tensor([5, 6, 7])
    _, out = engine.draft(0, hidden.cuda(), ids, 0)
    _, want = decoded.draft(0, hidden, ids, 0)
    assert float((out.cpu() - want).norm() / want.norm()) < 5e-3
    _assert_speculation_is_plain_greedy(engine)


def _assert_speculation_is_plain_greedy(engine: Engine) -> None:
    """Greedy output with k = 1, 2 drafts, eager and in CUDA graphs, equals the engine's plain greedy."""
    plain = generate(EngineDecoder(engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    for k in (1, 2):
        for graphs in (False, True):
            decoder = EngineMtpDecoder(engine, k, graphs=graphs)
            spec = generate(decoder, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
            assert spec.token_ids == plain.token_ids, (k, graphs)
