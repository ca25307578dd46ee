"""The speed tier end to end on the ONE_MOE model: `encode --retained-bits 4 --retained-exact-layers 1 --head-bits 5`
EXL3-encodes layer 1's retained linears and lm_head with their dense Hessians (layer 0's stay exact), writes exactly
what `plan` predicts, verifies, encodes the same bytes again, and the runtime (the torch reference path and the Triton
kernels, interpreted on a CPU) generates from it close to the artifact whose retained linears and head are exact.
`--head-bits` alone: test_head_bits.py; every retained linear at K4: the smoke fidelity bench's retained-k4-head5."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from encode_fixtures import QUIET, assert_verify_manifest_cli
from indexer_ties import indexer_ties_to_earlier_pool

from glmquant.arch import ModelSpec, TensorRole, load_model_spec, source_tensors
from glmquant.checkpoint.layouts import ArtifactPlan, plan_artifact, quantizable_retained
from glmquant.checkpoint.manifest import MANIFEST_NAME, manifest_text
from glmquant.checkpoint.reader import SourceCheckpoint
from glmquant.checkpoint.verify import verify_artifact
from glmquant.checkpoint.verify_report import MAX_SHOWN
from glmquant.encode import EncodeConfig, encode_artifact
from glmquant.encode.retained import dense_hessian, encode_retained_file, retained_linears
from glmquant.encode.run import EncodeResult
from glmquant.errors import UsageError
from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import LoadedModel, load_model
from glmquant.runtime.options import RuntimeOptions
from glmquant.runtime.retained_linears import Exl3Linear

pytestmark = [
    pytest.mark.slow,  # two encodes of the ONE_MOE model with K4 retained linears: minutes on two CPU cores
    pytest.mark.xdist_group("speed-tier"),  # under pytest-xdist (`make test`) one worker encodes `speed_tier` once
]

K = 4
EXACT = 1  # layer 0's retained linears stay exact: both kinds of retained linear in one model
HEAD_K = 5  # another K than the retained linears': each linear is encoded, stored and checked at its own
HEAD = "lm_head.weight"
PROMPT = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]])


@pytest.fixture(scope="module")
def speed_tier(
    one_moe_source: Path, one_moe_dense_observations: Path, tmp_path_factory: pytest.TempPathFactory
) -> EncodeResult:
    out = tmp_path_factory.mktemp("speed-tier") / "art"
    cfg = EncodeConfig(
        source=one_moe_source,
        out=out,
        observations=one_moe_dense_observations,
        retained_bits=K,
        retained_exact_layers=EXACT,
        head_bits=HEAD_K,
        verified_at="2026-01-01T00:00:00Z",
    )
    result = encode_artifact(cfg, QUIET)
    assert result is not None
    return result


def _encoded(spec: ModelSpec) -> set[str]:
    """The retained linears the fixture stores as EXL3: those after the first EXACT layers."""
    return {t.name for t in quantizable_retained(spec) if t.layer is not None and t.layer >= EXACT}


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with SourceCheckpoint.open(path) as ckpt:
        return {n: (ckpt.spec(n).dtype, tuple(ckpt.spec(n).shape)) for n in ckpt.names()}


def _plan(source_dir: Path, retained_bits: int | None, head_bits: int | None = None, exact: int = 0) -> ArtifactPlan:
    """The tr3 K2 plan of a source, over its own sharding."""
    with SourceCheckpoint.open(source_dir) as source:
        shards = {n: source.shard_of(n) for n in source.names()}
    spec = load_model_spec(source_dir)
    return plan_artifact(
        spec, "tr3", 2, "mcg", shards, retained_bits=retained_bits, head_bits=head_bits, retained_exact_layers=exact
    )


def test_written_artifact_is_the_plan(one_moe_source: Path, speed_tier: EncodeResult) -> None:
    art = speed_tier.artifact.directory
    spec = load_model_spec(one_moe_source)
    plan = _plan(one_moe_source, retained_bits=K, head_bits=HEAD_K, exact=EXACT)
    weight_files = sorted(p.name for p in art.glob("*.safetensors"))
    assert weight_files == sorted(f.path for f in plan.files)
    for f in plan.files:
        assert (art / f.path).stat().st_size == f.size, f.path
        with SourceCheckpoint.open(art / f.path) as ckpt:
            assert {n: (ckpt.spec(n).dtype, tuple(ckpt.spec(n).shape)) for n in ckpt.names()} == {
                t.name: (t.dtype, t.shape) for t in f.tensors
            }
    linears = _encoded(spec)
    stored = _headers(art)
    assert not (linears | {HEAD}) & set(stored)  # no exact copy of an encoded linear is left
    layer0 = {t.name for t in quantizable_retained(spec)} - linears
    assert layer0 and all(".layers.0." in n and stored[n][0] == "BF16" for n in layer0)  # kept exact, below
    assert all(stored[n.removesuffix(".weight") + ".trellis"][1][-1] == 16 * K for n in linears)
    assert stored["lm_head.trellis"] == ("I16", (128 // 16, 384 // 16, 16 * HEAD_K))  # 128 -> 320, padded to 384
    # everything else retained is the source's bytes: norms, routers and their biases, embeddings, F32 tensors
    with SourceCheckpoint.open(one_moe_source) as source, SourceCheckpoint.open(art) as ckpt:
        exact = [t for t in source_tensors(spec) if t.role.value != "routed_expert" and t.name not in linears | {HEAD}]
        assert {t.dtype for t in exact} >= {"BF16", "F32"}
        for t in exact:
            assert torch.equal(ckpt.read_tensor(t.name), source.read_tensor(t.name)), t.name
    manifest = json.loads((art / "EXL3_MANIFEST.json").read_text())
    layout = manifest["layout"]
    facts = (layout["retained_bits"], layout["retained_exact_layers"], layout["head_bits"])
    assert facts + (manifest["effective_routed_tier_bpw"],) == (K, EXACT, HEAD_K, 2.0)
    block = json.loads((art / "config.json").read_text())["quantization_config"]
    assert (block["retained_bits"], block["retained_exact_layers"], block["head_bits"], block["bits"]) == (
        K,
        EXACT,
        HEAD_K,
        2,
    )
    counts = [e.get("exl3_linear_count", 0) for e in manifest["files"] if e["kind"] == "retained"]
    assert sum(counts) == len(linears) + 1


def test_verify_manifest_passes(speed_tier: EncodeResult) -> None:
    assert_verify_manifest_cli(speed_tier)


def test_verify_catches_exact_layers_the_manifest_does_not_state(speed_tier: EncodeResult, tmp_path: Path) -> None:
    """A manifest whose layout drops `retained_exact_layers` calls for EXL3 tensors of layer 0's linears, which the
    files hold exact: verify-manifest names them missing, and the config's block stating the key the manifest lacks."""
    copy = shutil.copytree(speed_tier.artifact.directory, tmp_path / "copy")
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    del manifest["layout"]["retained_exact_layers"]
    (copy / MANIFEST_NAME).write_text(manifest_text(manifest))
    report = verify_artifact(copy, fast=True)
    spec = load_model_spec(copy)
    layer0 = len(quantizable_retained(spec)) - len(_encoded(spec))
    # every part (trellis, suh, svh, mcg) of each of layer 0's linears, and the block's extra key
    detail = next(c.detail for c in report.checks if c.name == "config geometry")
    assert report.failed == ["config geometry"] and f"(+{4 * layer0 + 1 - MAX_SHOWN} more)" in detail
    assert "model.language_model.layers.0.mlp.down_proj.mcg: expected by the config, missing from the files" in detail


@pytest.mark.fresh_encodes
def test_retained_linears_encode_to_the_same_bytes_again(
    one_moe_source: Path, one_moe_dense_observations: Path, speed_tier: EncodeResult
) -> None:
    """Encoding a file's retained linears (or its head) again (alone, in another call) gives the bytes already on
    disk."""
    art = speed_tier.artifact.directory
    plan = _plan(one_moe_source, retained_bits=K, head_bits=HEAD_K, exact=EXACT)
    with SourceCheckpoint.open(one_moe_source) as source, SourceCheckpoint.open(art) as ckpt:
        encoded = sorted((f for f in plan.files if retained_linears(f)), key=lambda f: len(retained_linears(f)))
        head = next(f for f in encoded if any(lin.source == HEAD for lin in retained_linears(f)))
        files = [next(f for f in encoded if f is not head), head]  # the smallest other file, and the head's
        roles = set()
        for f in files:
            again = encode_retained_file(f, source, one_moe_dense_observations, False, "mcg", 0, "cpu")
            assert again.tensors and all(r.fallback is None for r in again.reports)
            for name, tensor in again.tensors.items():
                assert torch.equal(tensor, ckpt.read_tensor(name)), name
            roles |= {t.role for t in f.tensors if t.linear is not None}
        assert len(roles) > 1 and TensorRole.LM_HEAD in roles


def test_exllamav3_layout_holds_the_same_retained_linears(
    one_moe_source: Path, one_moe_dense_observations: Path, speed_tier: EncodeResult, tmp_path: Path
) -> None:
    """The ExLlamaV3 layout with --retained-bits and --head-bits: the module files hold the same EXL3 retained
    linears and head, byte for byte, as the tr3 artifact's retained files (here in one file, one encode call per K);
    `tensor_storage` lists each as an `exl3` module with its K, the block's head_bits is the head's; it verifies and
    the runtime serves it."""
    cfg = EncodeConfig(
        source=one_moe_source,
        out=tmp_path / "art",
        observations=one_moe_dense_observations,
        layout="exllamav3",
        retained_bits=K,
        retained_exact_layers=EXACT,
        head_bits=HEAD_K,
    )
    result = encode_artifact(cfg, QUIET)
    assert result is not None and result.verification is not None and result.verification.ok
    tr3 = speed_tier.artifact.directory
    with SourceCheckpoint.open(tr3) as a, SourceCheckpoint.open(result.artifact.directory) as x:
        linears = [n for n in a.names() if n.endswith((".trellis", ".suh", ".svh", ".mcg")) and ".experts." not in n]
        assert len(linears) == 4 * (len(_encoded(load_model_spec(one_moe_source))) + 1)
        for name in linears:
            assert torch.equal(a.read_tensor(name), x.read_tensor(name)), name
    qc = json.loads((result.artifact.directory / "quantization_config.json").read_text())
    storage = qc["tensor_storage"]
    q = storage["model.language_model.layers.1.self_attn.q_a_proj"]
    assert q["quant_format"] == "exl3" and q["bits_per_weight"] == K
    exact_q = storage["model.language_model.layers.0.self_attn.q_proj"]  # an exact linear ExLlamaV3 loads as it is
    assert "quant_format" not in exact_q and list(exact_q["stored_tensors"]) == [
        "model.language_model.layers.0.self_attn.q_proj.weight"
    ]
    assert storage["lm_head"]["quant_format"] == "exl3" and storage["lm_head"]["bits_per_weight"] == HEAD_K
    assert qc["head_bits"] == HEAD_K
    loaded = load_model(result.artifact.directory, RuntimeOptions(dtype="float32"))
    assert loaded.artifact.layout == "exllamav3"
    assert sum(isinstance(m, Exl3Linear) for m in loaded.model.modules()) == len(linears) // 4
    assert (
        len(generate(loaded.model, PromptInputs(PROMPT), SamplingParams(max_tokens=2), lambda ids: "").token_ids) == 2
    )


def test_a_missing_dense_hessian_is_refused_naming_the_tensor(
    small_source: Path, small_observations: Path, tmp_path: Path
) -> None:
    """Observations without --dense-hessians: refused before anything is written, unless the fallback is asked."""
    out = tmp_path / "art"
    cfg = EncodeConfig(source=small_source, out=out, observations=small_observations, retained_bits=K)
    with pytest.raises(UsageError, match=r"layers\.0\.self_attn\.q_proj\.weight needs its dense Hessian"):
        encode_artifact(cfg, QUIET)
    assert not out.exists() and not (tmp_path / "art.work").exists()
    linear = next(lin for f in _plan(small_source, retained_bits=K).files for lin in retained_linears(f))
    assert dense_hessian(small_observations, linear, True) == (None, "no_dense_hessian:identity")


def _logits(loaded: LoadedModel, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(input_ids=ids.to(next(loaded.model.parameters()).device)).logits[0].float()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q)."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_runtime_generates_close_to_the_exact_retained_model(one_moe_source: Path, speed_tier: EncodeResult) -> None:
    """The torch reference path runs every EXL3 retained linear and the head, and generates; the KL its logits take
    from the same artifact with exact retained linears and head is of the order of the KL that one takes from the BF16
    source: the K4 retained linears and K5 head cost about what the K2 routed experts do, on the same prompt."""
    from transformers import Glm5NextForConditionalGeneration

    art = speed_tier.artifact.directory
    options = RuntimeOptions(dtype="float32")
    fast = load_model(art, options)
    modules = [m for m in fast.model.modules() if isinstance(m, Exl3Linear)]
    assert {m.source for m in modules} == _encoded(fast.artifact.spec) | {HEAD}
    assert all(m.mode == "decode" and m.bits == (HEAD_K if m.source == HEAD else K) for m in modules)
    assert fast.model.get_submodule("lm_head").source == HEAD
    result = generate(fast.model, PromptInputs(PROMPT), SamplingParams(max_tokens=6), lambda ids: "")
    assert len(result.token_ids) == 6
    fast_logits = _logits(fast)
    exact = load_model(art, options)  # the same artifact, its EXL3 linears given their exact source weights back
    with SourceCheckpoint.open(one_moe_source) as source:
        for m in exact.model.modules():
            if isinstance(m, Exl3Linear):
                m.weight = source.read_tensor(m.source).float()
    exact_logits = _logits(exact)
    reference = Glm5NextForConditionalGeneration.from_pretrained(str(one_moe_source), dtype=torch.float32).eval()
    with torch.no_grad():
        source_logits = reference(input_ids=PROMPT).logits[0].float()
    retained_cost, routed_cost = _kl(exact_logits, fast_logits), _kl(source_logits, exact_logits)
    # the same order as the routed tier's, not strictly below it: on ONE_MOE with the CPU's Viterbi paths the two are
    # 0.00026 and 0.0034 (measured); on the three-layer SMALL model with the CUDA Viterbi's paths they were 0.00656 and
    # 0.00647 on an H200 (a broken linear costs orders of magnitude more)
    assert 0 < retained_cost < 2 * routed_cost, (retained_cost, routed_cost)
    agree = (exact_logits[1:].argmax(-1) == fast_logits[1:].argmax(-1)).float().mean()
    source_agree = (source_logits[1:].argmax(-1) == exact_logits[1:].argmax(-1)).float().mean()
    assert agree >= source_agree - 1 / len(PROMPT[0])  # within one position of the routed tier's own agreement


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_run_the_retained_linears_like_the_reference(speed_tier: EncodeResult) -> None:
    """With a Triton backend every EXL3 retained linear of more than `dense_linear_max_weights` weights runs through
    `exl3_linear` (interpreted on a CPU), the others decoded once: the logits of a prompt (the multi-row path) and of
    a one-token input (the one-row path decoding takes) match the torch path's to the fp16 rounding of its decode,
    with the same greedy tokens."""
    art = speed_tier.artifact.directory
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = load_model(art, RuntimeOptions(device=device, dtype="float32"))
    bound = 32 * 128  # KDA's f_a and g_a (32 x 128), b and f_b, g_b decoded; q, k, v, o and the MLPs on the kernels
    options = RuntimeOptions(device=device, dtype="float32", backend="triton-eager", dense_linear_max_weights=bound)
    kernels = load_model(art, options)
    modules = [m for m in kernels.model.modules() if isinstance(m, Exl3Linear)]
    on_kernels = [m for m in modules if m.mode == "kernel"]
    assert on_kernels and all(m.weight.numel() == 0 for m in on_kernels)
    decoded = [m for m in modules if m.mode == "decode"]
    assert decoded and all(m.weight.numel() <= bound for m in decoded)
    for ids in (PROMPT, PROMPT[:, 1:2]):
        want, got = _logits(reference, ids).cpu(), _logits(kernels, ids).cpu()
        assert float((got - want).norm() / want.norm()) < 4e-3  # ONE_MOE on a CPU: 9.0e-4, 1.2e-3 (SMALL, H200: 2.0e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_glmquant_engine_runs_the_speed_tier_like_transformers(speed_tier: EncodeResult) -> None:
    """`--model-impl glmquant` decodes the EXL3 retained linears and head once at load, as the torch reference path
    does: every logit of the prompt and of eight decode steps to float32 rounding, the same greedy tokens.

    The DSA indexer's pool scores are sums of ReLU'd products, so pools tie at exactly 0 on these random models (on
    the three-layer SMALL model: three pools at 0.0 for two slots at context 16 with transformers 5.17, measured).
    `torch.topk` leaves ties in an unspecified order and the engine takes the earlier pool
    (`glm5_next_math.top_indices`), so the reference's indexer selection gets the same rule here (`indexer_ties.py`):
    without it the logits part at the first tied step (on SMALL: the fifth with transformers 5.24, the fourth with
    5.17)."""
    from glmquant.runtime.artifact import open_artifact
    from glmquant.runtime.engine import Engine, EngineDecoder

    options = RuntimeOptions(dtype="float32")
    artifact = open_artifact(speed_tier.artifact.directory)
    assert artifact.retained_linears and "lm_head" in artifact.retained_linears
    reference = load_model(artifact, options).model
    seen: list[torch.Tensor] = []
    hook = reference.get_submodule("lm_head").register_forward_hook(lambda m, a, out: seen.append(out[0, -1].clone()))
    params = SamplingParams(max_tokens=9)
    try:
        with indexer_ties_to_earlier_pool():
            expected = generate(reference, PromptInputs(PROMPT), params, lambda ids: "").token_ids
    finally:
        hook.remove()
    logits: list[torch.Tensor] = []

    class Recording(EngineDecoder):
        def prefill(self, prompt: PromptInputs) -> torch.Tensor:
            logits.append(super().prefill(prompt).clone())
            return logits[-1]

        def step(self, token: int) -> torch.Tensor:
            logits.append(super().step(token).clone())
            return logits[-1]

    engine = Engine.load(artifact, options, max_batch=1, max_len=64)
    tokens = generate(Recording(engine), PromptInputs(PROMPT), params, lambda ids: "").token_ids
    diffs = [float((ours - theirs).abs().max()) for ours, theirs in zip(logits, seen, strict=True)]
    assert max(diffs) < 1e-5, diffs
    assert tokens == expected
