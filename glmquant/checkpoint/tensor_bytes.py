"""Tensors to and from the raw little-endian bytes a safetensors file stores, with no dtype conversion."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(tensor: torch.Tensor) -> str:
    """The safetensors dtype name of a tensor (ValueError for dtypes safetensors cannot hold)."""
    try:
        return SAFETENSORS_DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"dtype {tensor.dtype} has no safetensors equivalent") from None


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `data` (no copy when `data` is writable) with the stored dtype and shape."""
    if len(data) == 0:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]).reshape(shape)


def tensor_to_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, as a safetensors file stores them (CPU copy if needed)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data.cast("B")
