"""Retention: pure, composable policies that decide which vaulted checkpoints may go.

A policy only says what it *keeps*; ``plan_prune`` combines the policies' answers with the two
guards no policy can override, and returns a plan. Deleting is a separate step (``vault.prune``):

* the newest trusted checkpoint that precedes an open suspect interval (the rollback target), and
  latest-good itself, are never deleted;
* nothing is deleted while an incident is open: the evidence must survive the investigation.

Policies compose with ``|``: ``KeepLatest(3) | KeepEvery(1000)`` keeps what either keeps. No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = [
    "RetentionEntry",
    "RetentionPolicy",
    "KeepLatest",
    "KeepEvery",
    "KeepFor",
    "KeepBest",
    "AnyOf",
    "PrunePlan",
    "plan_prune",
    "protected_checkpoints",
]

_DAY = 86400.0


@dataclass(frozen=True, kw_only=True, slots=True)
class RetentionEntry:
    """A checkpoint the vault holds, as retention sees it.

    Attributes:
        committed_at: when training wrote it (seconds since the epoch): the age ``KeepFor`` measures.
        metrics: numeric values saved with it (``save(..., metadata=...)``), for ``KeepBest``.
    """

    ckpt_id: str
    branch: str
    step: int
    trusted: bool
    committed_at: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


class RetentionPolicy:
    """Base of the policies: ``keeps(entries, now=...)`` returns ``{ckpt_id: why}`` for what it keeps."""

    def keeps(self, entries: Sequence[RetentionEntry], *, now: float) -> dict[str, str]:  # pragma: no cover
        raise NotImplementedError

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(self, other)


def _newest_first(entries: Sequence[RetentionEntry]) -> list[RetentionEntry]:
    return sorted(entries, key=lambda e: (e.step, e.committed_at), reverse=True)


@dataclass(frozen=True, slots=True)
class KeepLatest(RetentionPolicy):
    """Keep the newest ``n`` trusted checkpoints (by step)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ConfigurationError("KeepLatest: n must be >= 0")

    def keeps(self, entries, *, now):
        trusted = [e for e in _newest_first(entries) if e.trusted][: self.n]
        return {e.ckpt_id: f"one of the latest {self.n} trusted" for e in trusted}

    def __str__(self) -> str:
        return f"keep-last {self.n}"


@dataclass(frozen=True, slots=True)
class KeepEvery(RetentionPolicy):
    """Keep one trusted checkpoint per window of ``steps`` training steps: the newest in each window."""

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigurationError("KeepEvery: steps must be >= 1")

    def keeps(self, entries, *, now):
        chosen: dict[int, RetentionEntry] = {}
        for e in _newest_first(entries):
            if e.trusted:
                chosen.setdefault(e.step // self.steps, e)
        return {
            e.ckpt_id: f"newest trusted in steps [{w * self.steps}, {(w + 1) * self.steps})" for w, e in chosen.items()
        }

    def __str__(self) -> str:
        return f"keep-every {self.steps} steps"


@dataclass(frozen=True, slots=True)
class KeepFor(RetentionPolicy):
    """Keep every checkpoint (trusted or not) younger than ``days``."""

    days: float

    def __post_init__(self) -> None:
        if not self.days >= 0:
            raise ConfigurationError("KeepFor: days must be >= 0")

    def keeps(self, entries, *, now):
        return {
            e.ckpt_id: f"younger than {self.days:g} days" for e in entries if now - e.committed_at < self.days * _DAY
        }

    def __str__(self) -> str:
        return f"keep-days {self.days:g}"


@dataclass(frozen=True, slots=True)
class KeepBest(RetentionPolicy):
    """Keep the ``n`` trusted checkpoints with the best value of ``metric`` (lowest unless ``higher_is_better``).

    Checkpoints without the metric are not ranked (another policy decides them).
    """

    metric: str
    n: int = 1
    higher_is_better: bool = False

    def keeps(self, entries, *, now):
        ranked = [e for e in entries if e.trusted and _finite(e.metrics.get(self.metric))]
        ranked.sort(key=lambda e: (e.metrics[self.metric] * (-1 if self.higher_is_better else 1), -e.step))
        return {e.ckpt_id: f"best {self.metric} ({e.metrics[self.metric]:g})" for e in ranked[: self.n]}

    def __str__(self) -> str:
        return f"keep-best {self.n} by {'max' if self.higher_is_better else 'min'} {self.metric}"


@dataclass(frozen=True, slots=True)
class AnyOf(RetentionPolicy):
    """Keeps what any of its policies keeps."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        flat: list[RetentionPolicy] = []
        for p in policies:
            flat.extend(p.policies if isinstance(p, AnyOf) else (p,))
        object.__setattr__(self, "policies", tuple(flat))

    def keeps(self, entries, *, now):
        out: dict[str, str] = {}
        for p in self.policies:
            for cid, why in p.keeps(entries, now=now).items():
                out[cid] = f"{out[cid]}; {why}" if cid in out else why
        return out

    def __str__(self) -> str:
        return " | ".join(map(str, self.policies)) or "keep nothing"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(kw_only=True, slots=True)
class PrunePlan:
    """What a prune would do.

    Attributes:
        keep: ``{ckpt_id: why}`` for everything kept (by a policy or a guard).
        delete: ids the policy lets go, oldest first.
        guarded: ``{ckpt_id: why}`` kept by a guard although no policy kept them.
        blocked_by: open incidents that stop every deletion.
    """

    keep: dict[str, str] = field(default_factory=dict)
    delete: list[str] = field(default_factory=list)
    guarded: dict[str, str] = field(default_factory=dict)
    blocked_by: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "delete": self.delete, "guarded": self.guarded, "blocked_by": self.blocked_by}


def protected_checkpoints(
    entries: Sequence[RetentionEntry],
    *,
    latest_good: str | None,
    intervals: Sequence[tuple[str, int, int]],
    branch_parents: dict[str, str] | None = None,
) -> dict[str, str]:
    """The checkpoints no policy may delete, with why.

    Args:
        entries: what the vault holds.
        latest_good: the certifier's latest-good id.
        intervals: suspect intervals as ``(branch, c, d)``: steps ``(c, d]`` of ``branch`` are suspect.
        branch_parents: per branch, the checkpoint it resumed from.

    An interval stays open until a recovery branch (one forked from ``branch`` at or before ``c``)
    holds a trusted checkpoint past ``d``; while it is open, the newest trusted checkpoint of
    ``branch`` at or before ``c`` is the rollback target and is protected.
    """
    out: dict[str, str] = {}
    if latest_good is not None:
        out[latest_good] = "latest-good"
    parents = branch_parents or {}
    by_id = {e.ckpt_id: e for e in entries}

    def fork_step(branch: str, origin: str) -> int | None:
        """The step at which ``branch`` left ``origin`` (following parents), None if it did not."""
        seen = set()
        while branch in parents and branch not in seen:
            seen.add(branch)
            parent = parents[branch]
            pb, _, ps = parent.rpartition("@")
            if pb == origin:
                return int(ps) if ps.isdigit() else None
            branch = pb
        return None

    for branch, c, d in intervals:
        recovered = any(
            e.trusted
            and e.step > d
            and e.branch != branch
            and (fs := fork_step(e.branch, branch)) is not None
            and fs <= c
            for e in entries
        )
        if recovered:
            continue
        before = [e for e in entries if e.branch == branch and e.trusted and e.step <= c]
        if before:
            target = max(before, key=lambda e: (e.step, e.committed_at))
            out.setdefault(target.ckpt_id, f"rollback target before the open suspect interval ({c}, {d}] on {branch}")
    return {k: v for k, v in out.items() if k in by_id}


def plan_prune(
    entries: Sequence[RetentionEntry],
    policy: RetentionPolicy,
    *,
    now: float,
    protected: dict[str, str] | None = None,
    open_incidents: Sequence[str] = (),
) -> PrunePlan:
    """Decide what a prune deletes: what no policy keeps, minus the guarded ones, nothing at all
    while an incident is open."""
    kept = policy.keeps(entries, now=now)
    plan = PrunePlan(blocked_by=list(open_incidents))
    for e in sorted(entries, key=lambda e: (e.step, e.committed_at)):
        if e.ckpt_id in kept:
            plan.keep[e.ckpt_id] = kept[e.ckpt_id]
        elif protected and e.ckpt_id in protected:
            plan.keep[e.ckpt_id] = plan.guarded[e.ckpt_id] = protected[e.ckpt_id]
        elif open_incidents:
            why = f"incident {', '.join(open_incidents)} is open"
            plan.keep[e.ckpt_id] = plan.guarded[e.ckpt_id] = why
        else:
            plan.delete.append(e.ckpt_id)
    return plan
