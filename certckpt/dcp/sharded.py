"""Sharding-independent fingerprints of a live state (DTensor shards on every rank), collectively.

Each rank computes the contribution of the part of every tensor it holds (a DTensor's local shard at
its global offsets; a plain tensor as a whole copy), the ranks exchange them (``statecheck``), and
replicas are counted once. The result equals the fingerprints a ``CertifiedWriter`` manifest records
for the same values, and ``certckpt.fingerprint`` of each full tensor, whatever the sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from certckpt.errors import ArgumentTypeError
from certckpt.format.sharded.composition import state_fp
from certckpt.format.sharded.regions import compose_tensors, local_regions

from .statecheck import exchange

__all__ = ["StateFingerprints", "state_fingerprints"]


@dataclass(frozen=True, slots=True)
class StateFingerprints:
    """Fingerprints of a state, the same on every rank.

    Attributes:
        tensors: ``{fqn: fingerprint hex}`` under DCP's flattened names (``model.0.weight``).
        state_fp: the whole-state fingerprint over them.
        disagreements: tensors of which two ranks hold the same region with different values
            (replicas that diverged); their fingerprint uses the lowest such rank's values.
    """

    tensors: dict[str, str]
    state_fp: str
    disagreements: tuple[str, ...] = ()


def state_fingerprints(state_dict: dict[str, Any], *, process_group: Any = None) -> StateFingerprints:
    """The sharding-independent fingerprints of ``state_dict`` (collective over ``process_group``).

    Args:
        state_dict: what ``dcp.save`` would take (nested dicts of tensors and DTensors).
        process_group: the group whose ranks together hold the state (default: the default group
            when one is initialized, else this process alone). Every rank must call.

    Raises:
        ConfigurationError: the ranks' pieces of a tensor do not cover it exactly.

    Example:
        >>> fps = state_fingerprints({"model": model.state_dict()})
        >>> fps.tensors["model.0.weight"]
    """
    if not isinstance(state_dict, dict):
        raise ArgumentTypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    mine, meta = local_regions(state_dict)
    group = process_group
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.group.WORLD
    everyone = exchange({"regions": mine}, group)
    boxes: dict[str, dict[tuple, str]] = {}
    split = set()
    for p in everyone:
        for fqn, offsets, sizes, raw in p["regions"]:
            held = boxes.setdefault(fqn, {}).setdefault((tuple(offsets), tuple(sizes)), raw)
            if held != raw:
                split.add(fqn)
    fps = compose_tensors(boxes, meta, advice="call state_fingerprints on every rank of the mesh that holds it")
    return StateFingerprints(tensors=fps, state_fp=state_fp(fps), disagreements=tuple(sorted(split)))
