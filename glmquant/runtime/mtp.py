"""The artifact's MTP layer loaded for MTP speculative decoding (`runtime.speculative`): `arch.hf_glm5_mtp.MtpLayer`
filled from the artifact (its weights are retained, BF16, experts included), sharing the target's embedding and
lm_head (an EXL3 head, `encode --head-bits`, is that same module), or from a draft file's EXL3 copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from glmquant.arch import ModelSpec, table_for
from glmquant.arch.hf_glm5_mtp import MtpLayer
from glmquant.arch.module_map import TensorSource, fp32_names, layer_plan, read_layer_state
from glmquant.checkpoint.draft_head import DraftMtpTensors, read_draft_head, read_draft_mtp
from glmquant.errors import ConfigError
from glmquant.exl3.decode import decode_weight
from glmquant.runtime.loader import retained_linear_mode
from glmquant.runtime.retained_linears import Exl3Linear

if TYPE_CHECKING:
    from glmquant.runtime.loader import LoadedModel


class DecodedCopies:
    """A checkpoint whose tensors named in `decoded` read as those instead (a `module_map.TensorSource`): the MTP
    layer filled from a draft file's copy, decoded, and the artifact's other tensors."""

    def __init__(self, base: TensorSource, decoded: dict[str, torch.Tensor]) -> None:
        self.base, self.decoded = base, decoded

    @property
    def directory(self) -> Path:
        return self.base.directory

    def __contains__(self, name: str) -> bool:
        return name in self.decoded or name in self.base

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.decoded[name] if name in self.decoded else self.base.read_tensor(name)

    def shard_of(self, name: str) -> str:
        return self.base.shard_of(name)

    @classmethod
    def of(cls, base: TensorSource, mtp_copy: DraftMtpTensors, spec: ModelSpec, dtype: torch.dtype) -> DecodedCopies:
        """`base` with `mtp_copy`'s linears and routed experts decoded to `dtype` under their weights' names."""
        table = table_for(spec)
        decoded = {f"{key}.weight": decode_weight(t, dtype) for key, t in mtp_copy.linears.items()}
        for e, projections in enumerate(mtp_copy.experts):
            for proj, t in projections.items():
                decoded[table.expert_name(mtp_copy.layer, e, proj)] = decode_weight(t, dtype)
        return cls(base, decoded)


def load_mtp(loaded: LoadedModel) -> MtpLayer:
    """The artifact's MTP layer on the loaded model's device and dtype, sharing its embedding and lm_head (or
    reading the speculative config's `draft_head`, run as the retained EXL3 linears are)."""
    artifact, model = loaded.artifact, cast(Any, loaded.model)
    spec = artifact.spec
    if not spec.mtp_layers:
        raise ConfigError(f"{artifact.path}: the model has no MTP layer (num_nextn_predict_layers is 0)")
    device, dtype = loaded.device, loaded.options.torch_dtype
    head, speculative = model.lm_head, loaded.options.speculative_config
    draft_head = speculative.draft_head if speculative is not None else None
    if draft_head is not None:
        tensor = read_draft_head(draft_head, spec.hidden_size, spec.vocab_size, device)
        head = Exl3Linear(tensor, retained_linear_mode(loaded.options.backend), dtype, source=str(draft_head))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            mtp = MtpLayer(model.config.get_text_config(), model.get_input_embeddings(), head)
    finally:
        torch.set_default_dtype(previous)
    mtp.config._attn_implementation = model.config.get_text_config()._attn_implementation
    keep_fp32 = (
        fp32_names(getattr(model, "_keep_in_fp32_modules_strict", None))
        if dtype in (torch.float16, torch.bfloat16)
        else None
    )
    layer = spec.mtp_layers[0]
    plan = layer_plan(spec, layer, spec.moe_intermediate_size)
    source: TensorSource = artifact.checkpoint
    mtp_copy = None if draft_head is None else read_draft_mtp(draft_head, spec, "cpu")
    if mtp_copy is not None:  # the drafts read the copy, decoded (as the torch backend runs EXL3 linears)
        source = DecodedCopies.of(artifact.checkpoint, mtp_copy, spec, dtype)
    state = read_layer_state(source, plan, mtp.state_dict(), keep_fp32, device)
    mtp.load_state_dict(state, assign=True)
    missing = [n for n, p in mtp.named_parameters() if p.is_meta]
    if missing:
        prefix = table_for(spec).layer_prefix(layer)
        raise ConfigError(f"{artifact.path}: MTP layer {prefix} leaves {missing[:3]} unfilled")
    return mtp.eval()
