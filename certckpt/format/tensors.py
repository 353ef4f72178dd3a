"""torch-side basics of the format: the safetensors dtype names and zero-copy byte views of tensors.

Shared by the writer, the reader, deep verification, fingerprinting and the auditor's exchange.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["TORCH_TO_ST", "ST_TO_TORCH", "host_bytes"]

# safetensors dtype names; fingerprint v1 covers the dtype by these strings.
_TORCH_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _TORCH_TO_ST[getattr(torch, _name)] = _code
TORCH_TO_ST: dict[torch.dtype, str] = dict(_TORCH_TO_ST)
ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_ST.items()}


def host_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
