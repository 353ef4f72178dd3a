"""Pure decisions of the detection checks: who is to blame, from comparison outcomes alone.

Ring replay: rank r replays the micro-batch of its predecessor o = (r - 1) mod W and compares its
gradient fingerprints with the ones o computed for itself. A faulty rank f that computes wrongly on
every call fails both of its comparisons (as origin, and as replayer), so with W >= 3 it is the rank
implicated by both. A fault that hit f's own step only (one time) fails one comparison: origin or
replayer is wrong, and a third rank (the arbiter) replays the same micro-batch to tell which.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ring_pairs",
    "ReplayVerdict",
    "arbitration_plan",
    "attribute_replay",
    "ConsensusVerdict",
    "consensus_verdict",
]


def ring_pairs(world: int) -> list[tuple[int, int]]:
    """``(origin, replayer)`` for every comparison of the ring: replayer r replays origin r - 1."""
    return [((r - 1) % world, r) for r in range(world)]


def arbitration_plan(world: int, failed: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(origin, replayer, arbiter)`` for each failed comparison that the other failures do not explain.

    Only with W >= 3: the arbiter is the rank after the replayer (never the origin there).
    """
    failed = sorted(set(failed))
    if world < 3:
        return []
    both = _implicated_by_both(world, failed)
    return [(o, r, (r + 1) % world) for o, r in failed if o not in both and r not in both]


def _implicated_by_both(world: int, failed: Sequence[tuple[int, int]]) -> set[int]:
    as_replayer = {r for _, r in failed}
    as_origin = {o for o, _ in failed}
    return as_replayer & as_origin


@dataclass(frozen=True, slots=True)
class ReplayVerdict:
    """Who the replay audit blames and what it could not tell."""

    suspects: tuple[int, ...]
    notes: tuple[str, ...]


def attribute_replay(
    world: int,
    failed: Iterable[tuple[int, int]],
    arbitration: dict[tuple[int, int], str] | None = None,
) -> ReplayVerdict:
    """Blame from failed ``(origin, replayer)`` comparisons (and arbitration outcomes, W >= 3).

    Args:
        world: number of ranks.
        failed: the comparisons whose fingerprints differed.
        arbitration: per arbitrated comparison, what the arbiter's replay agreed with:
            ``"origin"`` (the replayer computed wrongly), ``"replayer"`` (the origin computed wrongly)
            or ``"neither"``.
    """
    failed = sorted(set(failed))
    if not failed:
        return ReplayVerdict((), ())
    if world == 1:
        return ReplayVerdict(
            (0,),
            (
                "single rank: a same-device replay detects transient faults only; a persistent fault "
                "reproduces itself and passes — attribution needs >= 3 ranks",
            ),
        )
    if world == 2:
        return ReplayVerdict(
            (),
            (
                "fault detected, but attribution needs >= 3 ranks (with 2, each rank is "
                "origin of one failed comparison and replayer of the other)",
            ),
        )
    suspects = set(_implicated_by_both(world, failed))
    notes: list[str] = []
    for o, r in failed:
        if o in suspects or r in suspects:
            continue
        outcome = (arbitration or {}).get((o, r))
        if outcome == "origin":
            suspects.add(r)
        elif outcome == "replayer":
            suspects.add(o)
        else:
            notes.append(
                f"comparison of rank {r}'s replay with rank {o}'s gradients failed and the arbiter agreed with "
                f"neither ({outcome or 'no arbitration'}): ranks {o} and {r} are both candidates"
            )
    return ReplayVerdict(tuple(sorted(suspects)), tuple(notes))


@dataclass(frozen=True, slots=True)
class ConsensusVerdict:
    """The outcome of comparing every rank's weight fingerprints.

    Attributes:
        agreed: True when all ranks hold identical fingerprints.
        majority: the fingerprint row held by most ranks (None on a tie for most).
        minority_ranks: ranks whose row differs from the majority (all ranks on a tie).
        mismatched: indices of the parameters on which some rank differs from the majority.
    """

    agreed: bool
    majority: tuple[int, ...] | None
    minority_ranks: tuple[int, ...]
    mismatched: tuple[int, ...]


def consensus_verdict(rows: Sequence[Sequence[int]]) -> ConsensusVerdict:
    """Majority vote over per-rank fingerprint rows (one row per rank, one column per parameter)."""
    keyed = [tuple(r) for r in rows]
    counts = Counter(keyed).most_common()
    if len(counts) == 1:
        return ConsensusVerdict(True, keyed[0], (), ())
    top, n = counts[0]
    if counts[1][1] == n:  # a tie for most: nobody can be outvoted
        cols = tuple(j for j in range(len(keyed[0])) if len({row[j] for row in keyed}) > 1)
        return ConsensusVerdict(False, None, tuple(range(len(keyed))), cols)
    minority = tuple(i for i, row in enumerate(keyed) if row != top)
    cols = tuple(j for j in range(len(top)) if any(keyed[i][j] != top[j] for i in minority))
    return ConsensusVerdict(False, top, minority, cols)
