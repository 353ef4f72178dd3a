"""Audit facts: the little the certifier needs from each audit event, checked like user input and
folded as events are read, so a ledger of a million events never sits in memory as dicts.

An event read from a store is untrusted input. ``read_event`` checks every field the certifier uses;
a failure whose other fields are malformed still counts as a failure, read pessimistically (never
contained, blaming nobody it cannot name); a pass counts only when it is well formed and
authenticated (the ledger decides that). No I/O, no torch.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["AuditFacts", "BranchFacts", "EventProblem", "read_event", "FULL_KINDS"]

FULL_KINDS = ("replay", "nonfinite", "consensus")
# A branch is only ever compared and printed (escaped) here, never made a path: any short text.
_BRANCH = re.compile(r"^.{1,200}$", re.DOTALL)
_MAX_STEP = 10**18


class EventProblem(ValueError):
    """An event line that names no branch or step: it cannot be placed, so the store cannot be
    certified until it is repaired (it could have been a failed check)."""


@dataclass(frozen=True, slots=True)
class Event:
    """The certifier's view of one audit event."""

    branch: str
    step: int
    kind: str
    outcome: str  # "pass" | "fail"
    contained: bool
    suspect_ranks: tuple[int, ...]
    fp: str | None
    found_by: bool


def _get(e: Any, key: str) -> Any:
    return e.get(key) if isinstance(e, Mapping) else getattr(e, key, None)


def read_event(e: Any, *, authenticated: bool = True) -> tuple[Event, str | None]:
    """The facts of one event and why any field was unusable (None when all were).

    Args:
        authenticated: False for an event nobody trusted signed: a failure then is never contained
            (its update is assumed applied), whatever the record says.

    Raises:
        EventProblem: no branch, step or outcome can be read (the event cannot be placed).
    """
    branch, step, outcome = _get(e, "branch"), _get(e, "step"), _get(e, "outcome")
    if not isinstance(branch, str) or not _BRANCH.match(branch):
        raise EventProblem(f"branch {str(branch)[:40]!r} is not a branch name")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < _MAX_STEP:
        raise EventProblem(f"step {str(step)[:40]!r} is not a step number")
    if outcome not in ("pass", "fail"):
        raise EventProblem(f"outcome {str(outcome)[:40]!r} is neither pass nor fail")
    problems = []
    kind = _get(e, "kind")
    if not isinstance(kind, str) or len(kind) > 40:
        problems.append("kind")
        kind = "unknown"
    details = _get(e, "details")
    if details is None:
        details = {}
    elif not isinstance(details, Mapping):
        problems.append("details")
        details = {}
    contained = _get(e, "contained")
    if not isinstance(contained, bool):
        if contained is not None:
            problems.append("contained")
        contained = False
    ranks = _get(e, "suspect_ranks")
    if isinstance(ranks, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        suspects = tuple(ranks)
    else:
        if ranks is not None:
            problems.append("suspect_ranks")
        suspects = ()
    fp = details.get("fp")
    if fp is not None and not isinstance(fp, str):
        problems.append("details.fp")
        fp = None
    if outcome == "pass" and problems:
        # a pass is evidence for trust: a malformed one is evidence of nothing
        return Event(branch, step, kind, outcome, False, (), None, False), ", ".join(problems)
    if outcome == "fail" and not authenticated:
        contained = False
    found_by = bool(details.get("found_by")) if kind == "consensus" else False
    why = f"malformed {', '.join(problems)}; read as a failure that was not contained" if problems else None
    if why is not None:
        contained = False
    return Event(branch, step, kind, outcome, contained, suspects, fp, found_by), why


@dataclass(slots=True)
class BranchFacts:
    """Per-step audit outcomes and the failures of one branch."""

    parts: dict[int, dict[str, tuple[str, str | None]]] = field(default_factory=lambda: defaultdict(dict))
    failures: list[tuple[int, str, tuple[int, ...], bool]] = field(default_factory=list)


@dataclass(slots=True)
class AuditFacts:
    """Every branch's audit facts, folded one event at a time."""

    branches: dict[str, BranchFacts] = field(default_factory=dict)
    count: int = 0
    # failures nobody trusted vouches for: they count against trust (``effective``), but never
    # drive anything destructive (``trusted_only``)
    doubtful: list[Event] = field(default_factory=list)

    def trusted_only(self) -> AuditFacts:
        """The facts without unauthenticated failures (what a vault prune may act on)."""
        return AuditFacts(branches=self.branches, count=self.count)

    def effective(self) -> dict[str, BranchFacts]:
        """Every branch's facts with the unauthenticated failures folded in (what verdicts use)."""
        if not self.doubtful:
            return self.branches
        out = dict(self.branches)
        for name in {ev.branch for ev in self.doubtful}:
            b = self.branches.get(name, BranchFacts())
            parts: dict[int, dict[str, tuple[str, str | None]]] = defaultdict(dict)
            parts.update({s: dict(k) for s, k in b.parts.items()})
            out[name] = BranchFacts(parts=parts, failures=list(b.failures))
        merged = AuditFacts(branches=out)
        for ev in self.doubtful:
            merged.add(ev)
        return merged.branches

    @classmethod
    def of(cls, events: Iterable[Any]) -> AuditFacts:
        facts = cls()
        for e in events:
            facts.add(e if isinstance(e, Event) else read_event(e)[0])
        return facts

    def branch(self, name: str) -> BranchFacts:
        b = self.branches.get(name)
        if b is None:
            b = self.branches[name] = BranchFacts()
        return b

    def add(self, ev: Event, *, counts: bool = True) -> None:
        """Fold one event in; ``counts=False`` keeps only a failure (a pass nobody vouches for)."""
        if ev.outcome == "pass" and not counts:
            return
        if not counts:
            # nobody vouches that the update was skipped: never contained
            self.doubtful.append(replace(ev, contained=False) if ev.contained else ev)
            return
        self.count += 1
        b = self.branch(ev.branch)
        kind = "nonfinite" if ev.kind in ("nonfinite-pre", "nonfinite-post") else ev.kind
        if ev.outcome == "fail":
            b.failures.append((ev.step, ev.kind, ev.suspect_ranks, ev.contained))
        if kind == "consensus" and ev.found_by:
            return  # a precondition check of a replay (weights W_{s-1}); the failure above counts
        if ev.outcome == "fail" and ev.contained:
            return  # the update never reached the weights: it taints nothing and fails no audit
        if kind not in FULL_KINDS:
            return  # overflow notes and unknown kinds make no audit (a failure of one counts above)
        step_parts = b.parts[ev.step]
        prev = step_parts.get(kind)
        # A failure is never overwritten by a pass. An audit's consensus compares digests and carries
        # no fingerprint; a checkpoint's consensus at the same step carries the one to match.
        if prev is None or ev.outcome == "fail" or (prev == ("pass", None) and ev.fp):
            step_parts[kind] = (ev.outcome, ev.fp)
