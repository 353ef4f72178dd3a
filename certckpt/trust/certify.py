"""The certifier: a pure function from (checkpoints, audit events, revocations) to verdicts.

Implements the five trust rules of ``docs/trust.md`` exactly. A checkpoint at step s on branch b is
trusted only when all hold:

1. it is committed and its bytes verify (``corrupt``);
2. its embedded weight fingerprint equals the one every replica agreed on at step s
   (``fingerprint-mismatch``; no agreement recorded: ``no-consensus``);
3. the first full audit on b at or after s has passed, with no failed check on b from s up to it
   (``awaiting-audit`` while there is none yet; ``after-fault`` otherwise);
4. no uncontained detection on b has its last clean audit point before s (``after-fault``);
5. its parent lineage is trusted (``tainted-parent``), and it has not been revoked (``revoked``).

Below trusted, a checkpoint is **verified** when nothing but missing audit evidence keeps it from
trust: its only reasons of its own are ``no-consensus`` and ``awaiting-audit`` (rule 1 holds, no
fingerprint disagrees, no failed check taints it), it is not revoked, and every fork point it
descends from is verified too. A run without the auditor reaches verified at most. Trusted implies
verified; suspect is the default: nothing is trusted without evidence.

A resume supersedes (``superseded``): once a branch forks from ``P@s``, a checkpoint of ``P``'s branch
after ``s`` that was only awaiting evidence will never get its audit; it becomes suspect with that
reason, never verified, so neither latest-good nor a promotion takes abandoned work. Trusted ones
keep their verdict; suspect ones keep their own reasons. No I/O, no torch: the ledger feeds it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from certckpt.errors import ConfigurationError

from .devices import unaudited_overlap
from .facts import FAILED_ANY, SEEN_ALL, AuditFacts, BranchFacts

__all__ = [
    "CheckpointEntry",
    "Revocation",
    "Verdict",
    "Level",
    "Detection",
    "Certification",
    "certify",
    "accept_level",
    "Reason",
    "REASONS",
    "PENDING_REASONS",
]


class Reason(str, Enum):
    """Why a checkpoint is not trusted: every reason ``certify`` gives, with what it means.

    A ``str`` (``Reason.CORRUPT == "corrupt"``), so verdicts print and serialize as plain text.
    ``docs/trust.md`` tabulates them, each with the rule it belongs to (a test checks both lists).
    """

    CORRUPT = "corrupt"  # rule 1: the bytes do not verify
    TAMPERED = "tampered"  # the branch's ledger chain is broken at or before its step
    FINGERPRINT_MISMATCH = "fingerprint-mismatch"  # rule 2: not the weights the replicas agreed on
    NO_CONSENSUS = "no-consensus"  # rule 2: no fingerprint agreement recorded at its step
    AWAITING_AUDIT = "awaiting-audit"  # rule 3: the audit that would vouch for it has not run yet
    AFTER_FAULT = "after-fault"  # rules 3, 4: an uncontained detection covers its step
    TAINTED_PARENT = "tainted-parent"  # rule 5: a checkpoint it descends from is not trusted
    REVOKED = "revoked"  # rule 5: someone revoked it (or an ancestor)
    SUPERSEDED = "superseded"  # a resume forked before it: its audit will never come
    DEVICE_CONVICTED = "device-convicted"  # a step of its unaudited interval ran on a convicted device

    def __str__(self) -> str:
        return self.value

    @property
    def pending(self) -> bool:
        """Only evidence missing, nothing against the file: a checkpoint whose own reasons are all
        pending can still be verified."""
        return self in (Reason.NO_CONSENSUS, Reason.AWAITING_AUDIT)


REASONS = tuple(r.value for r in Reason)
PENDING_REASONS = frozenset(r for r in Reason if r.pending)
_NO_MARK = 1 << 62  # a branch whose chain is intact


class Level(str, Enum):
    """How far a checkpoint got: ``trusted`` > ``verified`` > ``suspect`` (the default)."""

    SUSPECT = "suspect"
    VERIFIED = "verified"
    TRUSTED = "trusted"

    @property
    def rank(self) -> int:
        """0 suspect, 1 verified, 2 trusted: a higher rank is more evidence, never less."""
        return _RANK[self]


_RANK = {Level.SUSPECT: 0, Level.VERIFIED: 1, Level.TRUSTED: 2}


def accept_level(accept: str | Level) -> Level:
    """The lowest level a caller takes (``latest-good --accept``), checked like user input.

    Raises:
        ConfigurationError: not ``trusted`` or ``verified`` (suspect is never accepted).
    """
    if accept in (Level.TRUSTED, Level.VERIFIED):
        return Level(accept)
    raise ConfigurationError(f"accept {accept!r}: use 'trusted' (the default) or 'verified'")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointEntry:
    """A committed checkpoint, as its commit record describes it.

    Attributes:
        ckpt_id: unique id within the run store (``<branch>@<step>``).
        branch: line of training.
        step: optimizer step of the weights.
        parent: ckpt_id the branch resumed from (its fork point), None for the first branch.
        consensus_fp: weight fingerprint embedded in the file (None: saved without the auditor).
        committed_at: commit time (seconds since the epoch), to order ties.
        url: where the file is.
    """

    ckpt_id: str
    branch: str
    step: int
    parent: str | None = None
    consensus_fp: str | None = None
    committed_at: float = 0.0
    url: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Revocation:
    """A checkpoint revoked by an operator. Any revocation demotes (it only counts against trust);
    ``authenticated`` says whether a trusted writer's intact chain vouches for it, which is what
    anything destructive (a vault prune) requires before acting on it."""

    ckpt_id: str
    reason: str
    by: str = ""
    at: float = 0.0
    authenticated: bool = True


@dataclass(frozen=True, slots=True)
class Verdict:
    """One checkpoint's verdict.

    Attributes:
        trusted: rules 1-5 hold (audit evidence vouches for it).
        reasons: why it is not trusted (empty when it is).
        verified: at least verified (bytes, records and lineage intact, nothing against it);
            always True when ``trusted``.
    """

    trusted: bool
    reasons: tuple[str, ...] = ()
    verified: bool = False

    def __post_init__(self) -> None:
        # Only members of Reason, whoever builds one (an unknown string raises ValueError here)
        object.__setattr__(self, "reasons", tuple(Reason(r) for r in self.reasons))
        if self.trusted and not self.verified:  # trusted implies verified, whoever builds one
            object.__setattr__(self, "verified", True)

    @property
    def level(self) -> Level:
        if self.trusted:
            return Level.TRUSTED
        return Level.VERIFIED if self.verified else Level.SUSPECT

    @property
    def label(self) -> str:
        return self.level.value


@dataclass(frozen=True, kw_only=True, slots=True)
class Detection:
    """An uncontained (or contained) failed check and the interval it makes suspect.

    Attributes:
        interval: ``(c, d]``: c the last clean audit point before d on the branch (or the branch's
            start), d the detection step. Empty for contained detections.
        rollback_window: ``d - c`` updates (0 when contained).
    """

    branch: str
    step: int
    kind: str
    suspect_ranks: tuple[int, ...]
    contained: bool
    last_clean: int
    interval: tuple[int, int] | None
    rollback_window: int


@dataclass(kw_only=True, slots=True)
class Certification:
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    detections: list[Detection] = field(default_factory=list)
    order: list[str] = field(default_factory=list)  # trusted ids, best first (latest-good candidates)
    verified_order: list[str] = field(default_factory=list)  # verified, not trusted, best first

    @property
    def latest_good(self) -> str | None:
        return self.order[0] if self.order else None

    def candidates(self, accept: str | Level = Level.TRUSTED) -> list[str]:
        """Latest-good candidates, best first, for the lowest level the caller accepts.

        Every trusted checkpoint comes before every verified one, whatever their steps: accepting
        verified widens the choice, it never lets a verified checkpoint outrank a trusted one.
        """
        if accept_level(accept) is Level.TRUSTED:
            return list(self.order)
        return [*self.order, *self.verified_order]


class _Branch:
    """Per-branch audit facts, indexed for bisection."""

    def __init__(self, base: int):
        self.base = base  # step the branch starts from (its parent's step, or 0)
        self.facts = BranchFacts()
        self.failures: list[tuple[int, str, tuple[int, ...], bool]] = []  # (step, kind, suspects, contained)

    def index(self) -> None:
        mask = self.facts.mask
        full = sorted(s for s, m in mask.items() if m & SEEN_ALL == SEEN_ALL)
        self.full_steps = full
        self.full_passed = [not mask[s] & FAILED_ANY for s in full]
        self.clean = [s for s, ok in zip(full, self.full_passed) if ok]
        self.uncontained = sorted(s for s, _, _, contained in self.failures if not contained)

    def last_clean_before(self, d: int) -> int:
        i = bisect.bisect_left(self.clean, d)
        return self.clean[i - 1] if i else self.base


def certify(
    checkpoints: Sequence[CheckpointEntry],
    events: Iterable[object] | AuditFacts,
    revocations: Iterable[Revocation] = (),
    *,
    corrupt: Iterable[str] = (),
    branch_parents: dict[str, str] | None = None,
    tampered: Mapping[str, int] | None = None,
    convicted: Mapping[str, Sequence[tuple[int, int | None]]] | None = None,
    unproven_after: Mapping[str, int] | None = None,
) -> Certification:
    """Verdicts for every checkpoint, the detections with their suspect intervals, latest-good order.

    Args:
        checkpoints: committed checkpoints (uncommitted files never reach the certifier).
        events: audit events (``AuditEvent`` or their dicts) of every branch, or their ``AuditFacts``
            folded already.
        revocations: revoked checkpoint ids.
        corrupt: ids whose bytes failed verification.
        branch_parents: per branch, the checkpoint it resumed from (so a branch's suspect intervals
            start at its fork point even before its first checkpoint).
        tampered: per branch, the last step its ledger chain proves intact: what is missing past it
            may be a failure whose suspect interval reaches back to the last clean audit point at or
            before that step, so every checkpoint after that point is ``tampered``; the key ``"*"``
            marks every branch (a store-wide record, such as a revocation, may be missing).
        convicted: per branch, the step ranges ``(lo, hi]`` (hi None: open-ended) that a device a
            fleet registry convicts computed: a checkpoint whose unaudited interval ``(c, s]`` (c its
            branch's last clean audit point before s) holds one of those steps is ``device-convicted``.
        unproven_after: per branch, the step after which the steps' devices cannot be vouched for (a
            fleet registry that cannot prove its convictions): a checkpoint after it is ``tampered``
            (no reach back: a conviction taints only what ran after the placement).

    Returns:
        A ``Certification``; ``latest_good`` is the trusted checkpoint with the greatest step (newest
        commit on ties). Callers re-verify its bytes and fall back along ``order``.
    """
    by_id = {c.ckpt_id: c for c in checkpoints}
    facts = events if isinstance(events, AuditFacts) else AuditFacts.of(events)
    branches = _branches(checkpoints, facts, _branch_bases(checkpoints, by_id, branch_parents or {}))
    out = Certification(detections=_detections(branches))

    revoked = {r.ckpt_id for r in revocations}
    own = _own_reasons_by_id(
        checkpoints, branches, set(corrupt), dict(tampered or {}), convicted or {}, dict(unproven_after or {})
    )

    # Lineage (rule 5): ancestors are the earlier checkpoints of the branch and the fork point with
    # its own ancestors. Resolved with memoisation; a cycle in bad data counts as tainted.
    by_branch = _by_branch(checkpoints)
    first_revoked = _first_revoked(by_branch, revoked)

    # Trust needs a trusted fork point; verified needs one with nothing against it but missing audits.
    trust_tainted = _lineage(by_id, own, revoked, first_revoked, lambda reasons: not reasons)
    verify_tainted = _lineage(by_id, own, revoked, first_revoked, lambda reasons: set(reasons) <= PENDING_REASONS)

    superseded = _superseded(by_branch, by_id, branch_parents or {})
    for c in checkpoints:
        out.verdicts[c.ckpt_id] = _verdict(
            c,
            own[c.ckpt_id],
            revoked=c.ckpt_id in revoked,
            trust_tainted=trust_tainted,
            verify_tainted=verify_tainted,
            superseded=c.ckpt_id in superseded,
        )

    out.order = _best_first(checkpoints, out.verdicts, Level.TRUSTED)
    out.verified_order = _best_first(checkpoints, out.verdicts, Level.VERIFIED)
    return out


def _branch_bases(
    checkpoints: Sequence[CheckpointEntry], by_id: Mapping[str, CheckpointEntry], branch_parents: Mapping[str, str]
) -> dict[str, int]:
    """Per branch, the step it starts from: its recorded fork point's, else its checkpoints' parent's
    (so a branch's suspect intervals start at its fork point even before its first checkpoint)."""
    bases: dict[str, int] = {}
    for name, parent in branch_parents.items():
        if parent in by_id:
            bases[name] = by_id[parent].step
    for c in checkpoints:
        if c.parent and c.parent in by_id:
            bases.setdefault(c.branch, by_id[c.parent].step)
    return bases


def _branches(
    checkpoints: Sequence[CheckpointEntry], facts: AuditFacts, bases: Mapping[str, int]
) -> dict[str, _Branch]:
    """Every branch the audit facts or the checkpoints name, with its facts indexed for bisection."""
    branches: dict[str, _Branch] = {}

    def branch(name: str) -> _Branch:
        if name not in branches:
            branches[name] = _Branch(bases.get(name, 0))
        return branches[name]

    for name, f in facts.effective().items():
        b = branch(name)
        b.facts, b.failures = f, list(f.failures)
    for c in checkpoints:
        branch(c.branch)
    for b in branches.values():
        b.index()
    return branches


def _detections(branches: Mapping[str, _Branch]) -> list[Detection]:
    """Every failed check, by branch then step, with the interval it makes suspect."""
    out: list[Detection] = []
    for name, b in sorted(branches.items()):
        for step, kind, suspects, contained in sorted(b.failures):
            clean = b.last_clean_before(step)
            out.append(
                Detection(
                    branch=name,
                    step=step,
                    kind=kind,
                    suspect_ranks=suspects,
                    contained=contained,
                    last_clean=clean,
                    interval=None if contained else (clean, step),
                    rollback_window=0 if contained else step - clean,
                )
            )
    return out


def _own_reasons_by_id(
    checkpoints: Sequence[CheckpointEntry],
    branches: Mapping[str, _Branch],
    corrupt: set[str],
    marks: Mapping[str, int],
    convicted: Mapping[str, Sequence[tuple[int, int | None]]],
    unproven: Mapping[str, int],
) -> dict[str, list[str]]:
    """Per checkpoint, the reasons of its own (rules 1-4, ``tampered`` past its branch's mark,
    ``device-convicted``), before lineage, revocation and supersession are considered."""
    own: dict[str, list[str]] = {}
    for c in checkpoints:
        b = branches[c.branch]
        own[c.ckpt_id] = _own_reasons(c, b, corrupt)
        ranges = convicted.get(c.branch)
        if ranges and unaudited_overlap(ranges, last_clean=b.last_clean_before(c.step), step=c.step):
            own[c.ckpt_id].append(Reason.DEVICE_CONVICTED)
        mark = min(marks.get(c.branch, _NO_MARK), marks.get("*", _NO_MARK))
        # What is missing past the mark may be a failure whose suspect interval reaches back to the
        # last clean audit point the intact chain proves: a checkpoint after that point is in doubt
        # too, though its own commit was sealed before the break.
        reach = mark if mark < 0 or mark == _NO_MARK else min(mark, b.last_clean_before(mark + 1))
        if c.step > reach or c.step > min(unproven.get(c.branch, _NO_MARK), unproven.get("*", _NO_MARK)):
            own[c.ckpt_id].append(Reason.TAMPERED)
    return own


def _by_branch(checkpoints: Sequence[CheckpointEntry]) -> dict[str, list[CheckpointEntry]]:
    """Each branch's checkpoints in step order (commit time on ties)."""
    by_branch: dict[str, list[CheckpointEntry]] = defaultdict(list)
    for c in checkpoints:
        by_branch[c.branch].append(c)
    for lst in by_branch.values():
        lst.sort(key=lambda c: (c.step, c.committed_at))
    return by_branch


def _first_revoked(
    by_branch: Mapping[str, list[CheckpointEntry]], revoked: set[str]
) -> dict[str, tuple[int, float] | None]:
    """The first revoked checkpoint of each branch, as ``(step, committed_at)``: every later one on the
    branch descends from it."""
    return {
        name: next(((c.step, c.committed_at) for c in lst if c.ckpt_id in revoked), None)
        for name, lst in by_branch.items()
    }


def _lineage(
    by_id: Mapping[str, CheckpointEntry],
    own: Mapping[str, list[str]],
    revoked: set[str],
    first_revoked: Mapping[str, tuple[int, float] | None],
    parent_ok: Callable[[list[str]], bool],
) -> Callable[[str], bool]:
    """Whether a checkpoint's lineage is tainted: itself or an earlier checkpoint of its branch
    revoked, or a fork point it descends from failing ``parent_ok`` (on the fork point's own
    reasons but ``corrupt``: damage after the fork did not feed the new branch)."""
    memo: dict[str, bool] = {}

    def decided(cid: str) -> bool | None:
        """The answer from the checkpoint itself and its fork point, or None: its parent's."""
        c = by_id[cid]
        fr = first_revoked[c.branch]
        if cid in revoked or (fr is not None and fr < (c.step, c.committed_at)):
            return True
        if not c.parent:
            return False
        p = by_id.get(c.parent)
        if p is None:
            return True  # descends from a checkpoint the store does not know
        return True if not parent_ok([r for r in own[p.ckpt_id] if r != Reason.CORRUPT]) else None

    def tainted(cid: str) -> bool:
        # Up the parents iteratively: a store may hold a fork chain of any depth (a recursion would
        # let a hostile one end the certifier with RecursionError).
        path: list[str] = []
        seen: set[str] = set()
        cur = cid
        while True:
            if cur in memo:
                answer = memo[cur]
                break
            if cur in seen:
                answer = True  # a cycle in bad data counts as tainted
                break
            seen.add(cur)
            here = decided(cur)
            if here is not None:
                memo[cur] = answer = here
                break
            path.append(cur)
            parent = by_id[cur].parent
            assert parent is not None  # decided() answers for a checkpoint without one
            cur = parent
        for node in path:
            memo[node] = answer
        return memo.get(cid, answer)

    return tainted


def _verdict(
    c: CheckpointEntry,
    own: list[str],
    *,
    revoked: bool,
    trust_tainted: Callable[[str], bool],
    verify_tainted: Callable[[str], bool],
    superseded: bool,
) -> Verdict:
    """One checkpoint's verdict from its own reasons, its lineage, a revocation and a resume."""
    reasons = list(own)
    verified = set(reasons) <= PENDING_REASONS and not verify_tainted(c.ckpt_id)
    if revoked:
        reasons.append(Reason.REVOKED)
    elif trust_tainted(c.ckpt_id):
        reasons.append(Reason.TAINTED_PARENT)
    if reasons and set(reasons) <= PENDING_REASONS and superseded:
        # abandoned work awaiting evidence that will never come: the run went on from an
        # earlier checkpoint before this one was proven (one condemned already needs no more)
        reasons.append(Reason.SUPERSEDED)
        verified = False
    return Verdict(not reasons, tuple(dict.fromkeys(reasons)), verified)


def _best_first(checkpoints: Sequence[CheckpointEntry], verdicts: Mapping[str, Verdict], level: Level) -> list[str]:
    """Ids of the checkpoints at exactly ``level``, greatest step first (newest commit on ties)."""
    chosen = [c for c in checkpoints if verdicts[c.ckpt_id].level is level]
    chosen.sort(key=lambda c: (c.step, c.committed_at), reverse=True)
    return [c.ckpt_id for c in chosen]


def _superseded(
    by_branch: Mapping[str, list[CheckpointEntry]],
    by_id: Mapping[str, CheckpointEntry],
    branch_parents: Mapping[str, str],
) -> set[str]:
    """Checkpoints a resume left behind (rule 6): a branch that forks from ``P@s`` supersedes every
    checkpoint of ``P``'s branch after ``s``. Only those not trusted lose anything (the caller adds
    the reason to checkpoints that have one already): their audit will never come."""
    forks = dict(branch_parents)
    for c in by_id.values():
        if c.parent:
            forks.setdefault(c.branch, c.parent)
    out: set[str] = set()
    for child, parent in forks.items():
        p = by_id.get(parent)
        if p is None or p.branch == child:
            continue
        out.update(c.ckpt_id for c in by_branch.get(p.branch, []) if c.step > p.step)
    return out


def _own_reasons(c: CheckpointEntry, b: _Branch, corrupt: set[str]) -> list[str]:
    reasons: list[str] = []
    s = c.step
    if c.ckpt_id in corrupt:
        reasons.append(Reason.CORRUPT)
    # rule 2: the weights every replica agreed on at s
    cons = b.facts.consensus(s)
    if cons is None or cons[0] != "pass" or cons[1] is None or c.consensus_fp is None:
        reasons.append(Reason.NO_CONSENSUS)  # (a digest-only agreement, at an audit, names no fingerprint)
    elif cons[1] != c.consensus_fp:
        reasons.append(Reason.FINGERPRINT_MISMATCH)
    # rule 3: the first full audit at or after s passed, no failure from s up to it
    i = bisect.bisect_left(b.full_steps, s)
    t = b.full_steps[i] if i < len(b.full_steps) else None
    j = bisect.bisect_left(b.uncontained, s)
    first_failure = b.uncontained[j] if j < len(b.uncontained) else None
    if first_failure is not None and (t is None or first_failure <= t):
        reasons.append(Reason.AFTER_FAULT)
    elif t is None:
        reasons.append(Reason.AWAITING_AUDIT)
    elif not b.full_passed[i]:
        reasons.append(Reason.AFTER_FAULT)
    # rule 4: once a fault reaches the weights, all after the last clean audit point descends from
    # it; the earliest detection has the earliest such point (last_clean_before is monotone)
    if b.uncontained and b.last_clean_before(b.uncontained[0]) < s and Reason.AFTER_FAULT not in reasons:
        reasons.append(Reason.AFTER_FAULT)
    return reasons
