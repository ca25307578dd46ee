"""The encode stage: BF16 source + observations -> EXL3 artifact."""

from glmquant.encode.config import EncodeConfig
from glmquant.encode.run import EncodeResult, encode_artifact

__all__ = ["EncodeConfig", "EncodeResult", "encode_artifact"]
