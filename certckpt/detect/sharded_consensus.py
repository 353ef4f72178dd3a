"""The sharded weight consensus, decided: which holders of each region agree, and the fingerprints.

Every rank all-gathers its pieces of the state (``certckpt.format.sharded.regions.local_regions``:
``[fqn, offsets, sizes, contribution]``); ``decide_consensus`` turns everyone's lists into the same
``ShardConsensus`` on every rank (a pure function: no torch, no communication). Ranks holding the same
region (the replicas of a shard along an HSDP mesh's replicate dimension, or every rank for a
replicated tensor) must have produced the same contribution: a strict majority outvotes the others,
who are named; a tie (two replicas that disagree) names both holders as candidates and nobody as
suspect. The agreed contributions compose the full-tensor fingerprints (``certckpt.fingerprint`` of
``full_tensor()``) and the whole-state fingerprint of ``docs/format.md``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.format.sharded.composition import state_fp
from certckpt.format.sharded.regions import compose_tensors

__all__ = ["ShardConsensus", "decide_consensus", "vote"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConsensus:
    """The outcome of one weight consensus (the same on every rank).

    Attributes:
        step: the optimizer step the weights follow.
        agreed: every region's holders produced the same contribution.
        tensors: ``{fqn: fingerprint hex}`` of the full tensors, composed from the agreed (or, for a
            disputed region without a majority, the lowest rank's) contributions.
        state_fp: the whole-state fingerprint over ``tensors`` (``certckpt.dcp``'s manifest rule).
        disputed: per disputed region ``"fqn@offsets"``, each holder's contribution by rank.
        suspect_ranks: ranks outvoted by a majority of their region's holders.
        candidates: holders of a disputed region that no majority decides (a tie, as with 2 replicas).
    """

    step: int
    agreed: bool
    tensors: dict[str, str]
    state_fp: str
    disputed: dict[str, dict[int, str]] = field(default_factory=dict)
    suspect_ranks: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()


def vote(values: Mapping[int, str]) -> tuple[str | None, list[int]]:
    """``(majority value or None on a tie, ranks outvoted)`` among one region's holders."""
    counts = Counter(values.values()).most_common()
    if len(counts) == 1:
        return counts[0][0], []
    top, n = counts[0]
    if counts[1][1] == n:
        return None, []
    return top, sorted(r for r, v in values.items() if v != top)


def decide_consensus(
    step: int, per_rank: Sequence[Sequence[Sequence[Any]]], meta: Mapping[str, tuple[str, tuple[int, ...]]]
) -> tuple[ShardConsensus, dict[str, int]]:
    """The consensus from every rank's regions (rank order), and the counts its event reports.

    Raises:
        ConfigurationError: the pieces of a tensor do not tile it exactly once (a rank left out).
    """
    regions: dict[tuple[str, tuple, tuple], dict[int, str]] = {}
    for r, mine in enumerate(per_rank):
        for fqn, offsets, sizes, raw in mine:
            regions.setdefault((fqn, tuple(offsets), tuple(sizes)), {})[r] = raw
    disputed: dict[str, dict[int, str]] = {}
    suspects: set[int] = set()
    candidates: set[int] = set()
    chosen: dict[str, dict[tuple, str]] = {}
    for (fqn, offsets, sizes), values in regions.items():
        top, outvoted = vote(values)
        if top is None or outvoted:
            disputed[f"{fqn}@{','.join(map(str, offsets))}"] = dict(sorted(values.items()))
            suspects.update(outvoted)
            if top is None:
                candidates.update(values)
        chosen.setdefault(fqn, {})[(offsets, sizes)] = top if top is not None else values[min(values)]
    fps = compose_tensors(chosen, meta, advice="every rank of the mesh must take part in the consensus")
    result = ShardConsensus(
        step=step,
        agreed=not disputed,
        tensors=fps,
        state_fp=state_fp(fps),
        disputed=disputed,
        suspect_ranks=tuple(sorted(suspects)),
        candidates=tuple(sorted(candidates - suspects)),
    )
    counts = {
        "tensor_count": len(fps),
        "regions": len(regions),
        "replicas": max(map(len, regions.values()), default=0),
        # regions with one holder (every shard of a 1-D FSDP mesh) are compared with nothing
        "min_replicas": min(map(len, regions.values()), default=0),
    }
    return result, counts
