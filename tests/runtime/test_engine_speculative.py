"""MTP speculative decoding on the runtime's own engine: the engine's MTP layer equals `arch.hf_glm5_mtp.MtpLayer` on
the same weights, and greedy output with k = 1, 2, 3 drafts equals the engine's plain greedy, token for token,
with a random MTP layer (every draft rejected: each KDA layer's state after the kept token copied back from the
verify step's history) and with an oracle drafter (full and partial acceptance: the verify forward's logits kept,
MLA positions rewritten after a cut)."""

from __future__ import annotations

import http.client
import shutil
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.engine import Engine, EngineDecoder
from glmquant.runtime.engine.loaded import LoadedEngine, load_engine
from glmquant.runtime.engine.spec_decoder import EngineMtpDecoder
from glmquant.runtime.generate import Generation, PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import LoadedModel
from glmquant.runtime.mtp import load_mtp
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.server import serve_in_background
from glmquant.runtime.speculative import SpeculativeConfig, SpeculativeDecoder

SLOW = pytest.mark.slow  # the fast tier keeps k = 2

# 12 prompt tokens + 20 generated: past index_topk (8), so the indexer's sparse selection runs over rolled-back caches
PROMPT = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))
TOKENS = 20
F32 = RuntimeOptions(dtype="float32")


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def engine(artifacts: dict[str, Path]) -> Engine:
    return Engine.load(open_artifact(artifacts["tr3"]), F32, max_batch=1, max_len=64, mtp=True)


@pytest.fixture(scope="module")
def plain(engine: Engine) -> Generation:
    return generate(EngineDecoder(engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)


class OracleDecoder(EngineMtpDecoder):
    """Drafts the plain greedy continuation, wrong wherever `wrong(generated index)` says."""

    def __init__(self, engine: Engine, k: int, truth: tuple[int, ...], wrong) -> None:
        super().__init__(engine, k)
        self.truth, self.wrong = truth, wrong

    def _draft(self, token: int) -> list[int]:
        at = self.position - PROMPT.num_tokens + 1  # generated index of the first draft
        return [
            (self.truth[i] + 1) % 300 if self.wrong(i) else self.truth[i]
            for i in range(at, at + self.k)
            if i < len(self.truth)
        ] or [0]


def test_engine_mtp_layer_equals_the_mtp_module(tr3_f32: LoadedModel, engine: Engine) -> None:
    """A 12-position pass (past the indexer's top-k; experts expert by expert), then one more position from the
    cache (experts gathered per route): logits and output hidden states of both implementations."""
    mtp = load_mtp(tr3_f32)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 13, engine.cfg.hidden, generator=g)
    ids = torch.randint(0, engine.cfg.vocab, (1, 13), generator=g)
    cache = mtp.new_cache()
    with torch.no_grad():
        want = [mtp(hidden[:, :12], ids[:, :12], cache), mtp(hidden[:, 12:], ids[:, 12:], cache)]
    got = [engine.draft(0, hidden[0, :12], ids[0, :12], 0), engine.draft(0, hidden[0, 12:], ids[0, 12:], 12)]
    for (logits, out), (want_logits, want_out) in zip(got, want):
        torch.testing.assert_close(logits, want_logits[0], rtol=0, atol=1e-5)  # measured: 1.5e-7
        torch.testing.assert_close(out, want_out[0], rtol=0, atol=1e-5)


def test_keep_verified_puts_back_the_states_after_the_kept_tokens(engine: Engine) -> None:
    """A 4-token verify cut back to 2 tokens leaves every KDA state and conv input as a 2-token verify from the
    same start does (to rounding: a matmul's rows need not round alike at another row count; measured 3e-7;
    the 4 tokens moved them by 1.0)."""
    ids = PROMPT.input_ids.view(-1)
    engine.prefill(0, ids)
    start, before = ids.numel(), engine.save_recurrent(0)
    step = torch.tensor([5, 6, 7, 8])
    engine.verify(0, step[:2], start)
    want = engine.save_recurrent(0)
    engine.restore_recurrent(0, before)
    engine.verify(0, step, start)
    moved = max(float((a - b).abs().max()) for a, b in zip(engine.save_recurrent(0), want))
    engine.keep_verified(0, 2)
    diff = max(float((a - b).abs().max()) for a, b in zip(engine.save_recurrent(0), want, strict=True))
    assert moved > 0.1 and diff < 1e-5


@pytest.mark.parametrize("k", [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)])
def test_engine_speculation_equals_plain_greedy(engine: Engine, plain: Generation, k: int) -> None:
    decoder = EngineMtpDecoder(engine, k)
    assert isinstance(decoder, SpeculativeDecoder)
    spec = generate(decoder, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text and spec.finish_reason == "length"
    stats = spec.speculative
    assert stats is not None and stats.drafted == k * stats.steps and 0 <= stats.accepted <= stats.drafted
    assert stats.accepted + stats.steps >= TOKENS - 1


@pytest.mark.parametrize("k", [pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)])
def test_engine_accepted_drafts_and_rollbacks_keep_greedy_output(engine: Engine, plain: Generation, k: int) -> None:
    """Drafts right except at every 5th generated token: full and partial acceptances; then always right."""
    spec = generate(
        OracleDecoder(engine, k, plain.token_ids, lambda i: i % 5 == 3),
        PROMPT,
        SamplingParams(max_tokens=TOKENS),
        decode,
    )
    assert spec.token_ids == plain.token_ids
    stats = spec.speculative
    assert stats is not None and 0 < stats.accepted < stats.drafted and stats.tokens_per_step > 1.0
    perfect = generate(
        OracleDecoder(engine, k, plain.token_ids, lambda i: False), PROMPT, SamplingParams(max_tokens=TOKENS), decode
    )
    assert perfect.token_ids == plain.token_ids
    assert perfect.speculative is not None and perfect.speculative.tokens_per_step > k


@pytest.mark.slow
def test_bf16_speculation_with_every_draft_rejected_is_plain_decoding(artifacts: dict[str, Path]) -> None:
    """BF16 on the CPU: the random MTP layer's drafts are all rejected, and each step's token comes from the
    verify step's first row on the decode math, the same as plain greedy's one-token step."""
    engine = Engine.load(open_artifact(artifacts["tr3"]), RuntimeOptions(dtype="bfloat16"), max_len=64, mtp=True)
    plain = generate(EngineDecoder(engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    for k in (1, 3):
        spec = generate(EngineMtpDecoder(engine, k), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
        assert spec.token_ids == plain.token_ids
        assert spec.speculative is not None and spec.speculative.accepted == 0


def test_served_engine_speculates_up_to_the_end_of_its_context(artifacts: dict[str, Path], plain: Generation) -> None:
    """`load_engine` leaves room for the k positions a verify step writes past the last token: a generation that
    fills max_len (prompt + tokens) with k = 3 ends as plain greedy does."""
    options = RuntimeOptions(dtype="float32", model_impl="glmquant", speculative_config=SpeculativeConfig("mtp", 3))
    loaded = load_engine(open_artifact(artifacts["tr3"]), options, max_seqs=1, max_len=PROMPT.num_tokens + 8)
    with loaded.session() as decoder:
        assert isinstance(decoder, EngineMtpDecoder) and decoder.k == 3
        out = generate(decoder, PROMPT, SamplingParams(max_tokens=8), decode)
    assert out.token_ids == plain.token_ids[:8]


def test_dummy_engine_server_speculates_and_reports_it(tiny_source: Path, tmp_path: Path) -> None:
    """`serve --load-format dummy --model-impl glmquant --speculative-config`: the dummy MTP layer is made
    resident, and usage and /metrics report the drafts as on the transformers path."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_source / "config.json", bare / "config.json")
    config = SpeculativeConfig(num_speculative_tokens=2)
    with serve_in_background(
        bare, load_format="dummy", model_impl="glmquant", max_model_len=256, speculative_config=config
    ) as srv:
        loaded = srv.service.loaded
        assert isinstance(loaded, LoadedEngine) and loaded.engine.mtp is not None
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="bare", prompt=[256, 10, 20, 30], max_tokens=6, temperature=0)
        conn = http.client.HTTPConnection(*srv.address, timeout=30)
        conn.request("GET", "/metrics")
        metrics = {
            s.name: s.value
            for family in text_string_to_metric_families(conn.getresponse().read().decode())
            for s in family.samples
        }
    assert out.usage is not None and out.usage.completion_tokens == 6
    spec = (out.usage.model_extra or {})["speculative"]
    assert spec["num_draft_tokens"] == 2 * spec["num_drafts"] >= 2
    assert spec["num_accepted_tokens"] + spec["num_drafts"] >= 5
    assert metrics["glmquant:spec_decode_num_drafts_total"] == spec["num_drafts"]
    assert metrics["glmquant:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_speculation_equals_plain_greedy_with_and_without_graphs(artifacts: dict[str, Path]) -> None:
    """On CUDA (resident Triton experts, fla's KDA when installed, whole-step decode graphs): greedy output with
    k = 1, 2, 3 equals plain greedy, with drafts, verify steps and re-runs eager or replayed as CUDA graphs (one
    per token count), for the random MTP layer and for an oracle drafter that is right except at every 5th token."""
    options = RuntimeOptions(device="cuda", dtype="float32", backend="triton")
    engine = Engine.load(open_artifact(artifacts["tr3"]), options, max_batch=1, max_len=64, mtp=True)
    plain = generate(EngineDecoder(engine), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert engine.graphs is not None
    for k in (1, 2, 3):
        for graphs in (False, True):
            spec = generate(
                EngineMtpDecoder(engine, k, graphs=graphs), PROMPT, SamplingParams(max_tokens=TOKENS), decode
            )
            assert spec.token_ids == plain.token_ids, (k, graphs)
            oracle = OracleDecoder(engine, k, plain.token_ids, lambda i: i % 5 == 3)
            oracle.graphs = graphs
            assert generate(oracle, PROMPT, SamplingParams(max_tokens=TOKENS), decode).token_ids == plain.token_ids
    assert engine.graphs.captured > 1  # the decode step's graph, verify, re-run and draft graphs
