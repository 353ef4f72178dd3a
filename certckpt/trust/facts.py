"""Audit facts: the little the certifier needs from each audit event, checked like user input and
folded as events are read, so a ledger of a million events never sits in memory as dicts.

An event read from a store is untrusted input. ``read_event`` checks every field the certifier uses;
a failure whose other fields are malformed still counts as a failure, read pessimistically (never
contained, blaming nobody it cannot name); a pass counts only when it is well formed and
authenticated (the ledger decides that). No I/O, no torch.
"""

from __future__ import annotations

import array
import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .records import EventKind, Outcome, check_family

__all__ = ["AuditFacts", "BranchFacts", "Event", "EventProblem", "read_event", "SEEN_ALL", "FAILED_ANY"]

# The hot path compares plain strings: an enum member's attribute lookup costs more than the compare
# (a million events per cold read).
_PASS: str = Outcome.PASS.value
_FAIL: str = Outcome.FAIL.value
_CONSENSUS: str = EventKind.CONSENSUS.value
# A branch is only ever compared and printed (escaped) here, never made a path: any short text.
_MAX_STEP = 10**18


class EventProblem(ValueError):
    """An event line that names no branch or step: it cannot be placed, so the store cannot be
    certified until it is repaired (it could have been a failed check)."""


class Event(NamedTuple):
    """The certifier's view of one audit event (a tuple: a million of them are built per cold read)."""

    branch: str
    step: int
    kind: str  # an ``EventKind`` value, or any other short text a store holds
    outcome: str  # an ``Outcome`` value (``read_event`` refuses any other)
    contained: bool
    suspect_ranks: tuple[int, ...]
    fp: str | None
    found_by: bool


def read_event(e: object, *, authenticated: bool = True) -> tuple[Event, str | None]:
    """The facts of one event and why any field was unusable (None when all were).

    Args:
        authenticated: False for an event nobody trusted signed: a failure then is never contained
            (its update is assumed applied), whatever the record says.

    Raises:
        EventProblem: no branch, step or outcome can be read (the event cannot be placed).
    """
    if type(e) is not dict:  # an AuditEvent, or anything else: read its attributes
        e = {
            k: getattr(e, k, None)
            for k in ("branch", "step", "outcome", "kind", "details", "contained", "suspect_ranks")
        }
    get = e.get
    branch, step, outcome = _placement(get("branch"), get("step"), get("outcome"))
    problems: list[str] | None = None
    kind = get("kind")
    if type(kind) is not str or len(kind) > 40:
        problems = ["kind"]
        kind = "unknown"
    details = get("details")
    if type(details) is not dict:
        if details is not None and not isinstance(details, Mapping):
            problems = [*(problems or ()), "details"]
            details = {}
        details = dict(details or {})
    contained = get("contained")
    if type(contained) is not bool:
        if contained is not None:
            problems = [*(problems or ()), "contained"]
        contained = False
    suspects, ranks_malformed = _suspect_ranks(get("suspect_ranks"))
    if ranks_malformed:
        problems = [*(problems or ()), "suspect_ranks"]
    fp = details.get("fp")
    if fp is not None and type(fp) is not str:
        problems = [*(problems or ()), "details.fp"]
        fp = None
    if problems:
        if outcome == _PASS:  # a pass is evidence for trust: a malformed one is evidence of nothing
            return Event(branch, step, kind, outcome, False, (), None, False), ", ".join(problems)
        why = f"malformed {', '.join(problems)}; read as a failure that was not contained"
        return Event(branch, step, kind, outcome, False, suspects, fp, False), why
    if outcome == _FAIL and not authenticated:
        contained = False
    found_by = kind == _CONSENSUS and bool(details.get("found_by"))
    return Event(branch, step, kind, outcome, contained, suspects, fp, found_by), None


def _placement(branch: object, step: object, outcome: object) -> tuple[str, int, str]:
    """An event's branch, step and outcome: without all three it cannot be placed at all.

    Raises:
        EventProblem: one of them cannot be read.
    """
    if type(branch) is not str or not 0 < len(branch) <= 200:
        raise EventProblem(f"branch {str(branch)[:40]!r} is not a branch name")
    if type(step) is not int or not 0 <= step < _MAX_STEP:
        raise EventProblem(f"step {str(step)[:40]!r} is not a step number")
    if outcome != _PASS and outcome != _FAIL:
        raise EventProblem(f"outcome {str(outcome)[:40]!r} is neither pass nor fail")
    return branch, step, outcome


def _suspect_ranks(ranks: object) -> tuple[tuple[int, ...], bool]:
    """The ranks an event blames and whether its list was malformed (then it blames nobody: a
    reader cannot name a rank it cannot read). A missing list is no problem."""
    if ranks == [] or ranks == ():
        return (), False
    if type(ranks) is list and all(type(r) is int for r in ranks):
        return tuple(ranks), False
    if isinstance(ranks, tuple) and all(type(r) is int for r in ranks):
        return ranks, False
    return (), ranks is not None


# Per step, one small int: bit k says kind k was checked there, bit k+3 that it failed. A kind's bit is
# its check's (``check_family``: a nonfinite-pre failure fails the non-finite check).
_CHECK_BIT: dict[str, int] = {EventKind.REPLAY: 0, EventKind.NONFINITE: 1, EventKind.CONSENSUS: 2}
KIND_BIT: dict[str, int] = {k.value: _CHECK_BIT[f] for k in EventKind if (f := check_family(k)) in _CHECK_BIT}
SEEN_ALL = 0b000111
FAILED_ANY = 0b111000


@dataclass(slots=True)
class BranchFacts:
    """One branch's audit outcomes: a bit mask per step, the fingerprints agreed on at consensus
    steps, and the failures (step, kind, suspect ranks, contained)."""

    mask: dict[int, int] = field(default_factory=dict)
    fps: dict[int, str] = field(default_factory=dict)
    failures: list[tuple[int, str, tuple[int, ...], bool]] = field(default_factory=list)

    def copy(self) -> BranchFacts:
        return BranchFacts(mask=dict(self.mask), fps=dict(self.fps), failures=list(self.failures))

    def consensus(self, step: int) -> tuple[str, str | None] | None:
        """``(outcome, fingerprint)`` of the weight consensus at ``step`` (None: none ran)."""
        m = self.mask.get(step, 0)
        if not m & 4:
            return None
        return (Outcome.FAIL, None) if m & 32 else (Outcome.PASS, self.fps.get(step))

    def to_json(self) -> dict[str, object]:
        """A compact form (steps and masks as packed arrays: a million steps load in milliseconds)."""
        steps = sorted(self.mask)
        fp_steps = sorted(self.fps)
        return {
            "steps": _pack("q", steps),
            "masks": _pack("B", [self.mask[s] for s in steps]),
            "fp_steps": _pack("q", fp_steps),
            "fps": [self.fps[s] for s in fp_steps],
            "failures": [[s, k, list(r), c] for s, k, r, c in self.failures],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BranchFacts:
        fps = [str(fp) for fp in doc["fps"]]
        return cls(
            mask=dict(zip(_unpack("q", doc["steps"]), _unpack("B", doc["masks"]), strict=True)),
            fps=dict(zip(_unpack("q", doc["fp_steps"]), fps, strict=True)),
            failures=[(int(s), str(k), tuple(int(x) for x in r), bool(c)) for s, k, r, c in doc["failures"]],
        )


def _pack(code: str, values: list[int]) -> str:
    return base64.b64encode(array.array(code, values).tobytes()).decode("ascii")


def _unpack(code: str, text: str) -> list[int]:
    a = array.array(code)
    a.frombytes(base64.b64decode(text, validate=True))
    return a.tolist()


@dataclass(slots=True)
class AuditFacts:
    """Every branch's audit facts, folded one event at a time."""

    branches: dict[str, BranchFacts] = field(default_factory=dict)
    count: int = 0
    # failures nobody trusted vouches for: they count against trust (``effective``), but never
    # drive anything destructive (``trusted_only``)
    doubtful: list[Event] = field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[object]) -> AuditFacts:
        facts = cls()
        for e in events:
            facts.add(e if isinstance(e, Event) else read_event(e)[0])
        return facts

    def trusted_only(self) -> AuditFacts:
        """The facts without unauthenticated failures (what a vault prune may act on)."""
        return AuditFacts(branches=self.branches, count=self.count)

    def effective(self) -> dict[str, BranchFacts]:
        """Every branch's facts with the unauthenticated failures folded in (what verdicts use)."""
        if not self.doubtful:
            return self.branches
        merged = AuditFacts(branches=dict(self.branches))
        for name in {ev.branch for ev in self.doubtful}:
            merged.branches[name] = self.branches[name].copy() if name in self.branches else BranchFacts()
        for ev in self.doubtful:
            merged.add(ev)
        return merged.branches

    def copy(self) -> AuditFacts:
        return AuditFacts(
            branches={n: b.copy() for n, b in self.branches.items()}, count=self.count, doubtful=list(self.doubtful)
        )

    def add(self, ev: Event, *, counts: bool = True) -> None:
        """Fold one event in; ``counts=False``: nobody vouches for it (a pass is dropped, a failure kept
        apart, never contained)."""
        outcome, fail = ev.outcome, _FAIL
        if not counts:
            if outcome == fail:
                self.doubtful.append(ev._replace(contained=False) if ev.contained else ev)
            return
        self.count += 1
        b = self.branches.get(ev.branch)
        if b is None:
            b = self.branches[ev.branch] = BranchFacts()
        kind = ev.kind
        if outcome == fail:
            b.failures.append((ev.step, kind, ev.suspect_ranks, ev.contained))
            if ev.contained:
                return  # the update never reached the weights: it taints nothing and fails no audit
        bit = KIND_BIT.get(kind)
        if bit is None or ev.found_by:
            # overflow notes and unknown kinds make no audit (a failure of one counts above); a
            # consensus found by a replay checks W_{s-1}, a precondition: its failure counts above
            return
        step = ev.step
        m = b.mask.get(step, 0)
        if outcome == fail:
            b.mask[step] = m | (1 << bit) | (8 << bit)
        else:
            b.mask[step] = m | (1 << bit)
            # an audit's consensus compares digests and names no fingerprint; a checkpoint's consensus
            # at the same step carries the one to match (the first one recorded stands)
            if bit == 2 and ev.fp and step not in b.fps:
                b.fps[step] = ev.fp
