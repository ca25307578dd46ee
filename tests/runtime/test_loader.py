"""The runtime's logits equal transformers' on the same dequantized weights, for both layouts.

Tolerances: float32 |diff| <= 1e-5 (measured ~5e-7: only summation order differs); bfloat16 |diff| <= 0.02
on logits of magnitude ~1 (a few bf16 ulps: the rank-stacked sum rounds four partial products).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from glmquant.errors import CheckpointFormatError
from glmquant.runtime.artifact import open_artifact
from glmquant.runtime.loader import load_model
from glmquant.runtime.options import RuntimeOptions

TOLERANCE = {"float32": 1e-5, "bfloat16": 0.02}
PROMPT = torch.tensor([[256, 5, 17, 99, 200, 3, 44, 45, 46, 47, 48, 120, 121, 7, 8, 9, 10, 11, 12, 13]])


@pytest.mark.parametrize("layout", ["tr3", "exllamav3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_transformers_on_dequantized_weights(artifacts, references, layout, dtype):
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(references[layout], dtype=getattr(torch, dtype)).eval()
    runtime = load_model(artifacts[layout], RuntimeOptions(dtype=dtype))
    with torch.no_grad():
        want = ref(input_ids=PROMPT).logits.float()
        got = runtime.model(input_ids=PROMPT).logits.float()
    assert got.shape == want.shape == (1, PROMPT.shape[1], runtime.artifact.spec.vocab_size)
    assert (got - want).abs().max().item() <= TOLERANCE[dtype]
    assert want.std() > 0.05  # the comparison is about real, varied logits
    for name, param in ref.named_parameters():  # every non-expert tensor loaded as transformers loads it
        if ".mlp.experts." not in name:
            assert torch.equal(runtime.model.get_parameter(name), param), name


def test_layout_detection_and_mtp_skipped(artifacts):
    tr3, exl3 = open_artifact(artifacts["tr3"]), open_artifact(artifacts["exllamav3"])
    assert (tr3.layout, tr3.ranks, exl3.layout, exl3.ranks) == ("tr3", 4, "exllamav3", 1)
    assert tr3.quantized_layers == tuple(tr3.spec.moe_layers) == (1, 2)
    mtp = f"model.language_model.layers.{tr3.spec.num_hidden_layers}."
    assert any(n.startswith(mtp) for n in tr3.checkpoint.names())
    assert not any(n.startswith(mtp) or ".mlp.experts." in n for n in tr3.retained_names())
    assert tr3.expert_prefix(2, 4 * 3 + 1, "down_proj") == "model.language_model.layers.2.mlp.experts.3.down_proj.rank1"
    assert tr3.read_expert(1, 5, "gate_proj").in_features == tr3.spec.hidden_size
    assert tr3.read_expert(1, 5, "down_proj").in_features == tr3.spec.moe_intermediate_size // 4


def test_incomplete_artifact_is_refused(artifacts, tmp_path):
    broken = Path(shutil.copytree(artifacts["tr3"], tmp_path / "broken"))
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = "model.language_model.layers.2.mlp.experts.3.up_proj.rank2.trellis"
    del index["weight_map"][victim]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=victim.rsplit(".", 1)[0]):  # the reader names the tensor
        open_artifact(broken)
