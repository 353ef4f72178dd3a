"""The few DeepSpeed classes a ZeRO checkpoint holds, allowed by name (``certckpt.register_type``).

A ZeRO optimizer's ``state_dict()`` carries its loss scaler object and the ZeRO stage as an enum; a
ZeRO-1/2 one also its parameters' fragment addresses (a dataclass). Everything else in DeepSpeed's
checkpoint dicts is tensors, numbers, strings, lists and dicts. Registering these classes lets
``certckpt.load`` rebuild them from plain data (an enum by value, a dataclass field by field, a loss
scaler from its attribute dict) without unpickling anything; a class not listed here is refused at
save time with its name.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from certckpt.format.registry import register_type

__all__ = ["register_deepspeed_types"]

_PLAIN = (bool, int, float, str, type(None))
_DTYPES = "__dtypes__"  # the encoded attributes that were torch dtypes


def _encode_scaler(scaler: Any) -> dict[str, Any]:
    """A loss scaler's attributes: numbers, booleans and small dicts of them (checked: a scaler that
    grew an attribute of another kind is refused at save time rather than stored half)."""
    attrs = dict(vars(scaler))
    dtypes = sorted(k for k, v in attrs.items() if isinstance(v, torch.dtype))
    for key in dtypes:  # a dtype travels as its name ("float16")
        attrs[key] = str(attrs[key]).removeprefix("torch.")
    if dtypes:
        attrs[_DTYPES] = dtypes
    for key, value in attrs.items():
        ok = isinstance(value, _PLAIN) or (
            isinstance(value, dict) and all(isinstance(v, _PLAIN) for v in value.values())
        )
        if not ok and key != _DTYPES:
            what = type(value).__name__
            raise TypeError(f"{type(scaler).__name__}.{key} is a {what}: not storable as plain data")
    return attrs


def _decoder(cls: type) -> Any:
    def decode(attrs: Any) -> Any:
        if not isinstance(attrs, dict) or not all(isinstance(k, str) for k in attrs):
            raise TypeError(f"{cls.__name__}: expected a dict of attributes, found {type(attrs).__name__}")
        attrs = dict(attrs)
        for key in attrs.pop(_DTYPES, []):
            dtype = getattr(torch, str(attrs.get(key)), None)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"{cls.__name__}.{key}: {attrs.get(key)!r} is not a torch dtype")
            attrs[key] = dtype
        # Rebuilt without __init__ (its arguments are not what it stores), as copy.copy does.
        obj: Any = object.__new__(cls)
        obj.__dict__.update(attrs)
        return obj

    return decode


def register_deepspeed_types() -> None:
    """Allow the DeepSpeed classes of a ZeRO checkpoint (idempotent)."""
    register_type(ZeroStageEnum, name="deepspeed.ZeroStageEnum")
    register_type(fragment_address, name="deepspeed.fragment_address")
    for cls in (LossScaler, DynamicLossScaler):
        register_type(cls, name=f"deepspeed.{cls.__name__}", encode=_encode_scaler, decode=_decoder(cls))
