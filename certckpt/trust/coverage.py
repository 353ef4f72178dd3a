"""Audit coverage: how much of the computation behind each checkpoint the checks recomputed.

A pure function of a ledger snapshot's audit events (the ones that count: signed and sealed where
the store is, plus every failure, which proves a check ran) and its checkpoints. Nothing here reads
configuration: an ``audit_every`` that was set but never ran covers nothing.

For a checkpoint at step s on branch b, its **window** is the steps since its lineage parent p (the
previous checkpoint of b, else b's fork point, else the branch's start): ``(p, s]``. Over the window:

- **replay**: the steps whose local gradients a neighbour recomputed (the ring replay covers every
  rank's micro-batches on such a step), with the fraction of the micro-batches it replayed (``k/n``
  when an audit samples a block, from the event's ``replayed_micro_batches``);
- **consensus**: the steps whose weights every replica compared, and what they covered (parameters,
  buffers; for sharded runs, tensors, regions and the fewest replicas of one region);
- **non-finite**: the steps a non-finite check covered (each audit's summary covers the steps since
  the previous one);
- the **detection bound**: a persistent fault that starts anywhere in the window is replayed, hence
  caught, at the latest on its ``persistent_within``-th step (the first replay at or after it,
  possibly after s: the audit that vouches for s); the rank is named when every such replay ran on
  at least 3 ranks (two disagreeing replicas name nobody); a one-time fault on a step and rank drawn
  uniformly from the window was replayed with probability ``one_time_replayed``.

``lineage`` repeats the one-time figure over every window back to the first checkpoint (steps
``(0, s]`` across the branches this checkpoint descends from).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from .certify import CheckpointEntry
from .records import EventKind, Outcome, check_family

__all__ = ["Coverage", "WindowCoverage", "coverage", "lineage_of", "parents_of"]

_MAX_STEP = 10**18
_MAX_LINEAGE = 100_000  # a lineage longer than this is a cycle or an attack: stop there
_COVERED_KEYS = ("params", "buffers", "tensor_count", "regions", "replicas", "min_replicas")
# plain strings for the per-event compares (an enum member's lookup costs more than the compare)
_OUTCOMES = frozenset(o.value for o in Outcome)
_NONFINITE: str = EventKind.NONFINITE.value
_REPLAY: str = EventKind.REPLAY.value
_CONSENSUS: str = EventKind.CONSENSUS.value
_TRIGGERED: str = EventKind.TRIGGERED_REPLAY.value


@dataclass(frozen=True, kw_only=True, slots=True)
class _Check:
    """One audit event, as coverage reads it (validated: a malformed field drops the event)."""

    branch: str
    step: int
    kind: str
    phase: str
    ranks: int
    fraction: Fraction  # of the step's micro-batches replayed (replay); 1 otherwise
    steps_checked: int  # non-finite summaries
    covered: dict[str, int]  # consensus: what was compared


def _int(value: object) -> int | None:
    return value if type(value) is int and 0 <= value < _MAX_STEP else None


def _fraction(details: Mapping[str, object]) -> Fraction | None:
    """The share of the step's micro-batches a replay recomputed; None when unreadable."""
    n = details.get("micro_batches")
    k = details.get("replayed_micro_batches", n)
    if n is None and k is None:
        return Fraction(1)  # a replay of the whole step (sharded update replays, early events)
    n, k = _int(n), _int(k)
    if n is None or k is None or n == 0 or k > n:
        return None
    return Fraction(k, n)


def _read(e: object) -> _Check | None:
    """An event as a check that ran, or None: malformed, a precondition check (``found_by``), or a
    kind that covers nothing (an overflow)."""
    if type(e) is not dict:
        return None
    branch, step, kind, details = e.get("branch"), _int(e.get("step")), e.get("kind"), e.get("details")
    ranks = e.get("ranks")
    if type(branch) is not str or step is None or type(kind) is not str or type(details) is not dict:
        return None
    if type(ranks) is not list or not all(type(r) is int for r in ranks):
        return None
    if details.get("found_by") or e.get("outcome") not in _OUTCOMES:
        return None
    if check_family(kind) == _NONFINITE:
        summary = kind == _NONFINITE  # an audit's summary; the others are one step's failure
        checked = _int(details.get("steps_checked"))
        return _Check(
            branch=branch,
            step=step,
            kind=_NONFINITE,
            phase="summary" if summary else "failure",
            ranks=len(ranks),
            fraction=Fraction(1),
            steps_checked=(checked or 0) if summary else 1,
            covered={},
        )
    if kind == _REPLAY:
        fraction = _fraction(details)
        if fraction is None:
            return None
        phase = "update" if details.get("phase") == "update" else "gradients"
        return _Check(
            branch=branch,
            step=step,
            kind=kind,
            phase=phase,
            ranks=len(ranks),
            fraction=fraction,
            steps_checked=0,
            covered={},
        )
    if kind == _TRIGGERED:
        # a clean replay the sentinels asked for between audits: reported on its own (it vouches for
        # its own step only, so it is kept out of the replays that bound a window)
        return _Check(
            branch=branch,
            step=step,
            kind=kind,
            phase="triggered",
            ranks=len(ranks),
            fraction=Fraction(1),
            steps_checked=0,
            covered={},
        )
    if kind == _CONSENSUS:
        covered = {k: v for k in _COVERED_KEYS if (v := _int(details.get(k))) is not None}
        return _Check(
            branch=branch,
            step=step,
            kind=kind,
            phase="",
            ranks=len(ranks),
            fraction=Fraction(1),
            steps_checked=0,
            covered=covered,
        )
    return None


@dataclass(kw_only=True, slots=True)
class _BranchChecks:
    replays: dict[int, _Check] = field(default_factory=dict)  # gradient replays by step (the widest)
    update_replays: set[int] = field(default_factory=set)
    triggered: set[int] = field(default_factory=set)  # steps of clean triggered replays
    consensus: dict[int, _Check] = field(default_factory=dict)
    nonfinite: list[_Check] = field(default_factory=list)  # summaries and per-step failures, by step
    replay_steps: list[int] = field(default_factory=list)  # sorted, for the persistent bound
    # Sorted once per branch, so that a window is a slice (bisect), never a scan of every event:
    # a store of thousands of checkpoints and audits stays linear-logarithmic.
    update_steps: list[int] = field(default_factory=list)
    triggered_steps: list[int] = field(default_factory=list)
    consensus_steps: list[int] = field(default_factory=list)
    nonfinite_spans: list[tuple[int, int]] = field(default_factory=list)  # disjoint (lo, hi], sorted
    nonfinite_before: list[int] = field(default_factory=list)  # steps covered by the spans before each


def _index(events: Iterable[object]) -> dict[str, _BranchChecks]:
    out: dict[str, _BranchChecks] = {}
    for e in events:
        c = _read(e)
        if c is None:
            continue
        b = out.setdefault(c.branch, _BranchChecks())
        if c.kind == _REPLAY and c.phase == "update":
            b.update_replays.add(c.step)
        elif c.kind == _REPLAY:
            prev = b.replays.get(c.step)
            if prev is None or (c.fraction, c.ranks) > (prev.fraction, prev.ranks):
                b.replays[c.step] = c
        elif c.kind == _CONSENSUS:
            b.consensus.setdefault(c.step, c)
        elif c.kind == _TRIGGERED:
            b.triggered.add(c.step)
        else:
            b.nonfinite.append(c)
    for b in out.values():
        b.replay_steps = sorted(b.replays)
        b.update_steps = sorted(b.update_replays)
        b.triggered_steps = sorted(b.triggered)
        b.consensus_steps = sorted(b.consensus)
        b.nonfinite.sort(key=lambda c: c.step)
        b.nonfinite_spans = _nonfinite_spans(b.nonfinite)
        total, before = 0, []
        for lo, hi in b.nonfinite_spans:
            before.append(total)
            total += hi - lo
        b.nonfinite_before = before
    return out


def _nonfinite_spans(checks: Sequence[_Check]) -> list[tuple[int, int]]:
    """The steps non-finite checks covered, as disjoint sorted spans ``(lo, hi]``: each audit's
    summary covers the steps since the previous summary (the last ``steps_checked`` of them); a
    failure covers its own step."""
    spans: list[tuple[int, int]] = []
    prev = 0
    for c in checks:
        if c.phase == "failure":
            lo = c.step - 1
        else:
            lo = max(prev, c.step - c.steps_checked)
            prev = max(prev, c.step)
        if lo < c.step:
            spans.append((lo, c.step))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _between(steps: list[int], start: int, end: int) -> list[int]:
    """The steps of a sorted list in ``(start, end]``."""
    return steps[bisect_right(steps, start) : bisect_right(steps, end)]


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowCoverage:
    """What the checks covered over the steps ``(start, end]`` of one branch.

    Attributes:
        branch: the branch the steps ran on.
        start: the parent's step (exclusive).
        end: the checkpoint's step (inclusive).
        replay_steps: steps whose gradients were replayed, each with the ranks that took part.
        sampled_steps: of those, the steps where only part of the micro-batches was replayed,
            with the fraction replayed (``"k/n"``).
        update_replay_steps: steps whose optimizer update was recomputed (sharded sessions).
        consensus_steps: steps whose weights every replica compared.
        consensus_covered: the most every consensus in the window compared (``params``,
            ``buffers``; sharded: ``tensor_count``, ``regions``, ``replicas``, ``min_replicas``).
        nonfinite_steps: steps a non-finite check covered.
        replayed: the sum over the window's steps of the fraction of micro-batches replayed.
        triggered_steps: steps the sentinels had replayed between audits, found right. Each vouches
            for its own step only (``docs/detection.md``, "Triggered replays"), so they count in
            none of the figures above, nor in the bound.
    """

    branch: str
    start: int
    end: int
    replay_steps: dict[int, int]
    sampled_steps: dict[int, str]
    update_replay_steps: list[int]
    consensus_steps: list[int]
    consensus_covered: dict[str, int]
    nonfinite_steps: int
    replayed: Fraction
    triggered_steps: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True, slots=True)
class Coverage:
    """One checkpoint's coverage (see the module's docstring for what each figure means).

    Attributes:
        ckpt_id: the checkpoint.
        parent: its lineage parent (None: the first checkpoint of a root branch).
        window: the checks over the steps since the parent.
        persistent_within: a persistent fault starting in the window is caught at the latest on
            its n-th faulty step (None: some step of the window has no replay at or after it).
        rank_named: every replay that bounds the window ran on at least 3 ranks.
        world: the fewest ranks of those replays (0: none).
        one_time_replayed: the probability a one-time fault in the window was replayed.
        lineage: how many checkpoints lead back to the first one, this one included
            (``lineage_of`` names them).
        lineage_steps: the steps of every window of the lineage.
        lineage_replayed: the probability a one-time fault anywhere in the lineage was replayed.
    """

    ckpt_id: str
    parent: str | None
    window: WindowCoverage
    persistent_within: int | None
    rank_named: bool
    world: int
    one_time_replayed: Fraction
    lineage: int
    lineage_steps: int
    lineage_replayed: Fraction

    @property
    def audited(self) -> bool:
        """Whether any replay ran in the window or vouches for it."""
        return self.persistent_within is not None or bool(self.window.replay_steps)

    def to_json(self) -> dict[str, object]:
        w = self.window
        return {
            "ckpt_id": self.ckpt_id,
            "parent": self.parent,
            "branch": w.branch,
            "steps": {"from": w.start, "to": w.end, "count": w.steps},
            "replay": {
                "steps": sorted(w.replay_steps),
                "ranks": {str(s): n for s, n in sorted(w.replay_steps.items())},
                "sampled": {str(s): f for s, f in sorted(w.sampled_steps.items())},
                "update_steps": w.update_replay_steps,
                "triggered_steps": w.triggered_steps,
            },
            "consensus": {"steps": w.consensus_steps, "covered": w.consensus_covered},
            "nonfinite_steps": w.nonfinite_steps,
            "bound": {
                "persistent_within": self.persistent_within,
                "rank_named": self.rank_named,
                "world": self.world,
                "one_time_replayed": str(self.one_time_replayed),
                "one_time_replayed_float": float(self.one_time_replayed),
            },
            "lineage": {
                "checkpoints": self.lineage,
                "steps": self.lineage_steps,
                "one_time_replayed": str(self.lineage_replayed),
                "one_time_replayed_float": float(self.lineage_replayed),
            },
        }

    def summary(self) -> str:
        """One line for people: ``replayed 1/5 steps (20); persistent fault caught within 10 steps, rank named``."""
        w = self.window
        if not w.replay_steps:
            head = f"no replay over steps {w.start + 1}-{w.end}"
        else:
            head = f"replayed {self.one_time_replayed} of steps {w.start + 1}-{w.end} ({len(w.replay_steps)} step(s))"
        if w.triggered_steps:
            head += f"; {len(w.triggered_steps)} triggered replay(s) clean"
        bound = (
            "a persistent fault: no bound"
            if self.persistent_within is None
            else f"a persistent fault caught within {self.persistent_within} step(s)"
            + (", rank named" if self.rank_named else ", rank not named (< 3 ranks)")
        )
        return (
            f"{head}; consensus at {len(w.consensus_steps)}, non-finite checks on {w.nonfinite_steps}; {bound};"
            f" lineage: {self.lineage_replayed} of {self.lineage_steps} steps replayed"
        )


def parents_of(checkpoints: Sequence[CheckpointEntry], branch_parents: Mapping[str, str]) -> dict[str, str | None]:
    """Each checkpoint's lineage parent: the previous checkpoint of its branch (by step, then commit
    time), else its branch's fork point (None when that is no committed checkpoint)."""
    by_id = {c.ckpt_id: c for c in checkpoints}
    by_branch: dict[str, list[CheckpointEntry]] = {}
    for c in checkpoints:
        by_branch.setdefault(c.branch, []).append(c)
    out: dict[str, str | None] = {}
    for branch, members in by_branch.items():
        members.sort(key=lambda x: (x.step, x.committed_at))
        fork = branch_parents.get(branch) or members[0].parent
        prev = fork if fork in by_id and fork not in {m.ckpt_id for m in members} else None
        for m in members:
            out[m.ckpt_id] = prev
            prev = m.ckpt_id
    return out


def lineage_of(ckpt_id: str, parents: Mapping[str, str | None]) -> list[str]:
    """The checkpoint and its ancestors back to the first checkpoint, nearest first (``parents``:
    from ``parents_of``)."""
    out: list[str] = []
    seen: set[str] = set()
    cur: str | None = ckpt_id
    while cur is not None and cur in parents and cur not in seen and len(out) < _MAX_LINEAGE:
        out.append(cur)
        seen.add(cur)
        cur = parents[cur]
    return out


def _window(b: _BranchChecks | None, branch: str, start: int, end: int) -> WindowCoverage:
    if b is None:
        b = _BranchChecks()
    replayed = _between(b.replay_steps, start, end)
    consensus = _between(b.consensus_steps, start, end)
    covered: dict[str, int] = {}
    for step in consensus:
        for k, v in b.consensus[step].covered.items():
            covered[k] = max(covered.get(k, 0), v)
    return WindowCoverage(
        branch=branch,
        start=start,
        end=end,
        replay_steps={st: b.replays[st].ranks for st in replayed},
        sampled_steps={st: str(b.replays[st].fraction) for st in replayed if b.replays[st].fraction < 1},
        update_replay_steps=_between(b.update_steps, start, end),
        consensus_steps=consensus,
        consensus_covered=covered,
        nonfinite_steps=_nonfinite_steps(b, start, end),
        replayed=sum((b.replays[st].fraction for st in replayed), Fraction(0)),
        triggered_steps=_between(b.triggered_steps, start, end),
    )


def _nonfinite_steps(b: _BranchChecks, start: int, end: int) -> int:
    """Steps of ``(start, end]`` a non-finite check covered (the spans overlapping it, by bisection)."""
    spans, before = b.nonfinite_spans, b.nonfinite_before
    if end <= start or not spans:
        return 0
    first = bisect_right(spans, (start, _MAX_STEP))  # spans starting at or before start stay candidates
    first = max(0, first - 1)
    last = bisect_left(spans, (end, -1))  # spans starting at or after end cover nothing of the window
    if first >= last:
        return 0
    count = (before[last - 1] + spans[last - 1][1] - spans[last - 1][0]) - before[first]  # whole spans
    lo0, hi0 = spans[first]
    count -= max(0, min(hi0, start) - lo0)  # the part of the first span before the window
    lo1, hi1 = spans[last - 1]
    count -= max(0, hi1 - max(lo1, end))  # the part of the last span after it
    return max(0, count)


def _bound(b: _BranchChecks | None, start: int, end: int) -> tuple[int | None, int]:
    """The persistent bound over ``(start, end]`` and the fewest ranks of the replays it rests on:
    the latest the first replay at or after any step of the window comes, counted in steps."""
    if b is None or end <= start:
        return None, 0
    steps = b.replay_steps
    worst, world = 0, 0
    t = start + 1
    while t <= end:
        i = bisect_left(steps, t)
        if i == len(steps):
            return None, 0
        nxt = steps[i]
        worst = max(worst, nxt - t + 1)
        ranks = b.replays[nxt].ranks
        world = ranks if world == 0 else min(world, ranks)
        t = nxt + 1
    return worst, world


def _lineage_totals(
    windows: Mapping[str, WindowCoverage], parents: Mapping[str, str | None]
) -> dict[str, tuple[int, int, Fraction]]:
    """Per checkpoint, over its lineage: checkpoints, steps, and the replayed micro-batch fractions
    summed (each checkpoint's from its parent's: linear in the number of checkpoints)."""
    out: dict[str, tuple[int, int, Fraction]] = {}
    for cid in windows:
        chain: list[str] = []
        cur: str | None = cid
        while cur is not None and cur not in out and cur in windows and cur not in chain:
            chain.append(cur)
            cur = parents.get(cur)
        base = out.get(cur, (0, 0, Fraction(0))) if cur is not None else (0, 0, Fraction(0))
        for x in reversed(chain):
            w = windows[x]
            base = (base[0] + 1, base[1] + w.steps, base[2] + w.replayed)
            out[x] = base
    return out


def coverage(
    checkpoints: Sequence[CheckpointEntry],
    events: Iterable[object],
    *,
    branch_parents: Mapping[str, str],
) -> dict[str, Coverage]:
    """Every checkpoint's coverage, from the audit events that ran.

    Args:
        checkpoints: the committed checkpoints (``LedgerSnapshot.checkpoints``).
        events: the audit events as stored (``LedgerSnapshot.events``); malformed ones are skipped.
        branch_parents: each branch's fork point (``LedgerSnapshot.branch_parents``).

    Returns:
        ckpt_id -> its ``Coverage``.

    Example::

        cov = coverage(snap.checkpoints, snap.events, branch_parents=snap.branch_parents)
        cov["main@20"].one_time_replayed  # Fraction(1, 5) with audits every 10, checkpoints every 5
    """
    by_id = {c.ckpt_id: c for c in checkpoints}
    parents = parents_of(checkpoints, branch_parents)
    checks = _index(events)
    windows: dict[str, WindowCoverage] = {}
    for c in checkpoints:
        parent = parents[c.ckpt_id]
        start = min(by_id[parent].step if parent is not None else 0, c.step)
        windows[c.ckpt_id] = _window(checks.get(c.branch), c.branch, start, c.step)
    totals = _lineage_totals(windows, parents)
    out: dict[str, Coverage] = {}
    for c in checkpoints:
        w = windows[c.ckpt_id]
        within, world = _bound(checks.get(c.branch), w.start, w.end)
        depth, lin_steps, lin_replayed = totals[c.ckpt_id]
        out[c.ckpt_id] = Coverage(
            ckpt_id=c.ckpt_id,
            parent=parents[c.ckpt_id],
            window=w,
            persistent_within=within,
            rank_named=within is not None and world >= 3,
            world=world,
            one_time_replayed=w.replayed / w.steps if w.steps else Fraction(0),
            lineage=depth,
            lineage_steps=lin_steps,
            lineage_replayed=lin_replayed / lin_steps if lin_steps else Fraction(0),
        )
    return out
