"""The run timeline behind ``certckpt report``: what the ledger says about a run, as one picture.

``timeline(status)`` is a pure function from a certified store (``runstore.certify_store``) to a
``Timeline``: per branch, its checkpoints with their verdicts, the audits, the detections, the
suspect intervals, the fork point and any restore drills. ``render(timeline, path)`` draws it
(``.png``, ``.svg``) or writes a self-contained HTML page (``.html``: the PNG inline plus tables).

matplotlib is an optional extra (``pip install 'certckpt[report]'``), imported only when drawing.
No torch import.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from certckpt.errors import MissingDependencyError
from certckpt.format.storage import write_atomic

__all__ = [
    "Timeline",
    "Lane",
    "CheckpointMark",
    "AuditMark",
    "DetectionMark",
    "DrillMark",
    "timeline",
    "render",
    "FORMATS",
]

FORMATS = (".png", ".svg", ".html")
DPI = 150
_PENDING = frozenset({"awaiting-audit", "no-consensus"})  # suspect for want of evidence, not for a fault
_AUDIT_KINDS = {"nonfinite-pre": "nonfinite", "nonfinite-post": "nonfinite"}


@dataclass(kw_only=True, slots=True)
class CheckpointMark:
    """One committed checkpoint on its lane.

    Attributes:
        held: this store still holds the file (not pruned by retention; in a vault, promoted here).
        pruned: a retention policy deleted the file (its verdict is still shown).
    """

    ckpt_id: str
    step: int
    verdict: str  # "trusted" | "suspect"
    reasons: tuple[str, ...] = ()
    held: bool = True
    pruned: bool = False
    latest_good: bool = False
    note: str = ""  # why, in words: the revocation's reason, the byte problem

    @property
    def pending(self) -> bool:
        """Suspect only for want of evidence (awaiting its audit, no consensus recorded)."""
        return self.verdict == "suspect" and bool(self.reasons) and set(self.reasons) <= _PENDING


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        n, m = len(self.checkpoints), len(self.detections)
        lanes = len(self.lanes)
        return (f"{n} checkpoint{'s' * (n != 1)} on {lanes} branch{'es' * (lanes != 1)}, "
                f"{m} detection{'s' * (m != 1)}, latest-good {self.latest_good or 'none'}")


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

    names: set[str] = {c.branch for c in snap.checkpoints} | {e["branch"] for e in snap.events} | set(snap.branch_parents)
    names |= {d.branch for d in cert.detections}
    lanes = {b: Lane(branch=b) for b in names}

    # fork points: the branch record, else a checkpoint whose parent lies on another branch
    for b, lane in lanes.items():
        parent = snap.branch_parents.get(b)
        if parent is None:
            parent = next((c.parent for c in sorted(snap.checkpoints, key=lambda c: c.step)
                           if c.branch == b and c.parent and (c.parent not in by_id or by_id[c.parent].branch != b)), None)
        if parent is not None:
            lane.parent = parent
            lane.fork_step = by_id[parent].step if parent in by_id else _step_of(parent)

    revoked: dict[str, list[str]] = {}
    for r in snap.revocations:
        revoked.setdefault(r.ckpt_id, []).append(f"revoked{' by ' + r.by if r.by else ''}: {r.reason}")
    for c in sorted(snap.checkpoints, key=lambda c: (c.step, c.committed_at)):
        v = cert.verdicts[c.ckpt_id]
        reasons = tuple(v.reasons)
        if c.ckpt_id in problems and "corrupt" not in reasons:
            reasons = ("corrupt", *reasons)
        notes = revoked.get(c.ckpt_id, []) + ([problems[c.ckpt_id]] if c.ckpt_id in problems else [])
        lanes[c.branch].checkpoints.append(CheckpointMark(
            ckpt_id=c.ckpt_id, step=c.step, verdict=v.label, reasons=reasons, held=snap.available(c.ckpt_id),
            pruned=c.ckpt_id in snap.retired, latest_good=c.ckpt_id == latest, note="; ".join(notes),
        ))

    audits: dict[tuple[str, int, str], str] = {}
    for e in snap.events:
        kind = _AUDIT_KINDS.get(e["kind"], e["kind"])
        key = (e["branch"], int(e["step"]), kind)
        if audits.get(key) != "fail":
            audits[key] = "fail" if e.get("outcome") == "fail" else "pass"
    for (b, step, kind), outcome in sorted(audits.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        lanes[b].audits.append(AuditMark(step=step, kind=kind, outcome=outcome))

    for d in sorted(cert.detections, key=lambda d: (d.step, d.kind)):
        lane = lanes[d.branch]
        lane.detections.append(DetectionMark(
            step=d.step, kind=d.kind, suspect_ranks=tuple(d.suspect_ranks), contained=d.contained,
            interval=tuple(d.interval) if d.interval else None, rollback_window=d.rollback_window,
        ))
        if d.interval and tuple(d.interval) not in lane.intervals:
            lane.intervals.append(tuple(d.interval))

    for doc in snap.drills:
        cid = doc.get("ckpt_id")
        b = by_id[cid].branch if cid in by_id else (cid.rpartition("@")[0] if cid and "@" in cid else None)
        if b is None:
            continue
        step = doc.get("step")
        if step is None and cid:
            step = by_id[cid].step if cid in by_id else _step_of(cid)
        lane = lanes.setdefault(b, Lane(branch=b))
        lane.drills.append(DrillMark(ckpt_id=cid, step=step, outcome=str(doc.get("outcome") or ("pass" if doc.get("passed") else "fail"))))

    for lane in lanes.values():
        steps = [c.step for c in lane.checkpoints] + [a.step for a in lane.audits] + [d.step for d in lane.detections]
        steps += [s for iv in lane.intervals for s in iv] + [d.step for d in lane.drills if d.step is not None]
        if lane.fork_step is not None:
            lane.start = lane.fork_step
            steps.append(lane.fork_step)
        else:
            lane.start = min(steps, default=0)
        lane.end = max(steps, default=lane.start)

    run = next((r.get("run") for r in snap.records.values() if r.get("run")), None)
    run = run or next((e.get("run") for e in snap.events if e.get("run")), None)
    return Timeline(store=status.store, run=run, latest_good=latest, lanes=_ordered(lanes, by_id))


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
        for lane in sorted(children.get(parent, []), key=lambda l: (l.fork_step if l.fork_step is not None else -1, l.branch != "main", l.branch)):
            if lane.branch not in seen:
                seen.add(lane.branch)
                out.append(lane)
                visit(lane.branch)

    visit(None)
    for lane in sorted(lanes.values(), key=lambda l: l.branch):  # cycles in bad data: still shown
        if lane.branch not in seen:
            seen.add(lane.branch)
            out.append(lane)
            visit(lane.branch)
    return out


# --- drawing ------------------------------------------------------------------------------------

_GREEN, _RED, _ORANGE, _GREY, _GOLD = "#2e9e44", "#d62728", "#f39c12", "#9a9a9a", "#f5c400"
_DRILL = {"pass": "#1f77b4", "fail": "#000000"}


def _text(s: Any) -> str:
    """Plain text for matplotlib (a ``$`` would start mathtext)."""
    return str(s).replace("\\", "\\\\").replace("$", r"\$")


def _ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "rank ?"
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _figure(tl: Timeline):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise MissingDependencyError(f"drawing a report needs matplotlib: pip install 'certckpt[report]' ({e})") from e

    lanes = tl.lanes
    lo = min((lane.start for lane in lanes), default=0)
    hi = max((lane.end for lane in lanes), default=lo + 1)
    hi = max(hi, lo + 1)
    marked = {c.step for lane in lanes for c in lane.checkpoints} | {a.step for lane in lanes for a in lane.audits}
    width = min(24.0, max(10.0, 6.0 + 0.14 * len(marked)))
    height = min(16.0, max(4.0, min(width * 0.2, 6.0), 2.6 + 1.2 * max(len(lanes), 1)))
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    n = max(len(lanes), 1)
    ys = {lane.branch: n - 1 - i for i, lane in enumerate(lanes)}  # first lane at the top
    ckpt_y = {c.ckpt_id: ys[lane.branch] for lane in lanes for c in lane.checkpoints}
    per_inch = max((len(lane.checkpoints) for lane in lanes), default=0) / max(width - 2.5, 1.0)
    ms = 11 if per_inch < 3 else 8 if per_inch < 8 else 5 if per_inch < 20 else 3
    pad = (hi - lo) * 0.03 + 0.5
    close = (hi - lo) * 2.6 / max(width - 2.5, 1.0)  # steps that one label spans, about

    for lane in lanes:
        y = ys[lane.branch]
        # suspect intervals: a band on the lane, with the rollback window written in it
        for a, b in lane.intervals:
            ax.fill_between([a, b], y - 0.36, y + 0.36, color=_RED, alpha=0.13, linewidth=0, zorder=0)
            ax.plot([a, a], [y - 0.36, y + 0.36], color=_RED, alpha=0.35, linewidth=0.8, linestyle=":", zorder=0)
            ax.text((a + b) / 2, y + 0.33, _text(f"suspect ({a}, {b}]: {b - a} updates"), ha="center", va="top", fontsize=7.5,
                    color="#a01010", zorder=1)
        ax.plot([lane.start, lane.end], [y, y], color="#5a5a5a", linewidth=1.6, solid_capstyle="round", zorder=1)
        # fork: from the parent checkpoint to the start of this lane
        if lane.parent is not None and lane.fork_step is not None:
            py = ckpt_y.get(lane.parent)
            if py is not None and py != y:
                ax.annotate("", xy=(lane.fork_step, y), xytext=(lane.fork_step, py),
                            arrowprops=dict(arrowstyle="-|>", color="#555555", linestyle="--", linewidth=1.1,
                                            shrinkA=ms * 0.55, shrinkB=2, connectionstyle="arc3,rad=0"), zorder=1)
            ax.text(lane.fork_step, y - 0.08, _text(f"forked from {lane.parent} "), fontsize=7.5, color="#444444",
                    ha="right", va="top", style="italic", zorder=3)
        # audits: small ticks below the lane, one per step (a failed check of any kind: black X)
        steps: dict[int, bool] = {}
        for a in lane.audits:
            steps[a.step] = steps.get(a.step, False) or a.outcome == "fail"
        passed = [s for s, failed in steps.items() if not failed]
        failed = [s for s, failed in steps.items() if failed]
        if passed:
            ax.plot(passed, [y - 0.22] * len(passed), linestyle="none", marker="|", markersize=7, color=_GREY, zorder=2)
        if failed:
            ax.plot(failed, [y - 0.22] * len(failed), linestyle="none", marker="X", markersize=6.5, color="black", zorder=4)
        # detections: a red line across the lane, with the kind and the ranks it names
        # (uncontained labels above the lane, contained ones below; neighbours staggered)
        last: dict[bool, tuple[float, int]] = {}
        for d in lane.detections:
            color = _ORANGE if d.contained else _RED
            ax.plot([d.step, d.step], [y - 0.42, y + 0.42], color=color, linewidth=2.2,
                    linestyle="--" if d.contained else "-", zorder=3)
            label = f"{d.kind} fail, {_ranks(d.suspect_ranks)}" + (", contained" if d.contained else "")
            prev = last.get(d.contained)
            level = (prev[1] + 1) % 3 if prev is not None and d.step - prev[0] < close else 0
            last[d.contained] = (d.step, level)
            if d.contained:
                ax.text(d.step, y - 0.45 - 0.13 * level, _text(label), ha="center", va="top", fontsize=7.5, color="#c47a00",
                        fontweight="bold", zorder=5)
            else:
                ax.text(d.step, y + 0.45 + 0.13 * level, _text(label), ha="center", va="bottom", fontsize=8, color=color,
                        fontweight="bold", zorder=5)
        # checkpoints, coloured by verdict; hollow when the file is gone
        groups: dict[tuple[str, bool], list[int]] = {}
        for c in lane.checkpoints:
            color = _GREEN if c.verdict == "trusted" else _ORANGE if c.pending else _RED
            groups.setdefault((color, c.held), []).append(c.step)
        for (color, held), xs in groups.items():
            ax.plot(xs, [y] * len(xs), linestyle="none", marker="o", markersize=ms, markerfacecolor=color if held else "white",
                    markeredgecolor="white" if held else color, markeredgewidth=0.8 if held else 1.8, zorder=4)
        for dr in lane.drills:
            if dr.step is None:
                continue
            ax.plot([dr.step], [y + 0.2], linestyle="none", marker="D", markersize=5.5,
                    markerfacecolor=_DRILL.get(dr.outcome, "white"), markeredgecolor="#1f77b4", zorder=5)
        lg = next((c for c in lane.checkpoints if c.latest_good), None)
        if lg is not None:
            ax.plot([lg.step], [y], linestyle="none", marker="*", markersize=ms * 2.0, markerfacecolor=_GOLD,
                    markeredgecolor="black", markeredgewidth=0.8, zorder=6)
            ax.annotate(_text(f"latest-good {lg.ckpt_id}"), xy=(lg.step, y), xytext=(0, -22), textcoords="offset points",
                        ha="center", va="top", fontsize=8.5, fontweight="bold", color="#333333",
                        bbox=dict(boxstyle="round,pad=0.25", facecolor="#fff6c2", edgecolor=_GOLD, linewidth=0.8),
                        arrowprops=dict(arrowstyle="-", color="#888888", linewidth=0.8), zorder=6)

    ax.set_yticks([ys[lane.branch] for lane in lanes], [_text(lane.branch) for lane in lanes], fontsize=10)
    ax.set_ylim(-0.95, n - 0.15)
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10], nbins=min(20, max(4, int(width * 1.2)))))
    ax.set_xlabel("optimizer step")
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    title = f"certckpt timeline — run {tl.run or os.path.basename(tl.store.rstrip('/')) or tl.store}"
    n_ck, dets = len(tl.checkpoints), tl.detections
    contained = sum(d.contained for d in dets)
    sub = (f"latest-good: {tl.latest_good or 'none'}   ·   {n_ck} checkpoint{'s' * (n_ck != 1)} on {len(lanes)} "
           f"branch{'es' * (len(lanes) != 1)}   ·   {len(dets)} detection{'s' * (len(dets) != 1)}"
           + (f" ({contained} contained)" if contained else ""))
    ax.set_title(_text(title), fontsize=12, fontweight="bold", loc="left", pad=26)
    ax.text(0, 1.02, _text(sub), transform=ax.transAxes, fontsize=9.5, color="#333333", ha="left", va="bottom")

    handles = [
        Line2D([], [], linestyle="none", marker="o", markersize=9, markerfacecolor=_GREEN, markeredgecolor="white", label="checkpoint: trusted"),
        Line2D([], [], linestyle="none", marker="o", markersize=9, markerfacecolor=_RED, markeredgecolor="white", label="suspect (fault, lineage, revoked)"),
        Line2D([], [], linestyle="none", marker="o", markersize=9, markerfacecolor=_ORANGE, markeredgecolor="white", label="suspect (awaiting evidence)"),
        Line2D([], [], linestyle="none", marker="o", markersize=9, markerfacecolor="white", markeredgecolor=_GREY, markeredgewidth=1.8, label="hollow: file pruned / not held"),
        Line2D([], [], linestyle="none", marker="*", markersize=14, markerfacecolor=_GOLD, markeredgecolor="black", label="latest-good"),
        Line2D([], [], linestyle="none", marker="|", markersize=8, color=_GREY, label="audit passed"),
        Line2D([], [], linestyle="none", marker="X", markersize=7, color="black", label="check failed"),
        Line2D([], [], color=_RED, linewidth=2.2, label="detection (ranks named)"),
        Line2D([], [], color=_ORANGE, linewidth=2.2, linestyle="--", label="contained detection"),
        Patch(facecolor=_RED, alpha=0.18, label="suspect interval (c, d]"),
        Line2D([], [], color="#555555", linestyle="--", linewidth=1.1, label="fork (resume from checkpoint)"),
    ]
    if any(lane.drills for lane in lanes):
        handles.append(Line2D([], [], linestyle="none", marker="D", markersize=6, markerfacecolor=_DRILL["pass"],
                              markeredgecolor="#1f77b4", label="restore drill (filled: passed)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.68 / max(height - 2.0, 1.0)),
              ncol=min(6, max(3, int(width // 3.2))), fontsize=8, frameon=False, handlelength=1.6, columnspacing=1.4)
    fig.tight_layout()
    return fig


def _png_bytes(tl: Timeline) -> bytes:
    fig = _figure(tl)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.2, facecolor="white")
    return buf.getvalue()


def _html(tl: Timeline, png: bytes) -> str:
    e = html.escape
    rows = []
    for lane in tl.lanes:
        for c in lane.checkpoints:
            state = "pruned" if c.pruned else ("held" if c.held else "not held here")
            cls = "ok" if c.verdict == "trusted" else "bad"
            rows.append(
                f"<tr class=\"{cls}\"><td>{e(c.ckpt_id)}{' &#9733;' if c.latest_good else ''}</td><td>{e(lane.branch)}</td>"
                f"<td>{c.step}</td><td>{e(c.verdict)}</td><td>{e(', '.join(c.reasons) or '-')}{(' (' + e(c.note) + ')') if c.note else ''}</td><td>{e(state)}</td></tr>"
            )
    dets = []
    for lane in tl.lanes:
        for d in lane.detections:
            iv = f"({d.interval[0]}, {d.interval[1]}]" if d.interval else "contained"
            dets.append(
                f"<tr><td>{e(lane.branch)}</td><td>{d.step}</td><td>{e(d.kind)}</td>"
                f"<td>{e(', '.join(map(str, d.suspect_ranks)) or 'unknown')}</td><td>{e(iv)}</td><td>{d.rollback_window}</td></tr>"
            )
    drills = [f"<li>{e(str(d.ckpt_id))} (step {e(str(d.step))}): restore drill {e(d.outcome)}</li>"
              for lane in tl.lanes for d in lane.drills]
    forks = [f"<li>{e(lane.branch)} forked from {e(lane.parent)} at step {e(str(lane.fork_step))}</li>"
             for lane in tl.lanes if lane.parent is not None]
    title = f"certckpt timeline: {tl.run or tl.store}"
    img = base64.b64encode(png).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
img {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
tr.ok td:nth-child(4) {{ color: #2e7d32; font-weight: bold; }}
tr.bad td:nth-child(4) {{ color: #c62828; font-weight: bold; }}
</style></head><body>
<h1>{e(title)}</h1>
<p>store: <code>{e(tl.store)}</code><br>latest-good: <strong>{e(tl.latest_good or 'none')}</strong><br>{e(tl.summary())}</p>
<img alt="{e(title)}" src="data:image/png;base64,{img}">
<h2>Checkpoints</h2>
<table><thead><tr><th>checkpoint</th><th>branch</th><th>step</th><th>verdict</th><th>reasons</th><th>file</th></tr></thead>
<tbody>
{chr(10).join(rows) or '<tr><td colspan="6">no committed checkpoints</td></tr>'}
</tbody></table>
<h2>Detections</h2>
<table><thead><tr><th>branch</th><th>step</th><th>check</th><th>suspect ranks</th><th>suspect interval</th><th>rollback window</th></tr></thead>
<tbody>
{chr(10).join(dets) or '<tr><td colspan="6">none</td></tr>'}
</tbody></table>
{('<h2>Branches</h2><ul>' + ''.join(forks) + '</ul>') if forks else ''}
{('<h2>Restore drills</h2><ul>' + ''.join(drills) + '</ul>') if drills else ''}
</body></html>
"""


def check_format(out_path: str | os.PathLike) -> str:
    """The output format for a path (``.png``, ``.svg``, ``.html``); ValueError for anything else."""
    suffix = os.path.splitext(os.fspath(out_path))[1].lower()
    if suffix == ".htm":
        suffix = ".html"
    if suffix not in FORMATS:
        raise ValueError(f"{os.fspath(out_path)}: unsupported report format {suffix or '(none)'!r}; use .png, .svg or .html")
    return suffix


def render(tl: Timeline, out_path: str | os.PathLike) -> str:
    """Draw the timeline to ``out_path`` (a local path); the format follows the suffix.

    Returns:
        The format written (``.png``, ``.svg`` or ``.html``).

    Raises:
        ValueError: another suffix. MissingDependencyError: matplotlib is not installed.
    """
    suffix = check_format(out_path)
    path = os.fspath(out_path)
    if suffix == ".png":
        data = _png_bytes(tl)
    elif suffix == ".svg":
        fig = _figure(tl)
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", bbox_inches="tight", pad_inches=0.2, facecolor="white")
        data = buf.getvalue()
    else:
        data = _html(tl, _png_bytes(tl)).encode("utf-8")
    write_atomic(path, data)
    return suffix
