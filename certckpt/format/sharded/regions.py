"""The pieces of a live, possibly sharded state that one rank holds, as fingerprint contributions.

Shared by ``certckpt.dcp.state_fingerprints`` (the state's fingerprints, computed collectively) and
the sharded weight consensus of ``certckpt.detect``: both walk a nested state the way DCP flattens
it, take each piece's contribution (a DTensor's local shard at its global offsets, a plain tensor
as a whole copy; ``shardfp``) and, once the ranks have exchanged their pieces, compose the tensors'
fingerprints from regions that tile them (``composition``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from certckpt.errors import ArgumentTypeError, ConfigurationError
from certckpt.format.header import printable
from certckpt.format.tensors import TORCH_TO_ST

from .composition import compose, hex64, is_partition
from .shardfp import tensor_contribution

__all__ = ["local_regions", "compose_tensors", "Region"]

Region = list[Any]  # [fqn, offsets, sizes, contribution hex]: JSON as it travels between ranks


def local_regions(state: Mapping[str, Any]) -> tuple[list[Region], dict[str, tuple[str, tuple[int, ...]]]]:
    """This rank's pieces of ``state`` under DCP's flattened names, and ``{fqn: (dtype code, global shape)}``.

    Non-tensor values are skipped; an empty local shard is a region of no volume (contribution 0).

    Raises:
        ArgumentTypeError: a dtype without a fingerprint, or a DTensor with a Partial placement.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(dict(state))
    regions: list[Region] = []
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fqn, v in flat.items():
        if not isinstance(v, torch.Tensor):
            continue
        code = TORCH_TO_ST.get(v.dtype)
        if code is None:
            raise ArgumentTypeError(f"`{printable(fqn)}`: dtype {v.dtype} has no fingerprint (safetensors lacks it)")
        shape = tuple(v.shape)
        meta[fqn] = (code, shape)
        if isinstance(v, DTensor):
            if any(p.is_partial() for p in v.placements):
                raise ArgumentTypeError(
                    f"`{printable(fqn)}` is a DTensor with a Partial placement (unreduced values); redistribute it"
                    " to Replicate or Shard first"
                )
            local = v.to_local()
            for chunk in v.__create_chunk_list__():  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                raw = tensor_contribution(local, offsets=offsets, global_shape=shape) if local.numel() else 0
                regions.append([fqn, list(offsets), list(sizes), hex64(raw)])
        else:
            raw = tensor_contribution(v.detach(), offsets=(0,) * len(shape), global_shape=shape)
            regions.append([fqn, [0] * len(shape), list(shape), hex64(raw)])
    return regions, meta


def compose_tensors(
    chosen: Mapping[str, Mapping[tuple[tuple[int, ...], tuple[int, ...]], str]],
    meta: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    advice: str,
) -> dict[str, str]:
    """``{fqn: fingerprint hex}`` from one contribution per region (``{fqn: {(offsets, sizes): hex}}``).

    Raises:
        ConfigurationError: a tensor's regions do not tile it exactly once (``advice`` says what to do).
    """
    out = {}
    for fqn, (code, shape) in meta.items():
        boxes = chosen.get(fqn, {})
        if not is_partition(list(boxes), shape):
            raise ConfigurationError(f"`{printable(fqn)}`: the ranks' pieces do not cover it exactly once; {advice}")
        out[fqn] = hex64(compose(_ints(boxes.values()), code, shape))
    return out


def _ints(values: Iterable[str]) -> Iterable[int]:
    return (int(v, 16) for v in values)
