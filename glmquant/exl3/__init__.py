"""EXL3 codec: bit-exact decoding and ExLlamaV3 1.6.5's encoder, as pure functions on tensors (with an optional
directory of finished encodes, memo.py, that a repeated encode reads back)."""

from glmquant.exl3.codebooks import Codebook
from glmquant.exl3.decode import decode_inner, decode_weight
from glmquant.exl3.encode import (
    EncodedLinear,
    encode_linear,
    encode_linears,
    proxy_error,
)
from glmquant.exl3.tensor import EXL3Tensor

__all__ = [
    "Codebook",
    "EXL3Tensor",
    "EncodedLinear",
    "decode_inner",
    "decode_weight",
    "encode_linear",
    "encode_linears",
    "proxy_error",
]
