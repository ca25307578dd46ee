"""Model-family knowledge: which tensor is what, for every supported GLM architecture, from the config.

module_map (imported on its own: it needs torch) places checkpoint tensors into transformers' modules.
"""

from glmquant.arch.roles import TensorRole
from glmquant.arch.spec import ModelSpec, load_model_spec, read_config
from glmquant.arch.table import (
    DTYPE_BYTES,
    PROJECTIONS,
    ArchitectureTable,
    TensorInfo,
    classify,
    is_moe_layer,
    source_tensors,
    table_for,
)

__all__ = [
    "DTYPE_BYTES",
    "PROJECTIONS",
    "ArchitectureTable",
    "ModelSpec",
    "TensorInfo",
    "TensorRole",
    "classify",
    "is_moe_layer",
    "load_model_spec",
    "read_config",
    "source_tensors",
    "table_for",
]
