"""The runtime on a CUDA device (torch backend): same logits as on the CPU, seeded generation repeatable."""

from __future__ import annotations

import pytest
import torch

from glmquant.runtime.generate import PromptInputs, SamplingParams, generate
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = torch.tensor([[256, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130]])


def test_cuda_logits_match_cpu(artifacts, tr3_f32):
    cuda = load_model(artifacts["tr3"], RuntimeOptions(device="cuda", dtype="float32"))
    assert next(cuda.model.parameters()).is_cuda
    with torch.no_grad():
        want = tr3_f32.model(input_ids=PROMPT).logits
        got = cuda.model(input_ids=PROMPT.cuda()).logits.cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)  # float32 on both; cuBLAS vs MKL summation order


def test_cuda_bf16_generation_is_seeded(artifacts):
    cuda = load_model(artifacts["exllamav3"], RuntimeOptions(device="cuda", dtype="bfloat16"))
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=11)
    runs = [generate(cuda.model, PromptInputs(PROMPT), params, lambda ids: str(list(ids))) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].completion_tokens == 12
    assert cuda.backend.stats().hits > 0
