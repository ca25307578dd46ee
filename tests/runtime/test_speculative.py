"""MTP speculative decoding: greedy output equals plain greedy token for token (k = 1, 2, 3), accepted drafts and
rollbacks keep the caches right, the MTP layer drafts the same from its incremental cache as from scratch, and
`--speculative-config` is checked where it enters."""

from __future__ import annotations

import copy
import http.client

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from glmquant.arch.hf_glm5_mtp import MtpLayer
from glmquant.errors import UsageError
from glmquant.runtime.generate import Generation, PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import LoadedModel, load_model
from glmquant.runtime.mtp import load_mtp
from glmquant.runtime.mtp_decoder import MtpDecoder
from glmquant.runtime.openai_api import UsageInfo
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.server import serve_in_background
from glmquant.runtime.speculative import SpecStats, SpeculativeConfig

# 12 prompt tokens + 16 generated: past index_topk (8), so the indexer's sparse selection and its cache are rolled back
PROMPT = PromptInputs(torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]))
TOKENS = 16


def decode(ids):
    return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def mtp(tr3_f32: LoadedModel) -> MtpLayer:
    return load_mtp(tr3_f32)


@pytest.fixture(scope="module")
def plain(tr3_f32: LoadedModel) -> Generation:
    return generate(tr3_f32.model, PROMPT, SamplingParams(max_tokens=TOKENS), decode)


class OracleDecoder(MtpDecoder):
    """Drafts the plain greedy continuation, wrong wherever `wrong(generated index)` says: every path of the
    verification (all accepted, some, none) runs, which a random MTP layer (acceptance ~0) never reaches."""

    def __init__(self, loaded: LoadedModel, mtp: MtpLayer, k: int, truth: tuple[int, ...], wrong) -> None:
        super().__init__(loaded.model, mtp, k)
        self.truth, self.wrong = truth, wrong

    def _draft(self, token: int) -> list[int]:
        at = int(self._cache.get_seq_length()) - PROMPT.num_tokens + 1  # generated index of the first draft
        return [
            (self.truth[i] + 1) % 300 if self.wrong(i) else self.truth[i]
            for i in range(at, at + self.k)
            if i < len(self.truth)
        ] or [0]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_speculation_equals_plain_greedy(tr3_f32, mtp, plain, k):
    spec = generate(MtpDecoder(tr3_f32.model, mtp, k), PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text and spec.finish_reason == "length"
    stats = spec.speculative
    assert stats is not None and stats.drafted == k * stats.steps and 0 <= stats.accepted <= stats.drafted
    assert stats.accepted + stats.steps >= TOKENS - 1  # every step yields its accepted drafts plus one token


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accepted_drafts_and_rollbacks_keep_greedy_output(tr3_f32, mtp, plain, k):
    """Drafts right except at every 5th generated token: full and partial acceptances, KV crops and KDA restores."""
    decoder = OracleDecoder(tr3_f32, mtp, k, plain.token_ids, lambda i: i % 5 == 3)
    spec = generate(decoder, PROMPT, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.token_ids == plain.token_ids
    stats = spec.speculative
    assert stats is not None and 0 < stats.accepted < stats.drafted
    assert stats.tokens_per_step > 1.0 and stats.steps < TOKENS - 1
    perfect = generate(
        OracleDecoder(tr3_f32, mtp, k, plain.token_ids, lambda i: False), PROMPT, SamplingParams(TOKENS), decode
    )
    assert perfect.token_ids == plain.token_ids
    assert perfect.speculative is not None and perfect.speculative.tokens_per_step > k  # the last step is cut short


@pytest.mark.slow
def test_eos_stop_strings_and_budget_inside_accepted_drafts(tr3_f32, mtp, plain):
    """Generation ends where plain greedy ends even when the EOS id, the stop string or the budget falls among
    drafts already accepted (the decoder is ahead of the tokens drawn)."""

    def run(params: SamplingParams) -> Generation:
        return generate(OracleDecoder(tr3_f32, mtp, 3, plain.token_ids, lambda i: False), PROMPT, params, decode)

    eos = run(SamplingParams(max_tokens=TOKENS, stop_token_ids=(plain.token_ids[6],)))
    first = plain.token_ids.index(plain.token_ids[6])
    assert eos.finish_reason == "stop" and eos.token_ids == plain.token_ids[:first]
    stop = plain.text[9:11]
    cut = run(SamplingParams(max_tokens=TOKENS, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == plain.text[: plain.text.find(stop)]
    budget = run(SamplingParams(max_tokens=10))
    assert budget.finish_reason == "length" and budget.token_ids == plain.token_ids[:10]
    assert budget.speculative is not None and budget.speculative.steps == 3  # 1 + 4 + 4 + 1 of the last 4


@pytest.mark.slow
def test_rejected_drafts_leave_bf16_output_as_plain(artifacts):
    """BF16: a verify forward over k + 1 tokens rounds differently from one-token steps; after a rejection the next
    token comes from the re-run the cache holds, so with no draft accepted (a random MTP layer) the output is plain
    decoding's bit for bit. This prompt's 13th token flips when taken from the verify forward instead."""
    loaded = load_model(artifacts["tr3"], RuntimeOptions(dtype="bfloat16"))
    prompt = PromptInputs(torch.tensor([[256, 5, 7, 9, 11, 200, 13]]))
    plain = generate(loaded.model, prompt, SamplingParams(max_tokens=TOKENS), decode)
    spec = generate(MtpDecoder(loaded.model, load_mtp(loaded), 1), prompt, SamplingParams(max_tokens=TOKENS), decode)
    assert spec.speculative is not None and spec.speculative.accepted == 0
    assert spec.token_ids == plain.token_ids


@pytest.mark.slow
def test_mtp_drafts_from_its_cache_as_from_scratch(tr3_f32, mtp):
    """Each first draft equals the MTP layer run over the whole sequence at once: its cache holds exactly the
    target's accepted positions (the positions it drafted on were cut), whatever transformers calls the attention's
    cache argument (`past_key_values` before 5.2x: a misnamed one is ignored, and the layer drafts without a cache)."""
    drafts: list[tuple[int, int]] = []  # (sequence position of the fed token, first draft)

    class Recording(MtpDecoder):
        def _draft(self, token: int) -> list[int]:
            out = super()._draft(token)
            assert self._mtp_cache is not None
            # transformers >= 5.25 counts a KDA layer's tokens in a tensor the cache's length is read from: a rollback
            # that left it alone made the target look 3 tokens longer than it was (16 against 13)
            length = int(self._cache.get_seq_length())
            assert int(self._mtp_cache.get_seq_length()) == length, (drafts, self.stats)
            drafts.append((length, out[0]))
            return out

    result = generate(Recording(tr3_f32.model, mtp, 2), PROMPT, SamplingParams(max_tokens=10), decode)
    sequence = torch.tensor([PROMPT.input_ids[0].tolist() + list(result.token_ids)])
    with torch.no_grad():
        hidden = tr3_f32.model.model(input_ids=sequence).last_hidden_state
        logits, _ = mtp(hidden[:, :-1], sequence[:, 1:], mtp.new_cache())
    assert drafts and all(int(logits[0, pos - 1].argmax()) == draft for pos, draft in drafts)


@pytest.mark.slow
def test_sampling_decodes_without_speculation(tr3_f32, mtp):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    spec = generate(MtpDecoder(tr3_f32.model, mtp, 2), PROMPT, params, decode)
    assert spec.speculative is None
    assert spec.token_ids == generate(tr3_f32.model, PROMPT, params, decode).token_ids


def test_speculative_config_is_checked_where_it_enters():
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}') == SpeculativeConfig("mtp", 3)
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad, message in (
        ('{"method": "eagle", "num_speculative_tokens": 1}', "method must be one of mtp"),
        ('{"method": "mtp", "num_speculative_tokens": 4}', r"integer in 1\.\.3"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', r"integer in 1\.\.3"),
        ('{"method": "mtp", "num_speculative_tokens": true}', r"integer in 1\.\.3"),
        ('{"method": "mtp", "num_speculative_tokens": "2"}', r"integer in 1\.\.3"),
        ('{"method": "mtp", "model": "x"}', r"unknown key\(s\) \['model'\]"),
        ("[1]", "must be a JSON object"),
        ("{method: mtp}", "is not JSON"),
    ):
        with pytest.raises(UsageError, match=message):
            SpeculativeConfig.parse(bad)


def test_spec_stats_rates():
    stats = SpecStats(steps=4, drafted=8, accepted=6)
    assert stats.acceptance_rate == 0.75 and stats.tokens_per_step == 2.5
    assert SpecStats().acceptance_rate == 0.0 and SpecStats().tokens_per_step == 0.0


def test_usage_carries_speculation_only_when_it_ran():
    plain = Generation((1, 2), "ab", "length", 5)
    assert UsageInfo.of(plain, 5).model_dump() == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    spec = Generation((1, 2, 3), "abc", "length", 5, speculative=SpecStats(steps=2, drafted=4, accepted=1))
    assert UsageInfo.of(spec, 5).model_dump()["speculative"] == {
        "num_drafts": 2,
        "num_draft_tokens": 4,
        "num_accepted_tokens": 1,
        "acceptance_rate": 0.25,
        "tokens_per_step": 1.5,
    }


def test_speculation_runs_on_either_model_impl():
    for impl in ("transformers", "glmquant"):
        assert RuntimeOptions(model_impl=impl, speculative_config=SpeculativeConfig()).speculative_config is not None


@pytest.mark.slow
def test_server_reports_speculation_in_usage_and_metrics(artifacts):
    """A greedy chat request through a server with --speculative-config (BF16: the MTP layer's fp32 parts kept):
    usage says how many drafts were made and accepted, and /metrics counts the same."""
    config = SpeculativeConfig(num_speculative_tokens=2)
    with serve_in_background(artifacts["tr3"], expert_cache=16, max_model_len=512, speculative_config=config) as srv:
        assert isinstance(srv.service.loaded, LoadedModel) and srv.service.loaded.mtp is not None
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=srv.service.model_name,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c.usage for c in stream if c.usage][0]
        spec = (usage.model_extra or {})["speculative"]
        conn = http.client.HTTPConnection(*srv.address, timeout=30)
        conn.request("GET", "/metrics")
        metrics = {
            s.name: s.value
            for family in text_string_to_metric_families(conn.getresponse().read().decode())
            for s in family.samples
        }
    assert spec["num_draft_tokens"] == 2 * spec["num_drafts"] >= 2
    assert spec["num_accepted_tokens"] + spec["num_drafts"] >= usage.completion_tokens - 1
    assert spec["tokens_per_step"] == pytest.approx(
        (spec["num_accepted_tokens"] + spec["num_drafts"]) / spec["num_drafts"], abs=1e-4
    )
    assert metrics["glmquant:spec_decode_num_drafts_total"] == spec["num_drafts"]
    assert metrics["glmquant:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
    assert metrics["glmquant:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]


def test_mtp_layer_takes_the_targets_own_mla_layer_type(tr3_f32):
    """The MTP layer's one-layer config names its layer as the target's MLA layers (a transformers release whose
    `DynamicCache` lacks "indexed_attention" builds the target's cache, so it builds this one), and the cache
    it makes is that layer's."""
    from transformers import DynamicCache

    from glmquant.arch.hf_glm5_mtp import one_layer_config

    text = copy.deepcopy(tr3_f32.model.config.get_text_config())
    mla = next(t for t in text.layer_types if t != "linear_attention")
    text.layer_types = ["linear_attention" if t != mla else "full_attention" for t in text.layer_types]
    config = one_layer_config(text)
    assert config.layer_types == ["full_attention"] and config.num_hidden_layers == 1
    cache = DynamicCache(config=config)
    assert len(cache.layers) == 1 and type(cache.layers[0]).__name__ == "DynamicLayer"
