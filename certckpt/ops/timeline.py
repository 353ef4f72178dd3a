"""The run timeline as data, and the words and colours every drawing of it uses.

``timeline(status)`` is a pure function from a certified store (``runstore.certify_store``) to a
``Timeline``: per branch, its checkpoints with their verdicts, the audits, the detections, the
suspect intervals, the fork point and any restore drills. ``certckpt.ops.timeline_svg`` draws it
(``certckpt.ops.report`` writes that drawing as SVG, HTML or PNG). No torch, no matplotlib.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from certckpt.trust.certify import PENDING_REASONS, Certification, CheckpointEntry, Detection, Reason
from certckpt.trust.coverage import Coverage, coverage
from certckpt.trust.records import check_family

if TYPE_CHECKING:  # for annotations only: the timeline reads a snapshot it is given
    from certckpt.trust.snapshot import LedgerSnapshot

__all__ = [
    "Timeline",
    "Lane",
    "CheckpointMark",
    "AuditMark",
    "DetectionMark",
    "DrillMark",
    "ConvictionMark",
    "conviction_label",
    "timeline",
    "headline",
    "detection_label",
    "interval_label",
    "ranks_text",
    "GREEN",
    "RED",
    "ORANGE",
    "GREY",
    "GOLD",
    "TEAL",
    "DRILL",
    "PURPLE",
]

# The palette of the drawing (the fleet chart's bars use it too).
GREEN, RED, ORANGE, GREY, GOLD = "#2e9e44", "#d62728", "#f39c12", "#9a9a9a", "#f5c400"
TEAL = "#17a2b8"  # verified: intact and committed, but no audit evidence (a run without the auditor)
PURPLE = "#7b3fa0"  # a device convicted in a fleet registry: the steps it computed on this lane
DRILL = {"pass": "#1f77b4", "fail": "#000000"}  # fill by outcome; anything else (incomplete) is hollow


@dataclass(kw_only=True, slots=True)
class CheckpointMark:
    """One committed checkpoint on its lane.

    Attributes:
        held: this store still holds the file (not pruned by retention; in a vault, promoted here).
        pruned: a retention policy deleted the file (its verdict is still shown).
    """

    ckpt_id: str
    step: int
    verdict: str  # "trusted" | "verified" | "suspect"
    reasons: tuple[str, ...] = ()
    held: bool = True
    pruned: bool = False
    latest_good: bool = False
    note: str = ""  # why, in words: the revocation's reason, the byte problem
    coverage: dict[str, Any] | None = None  # trust.coverage's figures (Coverage.to_json)
    coverage_text: str = ""  # the same in one line (the drawing's tooltip)

    @property
    def pending(self) -> bool:
        """Short of trust only for want of evidence (awaiting its audit, no consensus recorded).
        The certifier calls such a checkpoint verified when its bytes, records and lineage hold."""
        return self.verdict != "trusted" and bool(self.reasons) and set(self.reasons) <= PENDING_REASONS


@dataclass(kw_only=True, slots=True)
class AuditMark:
    """The checks of one kind at one step, summarised: a failure wins over any pass."""

    step: int
    kind: str  # nonfinite (pre and post folded in) | replay | consensus
    outcome: str  # pass | fail


@dataclass(kw_only=True, slots=True)
class DetectionMark:
    step: int
    kind: str
    suspect_ranks: tuple[int, ...] = ()
    contained: bool = False
    interval: tuple[int, int] | None = None  # (c, d]; None when contained
    rollback_window: int = 0


@dataclass(kw_only=True, slots=True)
class DrillMark:
    ckpt_id: str | None
    step: int | None
    outcome: str  # pass | fail | incomplete


@dataclass(kw_only=True, slots=True)
class ConvictionMark:
    """A device convicted in a fleet registry that computed steps ``(start, end]`` of this lane
    (``end`` None: to the lane's end), with the detection that convicted it (run, step, check)."""

    device: str
    start: int
    end: int | None
    rank: str = ""
    host: str = ""
    fleet: str = ""
    conviction_id: str = ""
    by_run: str | None = None
    by_step: int | None = None
    by_check: str | None = None
    incident_id: str | None = None


@dataclass(kw_only=True, slots=True)
class Lane:
    """One branch: a line of training from ``start`` to ``end``.

    Attributes:
        parent: the checkpoint the branch resumed from (None for a first branch).
        fork_step: that checkpoint's step (where the lane starts); None for a first branch.
        intervals: suspect intervals ``(from, to]`` of its uncontained detections.
    """

    branch: str
    parent: str | None = None
    fork_step: int | None = None
    start: int = 0
    end: int = 0
    checkpoints: list[CheckpointMark] = field(default_factory=list)
    audits: list[AuditMark] = field(default_factory=list)
    detections: list[DetectionMark] = field(default_factory=list)
    intervals: list[tuple[int, int]] = field(default_factory=list)
    drills: list[DrillMark] = field(default_factory=list)
    convictions: list[ConvictionMark] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Timeline:
    store: str
    run: str | None
    latest_good: str | None
    lanes: list[Lane] = field(default_factory=list)

    def lane(self, branch: str) -> Lane:
        return next(lane for lane in self.lanes if lane.branch == branch)

    @property
    def checkpoints(self) -> list[CheckpointMark]:
        return [c for lane in self.lanes for c in lane.checkpoints]

    @property
    def detections(self) -> list[DetectionMark]:
        return [d for lane in self.lanes for d in lane.detections]

    @property
    def convictions(self) -> list[ConvictionMark]:
        return [c for lane in self.lanes for c in lane.convictions]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        n, m = len(self.checkpoints), len(self.detections)
        lanes = len(self.lanes)
        return (
            f"{n} checkpoint{'s' * (n != 1)} on {lanes} branch{'es' * (lanes != 1)}, "
            f"{m} detection{'s' * (m != 1)}, latest-good {self.latest_good or 'none'}"
        )


# --- the pure part -------------------------------------------------------------------------------


def _step_of(ckpt_id: str) -> int | None:
    _, sep, step = ckpt_id.rpartition("@")
    try:
        return int(step) if sep else None
    except ValueError:
        return None


def timeline(status: Any) -> Timeline:
    """The timeline of a certified store (a ``runstore.StoreStatus``). Pure: reads nothing."""
    snap, cert = status.snapshot, status.certification
    by_id = {c.ckpt_id: c for c in snap.checkpoints}
    latest = status.latest_good
    problems = getattr(status, "problems", {}) or {}

    names: set[str] = (
        {c.branch for c in snap.checkpoints} | {e["branch"] for e in snap.events} | set(snap.branch_parents)
    )
    names |= {d.branch for d in cert.detections}
    lanes = {b: Lane(branch=b) for b in names}
    for b, lane in lanes.items():
        parent = _fork_point(snap, by_id, b)
        if parent is not None:
            lane.parent = parent
            lane.fork_step = by_id[parent].step if parent in by_id else _step_of(parent)

    cov = coverage(snap.checkpoints, snap.events, branch_parents=snap.branch_parents)
    _add_checkpoints(lanes, snap, cert, problems=problems, latest=latest, cov=cov)
    _add_audits(lanes, snap.events)
    _add_detections(lanes, cert.detections)
    _add_drills(lanes, snap.drills, by_id)
    _add_convictions(lanes, getattr(snap, "device_convictions", []))
    for lane in lanes.values():
        _set_extent(lane)

    run = next((r.get("run") for r in snap.records.values() if r.get("run")), None)
    run = run or next((e.get("run") for e in snap.events if e.get("run")), None)
    return Timeline(store=status.store, run=run, latest_good=latest, lanes=_ordered(lanes, by_id))


def _fork_point(snap: LedgerSnapshot, by_id: Mapping[str, CheckpointEntry], branch: str) -> str | None:
    """The checkpoint a branch resumed from: its branch record, else a checkpoint of it whose parent
    lies on another branch (the earliest)."""
    parent = snap.branch_parents.get(branch)
    if parent is None:
        parent = next(
            (
                c.parent
                for c in sorted(snap.checkpoints, key=lambda c: c.step)
                if c.branch == branch and c.parent and (c.parent not in by_id or by_id[c.parent].branch != branch)
            ),
            None,
        )
    return parent


def _add_checkpoints(
    lanes: dict[str, Lane],
    snap: LedgerSnapshot,
    cert: Certification,
    *,
    problems: Mapping[str, str],
    latest: str | None,
    cov: Mapping[str, Coverage],
) -> None:
    """Every checkpoint on its lane in step order, with its verdict and, in words, what is against it
    (a revocation's reason, a byte problem found now)."""
    revoked: dict[str, list[str]] = {}
    for r in snap.revocations:
        revoked.setdefault(r.ckpt_id, []).append(f"revoked{' by ' + r.by if r.by else ''}: {r.reason}")
    for c in sorted(snap.checkpoints, key=lambda c: (c.step, c.committed_at)):
        v = cert.verdicts[c.ckpt_id]
        reasons = tuple(v.reasons)
        if c.ckpt_id in problems and Reason.CORRUPT not in reasons:
            reasons = (Reason.CORRUPT, *reasons)
        notes = revoked.get(c.ckpt_id, []) + ([problems[c.ckpt_id]] if c.ckpt_id in problems else [])
        lanes[c.branch].checkpoints.append(
            CheckpointMark(
                ckpt_id=c.ckpt_id,
                step=c.step,
                verdict=v.label,
                reasons=reasons,
                held=snap.available(c.ckpt_id),
                pruned=c.ckpt_id in snap.retired,
                latest_good=c.ckpt_id == latest,
                note="; ".join(notes),
                coverage=cov[c.ckpt_id].to_json(),
                coverage_text=cov[c.ckpt_id].summary(),
            )
        )


def _add_audits(lanes: dict[str, Lane], events: list[dict[str, Any]]) -> None:
    """One mark per branch, step and kind of check (a failure wins over any pass)."""
    audits: dict[tuple[str, int, str], str] = {}
    for e in events:
        kind = check_family(e["kind"])
        key = (e["branch"], int(e["step"]), kind)
        if audits.get(key) != "fail":
            audits[key] = "fail" if e.get("outcome") == "fail" else "pass"
    for (b, step, kind), outcome in sorted(audits.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        lanes[b].audits.append(AuditMark(step=step, kind=kind, outcome=outcome))


def _add_detections(lanes: dict[str, Lane], detections: list[Detection]) -> None:
    """Every detection on its lane, and each distinct suspect interval once."""
    for d in sorted(detections, key=lambda d: (d.step, d.kind)):
        lane = lanes[d.branch]
        interval = (d.interval[0], d.interval[1]) if d.interval else None
        lane.detections.append(
            DetectionMark(
                step=d.step,
                kind=d.kind,
                suspect_ranks=tuple(d.suspect_ranks),
                contained=d.contained,
                interval=interval,
                rollback_window=d.rollback_window,
            )
        )
        if interval and interval not in lane.intervals:
            lane.intervals.append(interval)


def _add_drills(lanes: dict[str, Lane], drills: list[dict[str, Any]], by_id: Mapping[str, CheckpointEntry]) -> None:
    """Every restore drill on the lane of the checkpoint it restored (a lane of its own when the
    checkpoint's branch has none; a drill that names no checkpoint is left out)."""
    for doc in drills:
        cid: Any = doc.get("ckpt_id")  # any JSON: the reader does not check a drill record's fields
        b = by_id[cid].branch if cid in by_id else (cid.rpartition("@")[0] if cid and "@" in cid else None)
        if b is None:
            continue
        step = doc.get("step")
        if step is None and cid:
            step = by_id[cid].step if cid in by_id else _step_of(cid)
        lane = lanes.setdefault(b, Lane(branch=b))
        lane.drills.append(
            DrillMark(
                ckpt_id=cid, step=step, outcome=str(doc.get("outcome") or ("pass" if doc.get("passed") else "fail"))
            )
        )


def _int_or_none(v: Any) -> int | None:
    return v if type(v) is int else None


def _text_or_none(v: Any) -> str | None:
    return str(v)[:200] if isinstance(v, (str, int)) and not isinstance(v, bool) else None


def _add_convictions(lanes: dict[str, Lane], marks: Sequence[Mapping[str, Any]]) -> None:
    """Every convicted device's steps on the lane that ran them (from the fleet registries the run's
    placements name; the evidence fields come from a registry: kept as short text or ints only)."""
    for m in marks:
        start, branch = _int_or_none(m.get("from")), m.get("branch")
        if start is None or not isinstance(branch, str):
            continue
        lane = lanes.setdefault(branch, Lane(branch=branch))
        lane.convictions.append(
            ConvictionMark(
                device=str(m.get("device")),
                start=start,
                end=_int_or_none(m.get("to")),
                rank=str(m.get("rank") or ""),
                host=str(m.get("host") or ""),
                fleet=str(m.get("fleet") or ""),
                conviction_id=str(m.get("conviction_id") or ""),
                by_run=_text_or_none(m.get("by_run")),
                by_step=_int_or_none(m.get("by_step")),
                by_check=_text_or_none(m.get("by_check")),
                incident_id=_text_or_none(m.get("incident_id")),
            )
        )


def _set_extent(lane: Lane) -> None:
    """Where a lane starts (its fork step, else its first mark) and ends (its last mark)."""
    steps = [c.step for c in lane.checkpoints] + [a.step for a in lane.audits] + [d.step for d in lane.detections]
    steps += [s for iv in lane.intervals for s in iv] + [d.step for d in lane.drills if d.step is not None]
    steps += [c.start for c in lane.convictions] + [c.end for c in lane.convictions if c.end is not None]
    if lane.fork_step is not None:
        lane.start = lane.fork_step
        steps.append(lane.fork_step)
    else:
        lane.start = min(steps, default=0)
    lane.end = max(steps, default=lane.start)


def _ordered(lanes: dict[str, Lane], by_id: dict[str, Any]) -> list[Lane]:
    """First branches first, each followed by the branches forked from it (by fork step)."""
    children: dict[str | None, list[Lane]] = {}
    for lane in lanes.values():
        parent_branch = None
        if lane.parent is not None:
            parent_branch = by_id[lane.parent].branch if lane.parent in by_id else lane.parent.rpartition("@")[0]
            if parent_branch not in lanes or parent_branch == lane.branch:
                parent_branch = None
        children.setdefault(parent_branch, []).append(lane)
    out: list[Lane] = []
    seen: set[str] = set()

    def visit(parent: str | None) -> None:
        for lane in sorted(
            children.get(parent, []),
            key=lambda ln: (ln.fork_step if ln.fork_step is not None else -1, ln.branch != "main", ln.branch),
        ):
            if lane.branch not in seen:
                seen.add(lane.branch)
                out.append(lane)
                visit(lane.branch)

    visit(None)
    for lane in sorted(lanes.values(), key=lambda ln: ln.branch):  # cycles in bad data: still shown
        if lane.branch not in seen:
            seen.add(lane.branch)
            out.append(lane)
            visit(lane.branch)
    return out


# --- the words of the drawing --------------------------------------------------------------------


def headline(tl: Timeline) -> tuple[str, str]:
    """The title and the subtitle of the picture (plain text, not escaped)."""
    title = f"certckpt timeline — run {tl.run or os.path.basename(tl.store.rstrip('/')) or tl.store}"
    n_ck, dets, n_lanes = len(tl.checkpoints), tl.detections, len(tl.lanes)
    contained = sum(d.contained for d in dets)
    sub = (
        f"latest-good: {tl.latest_good or 'none'}   ·   {n_ck} checkpoint{'s' * (n_ck != 1)} on {n_lanes} "
        f"branch{'es' * (n_lanes != 1)}   ·   {len(dets)} detection{'s' * (len(dets) != 1)}"
        + (f" ({contained} contained)" if contained else "")
    )
    devices = sorted({c.device for c in tl.convictions})
    if devices:  # the reason a run with no detection of its own can be all red
        convicted = sum("device-convicted" in c.reasons for c in tl.checkpoints)
        sub += (
            f"   ·   device{'s' * (len(devices) != 1)} {', '.join(devices[:3])}{' ...' if len(devices) > 3 else ''}"
            f" convicted by another run: {convicted} checkpoint{'s' * (convicted != 1)} suspect"
        )
    return title, sub


def conviction_label(c: ConvictionMark) -> str:
    """What a conviction band's label says: the device and the run and step that convicted it."""
    by = f"{c.by_check or 'a check'} at step {c.by_step if c.by_step is not None else '?'} of run {c.by_run or '?'}"
    return f"device {c.device} convicted ({by})"


def ranks_text(ranks: Sequence[int]) -> str:
    if not ranks:
        return "rank ?"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def detection_label(d: DetectionMark) -> str:
    """What a detection's label says: the check that failed and the ranks it named."""
    return f"{d.kind} fail, {ranks_text(d.suspect_ranks)}" + (", contained" if d.contained else "")


def interval_label(a: int, b: int) -> str:
    """What a suspect interval's label says."""
    return f"suspect ({a}, {b}]: {b - a} updates"
