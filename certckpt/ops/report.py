"""``certckpt report``: the run timeline (``certckpt.ops.timeline``) written as a picture or a page.

``render(timeline, path)`` draws it (``.png``, ``.svg``) or writes a self-contained HTML page
(``.html``: the picture inline as SVG, plus tables of the verdicts and the detections).

``.svg`` and ``.html`` are drawn by ``certckpt.ops.timeline_svg`` (standard library only), so the
base install can draw a report. ``.png`` is drawn with matplotlib, an optional extra
(``pip install 'certckpt[report]'``) imported only then; both drawings share a palette and wording.
No torch import.
"""

from __future__ import annotations

import html
import io
import os
from typing import TYPE_CHECKING, Any

from certckpt.errors import ConfigurationError, MissingDependencyError
from certckpt.storage import write_atomic

from .timeline import (
    DRILL,
    GOLD,
    GREEN,
    GREY,
    ORANGE,
    RED,
    TEAL,
    AuditMark,
    CheckpointMark,
    DetectionMark,
    DrillMark,
    Lane,
    Timeline,
    detection_label,
    headline,
    interval_label,
    timeline,
)
from .timeline_svg import svg

if TYPE_CHECKING:  # for annotations only: matplotlib is an optional extra, imported when a .png is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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
    "check_format",
]

FORMATS = (".png", ".svg", ".html")
DPI = 150


def _text(s: Any) -> str:
    """Plain text for matplotlib (a ``$`` would start mathtext)."""
    return str(s).replace("\\", "\\\\").replace("$", r"\$")


def _figure(tl: Timeline) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise MissingDependencyError(
            f"a .png report needs matplotlib: pip install 'certckpt[report]' (.svg and .html need nothing more) ({e})"
        ) from e

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
        _draw_intervals(ax, lane, y)
        ax.plot([lane.start, lane.end], [y, y], color="#5a5a5a", linewidth=1.6, solid_capstyle="round", zorder=1)
        _draw_fork(ax, lane, y, ckpt_y=ckpt_y, ms=ms)
        _draw_checks(ax, lane, y)
        _draw_detections(ax, lane, y, close=close)
        _draw_checkpoints(ax, lane, y, ms=ms)
        _draw_drills(ax, lane, y)
        _draw_latest_good(ax, lane, y, ms=ms)

    ax.set_yticks([ys[lane.branch] for lane in lanes], [_text(lane.branch) for lane in lanes], fontsize=10)
    ax.set_ylim(-0.95, n - 0.15)
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(
        MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10], nbins=min(20, max(4, int(width * 1.2))))
    )
    ax.set_xlabel("optimizer step")
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    title, sub = headline(tl)
    ax.set_title(_text(title), fontsize=12, fontweight="bold", loc="left", pad=26)
    ax.text(0, 1.02, _text(sub), transform=ax.transAxes, fontsize=9.5, color="#333333", ha="left", va="bottom")

    _legend(ax, drills=any(lane.drills for lane in lanes), width=width, height=height)
    fig.tight_layout()
    return fig


def _draw_intervals(ax: Axes, lane: Lane, y: float) -> None:
    """Suspect intervals: a band on the lane, with the rollback window written in it."""
    for a, b in lane.intervals:
        ax.fill_between([a, b], y - 0.36, y + 0.36, color=RED, alpha=0.13, linewidth=0, zorder=0)
        ax.plot([a, a], [y - 0.36, y + 0.36], color=RED, alpha=0.35, linewidth=0.8, linestyle=":", zorder=0)
        ax.text(
            (a + b) / 2,
            y + 0.33,
            _text(interval_label(a, b)),
            ha="center",
            va="top",
            fontsize=7.5,
            color="#a01010",
            zorder=1,
        )


def _draw_fork(ax: Axes, lane: Lane, y: float, *, ckpt_y: dict[str, int], ms: float) -> None:
    """A fork: an arrow from the parent checkpoint to the start of this lane, and its name."""
    if lane.parent is not None and lane.fork_step is not None:
        py = ckpt_y.get(lane.parent)
        if py is not None and py != y:
            ax.annotate(
                "",
                xy=(lane.fork_step, y),
                xytext=(lane.fork_step, py),
                arrowprops=dict(
                    arrowstyle="-|>",
                    color="#555555",
                    linestyle="--",
                    linewidth=1.1,
                    shrinkA=ms * 0.55,
                    shrinkB=2,
                    connectionstyle="arc3,rad=0",
                ),
                zorder=1,
            )
        ax.text(
            lane.fork_step,
            y - 0.08,
            _text(f"forked from {lane.parent} "),
            fontsize=7.5,
            color="#444444",
            ha="right",
            va="top",
            style="italic",
            zorder=3,
        )


def _draw_checks(ax: Axes, lane: Lane, y: float) -> None:
    # checks below the lane, one mark per step: a tick for a passed audit (a replay ran), a dot
    # for a step whose only passing checks were the consensus or the non-finite summary, a
    # black X for a failed check of any kind
    steps: dict[int, bool] = {}
    replayed: set[int] = set()
    for a in lane.audits:
        steps[a.step] = steps.get(a.step, False) or a.outcome == "fail"
        if a.kind == "replay" and a.outcome != "fail":
            replayed.add(a.step)
    passed = [s for s, failed in steps.items() if not failed and s in replayed]
    checked = [s for s, failed in steps.items() if not failed and s not in replayed]
    failed = [s for s, failed in steps.items() if failed]
    if passed:
        ax.plot(passed, [y - 0.22] * len(passed), linestyle="none", marker="|", markersize=8, color=GREY, zorder=2)
    if checked:
        ax.plot(checked, [y - 0.22] * len(checked), linestyle="none", marker=".", markersize=4, color=GREY, zorder=2)
    if failed:
        ax.plot(failed, [y - 0.22] * len(failed), linestyle="none", marker="X", markersize=6.5, color="black", zorder=4)


def _draw_detections(ax: Axes, lane: Lane, y: float, *, close: float) -> None:
    # detections: a red line across the lane, with the kind and the ranks it names
    # (uncontained labels above the lane, contained ones below; neighbours staggered)
    last: dict[bool, tuple[float, int]] = {}
    for d in lane.detections:
        color = ORANGE if d.contained else RED
        ax.plot(
            [d.step, d.step],
            [y - 0.42, y + 0.42],
            color=color,
            linewidth=2.2,
            linestyle="--" if d.contained else "-",
            zorder=3,
        )
        label = detection_label(d)
        prev = last.get(d.contained)
        level = (prev[1] + 1) % 3 if prev is not None and d.step - prev[0] < close else 0
        last[d.contained] = (d.step, level)
        if d.contained:
            ax.text(
                d.step,
                y - 0.45 - 0.13 * level,
                _text(label),
                ha="center",
                va="top",
                fontsize=7.5,
                color="#c47a00",
                fontweight="bold",
                zorder=5,
            )
        else:
            ax.text(
                d.step,
                y + 0.45 + 0.13 * level,
                _text(label),
                ha="center",
                va="bottom",
                fontsize=8,
                color=color,
                fontweight="bold",
                zorder=5,
            )


def _draw_checkpoints(ax: Axes, lane: Lane, y: float, *, ms: float) -> None:
    """Checkpoints, coloured by verdict; hollow when the file is gone."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for c in lane.checkpoints:
        color = GREEN if c.verdict == "trusted" else TEAL if c.verdict == "verified" else ORANGE if c.pending else RED
        groups.setdefault((color, c.held), []).append(c.step)
    for (color, held), xs in groups.items():
        ax.plot(
            xs,
            [y] * len(xs),
            linestyle="none",
            marker="o",
            markersize=ms,
            markerfacecolor=color if held else "white",
            markeredgecolor="white" if held else color,
            markeredgewidth=0.8 if held else 1.8,
            zorder=4,
        )


def _draw_drills(ax: Axes, lane: Lane, y: float) -> None:
    """Restore drills above the lane, filled by outcome."""
    for dr in lane.drills:
        if dr.step is None:
            continue
        ax.plot(
            [dr.step],
            [y + 0.2],
            linestyle="none",
            marker="D",
            markersize=5.5,
            markerfacecolor=DRILL.get(dr.outcome, "white"),
            markeredgecolor="#1f77b4",
            zorder=5,
        )


def _draw_latest_good(ax: Axes, lane: Lane, y: float, *, ms: float) -> None:
    """A gold star on the lane's latest-good checkpoint, with its name below."""
    lg = next((c for c in lane.checkpoints if c.latest_good), None)
    if lg is not None:
        ax.plot(
            [lg.step],
            [y],
            linestyle="none",
            marker="*",
            markersize=ms * 2.0,
            markerfacecolor=GOLD,
            markeredgecolor="black",
            markeredgewidth=0.8,
            zorder=6,
        )
        ax.annotate(
            _text(f"latest-good {lg.ckpt_id}"),
            xy=(lg.step, y),
            xytext=(0, -22),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=8.5,
            fontweight="bold",
            color="#333333",
            bbox=dict(boxstyle="round,pad=0.25", facecolor="#fff6c2", edgecolor=GOLD, linewidth=0.8),
            arrowprops=dict(arrowstyle="-", color="#888888", linewidth=0.8),
            zorder=6,
        )


def _legend(ax: Axes, *, drills: bool, width: float, height: float) -> None:
    """The legend under the picture (a restore drill's entry only when there is one)."""
    # matplotlib is imported already: _figure, the only caller, imported it or said how to install it
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Line2D(
            [],
            [],
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor=GREEN,
            markeredgecolor="white",
            label="checkpoint: trusted",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor=RED,
            markeredgecolor="white",
            label="suspect (fault, lineage, revoked)",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor=TEAL,
            markeredgecolor="white",
            label="verified (intact; no audit evidence yet)",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="o",
            markersize=9,
            markerfacecolor="white",
            markeredgecolor=GREY,
            markeredgewidth=1.8,
            label="hollow: file pruned / not held",
        ),
        Line2D(
            [],
            [],
            linestyle="none",
            marker="*",
            markersize=14,
            markerfacecolor=GOLD,
            markeredgecolor="black",
            label="latest-good",
        ),
        Line2D(
            [], [], linestyle="none", marker="|", markersize=8, color=GREY, label="audit passed (replay + consensus)"
        ),
        Line2D(
            [], [], linestyle="none", marker=".", markersize=5, color=GREY, label="consensus only passed (no replay)"
        ),
        Line2D([], [], linestyle="none", marker="X", markersize=7, color="black", label="check failed"),
        Line2D([], [], color=RED, linewidth=2.2, label="detection (ranks named)"),
        Line2D([], [], color=ORANGE, linewidth=2.2, linestyle="--", label="contained detection"),
        Patch(facecolor=RED, alpha=0.18, label="suspect interval (c, d]"),
        Line2D([], [], color="#555555", linestyle="--", linewidth=1.1, label="fork (resume from checkpoint)"),
    ]
    if drills:
        handles.append(
            Line2D(
                [],
                [],
                linestyle="none",
                marker="D",
                markersize=6,
                markerfacecolor=DRILL["pass"],
                markeredgecolor="#1f77b4",
                label="restore drill (blue: passed, black: failed)",
            )
        )
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.68 / max(height - 2.0, 1.0)),
        ncol=min(6, max(3, int(width // 3.2))),
        fontsize=8,
        frameon=False,
        handlelength=1.6,
        columnspacing=1.4,
    )


def _png_bytes(tl: Timeline) -> bytes:
    fig = _figure(tl)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.2, facecolor="white")
    return buf.getvalue()


# --- the page (.html) -------------------------------------------------------------------------------


def _html(tl: Timeline) -> str:
    """A self-contained page: the picture inline as SVG (no matplotlib, no external file), then tables."""
    e = html.escape
    rows = []
    for lane in tl.lanes:
        for c in lane.checkpoints:
            state = "pruned" if c.pruned else ("held" if c.held else "not held here")
            cls = {"trusted": "ok", "verified": "verified"}.get(c.verdict, "bad")
            star = " &#9733;" if c.latest_good else ""
            why = e(", ".join(c.reasons) or "-") + (f" ({e(c.note)})" if c.note else "")
            rows.append(
                f'<tr class="{cls}"><td>{e(c.ckpt_id)}{star}</td><td>{e(lane.branch)}</td>'
                f"<td>{c.step}</td><td>{e(c.verdict)}</td><td>{why}</td><td>{e(state)}</td></tr>"
            )
    dets = []
    for lane in tl.lanes:
        for d in lane.detections:
            iv = f"({d.interval[0]}, {d.interval[1]}]" if d.interval else "contained"
            ranks = ", ".join(map(str, d.suspect_ranks)) or "unknown"
            dets.append(
                f"<tr><td>{e(lane.branch)}</td><td>{d.step}</td><td>{e(d.kind)}</td>"
                f"<td>{e(ranks)}</td><td>{e(iv)}</td><td>{d.rollback_window}</td></tr>"
            )
    drills = [
        f"<li>{e(str(d.ckpt_id))} (step {e(str(d.step))}): restore drill {e(d.outcome)}</li>"
        for lane in tl.lanes
        for d in lane.drills
    ]
    forks = [
        f"<li>{e(lane.branch)} forked from {e(lane.parent)} at step {e(str(lane.fork_step))}</li>"
        for lane in tl.lanes
        if lane.parent is not None
    ]
    title = f"certckpt timeline: {tl.run or tl.store}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
figure {{ margin: 0; }}
figure svg {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }}
th {{ background: #f3f3f3; }}
tr.ok td:nth-child(4) {{ color: #2e7d32; font-weight: bold; }}
tr.bad td:nth-child(4) {{ color: #c62828; font-weight: bold; }}
tr.verified td:nth-child(4) {{ color: #117a8b; font-weight: bold; }}
</style></head><body>
<h1>{e(title)}</h1>
<p>store: <code>{e(tl.store)}</code><br>
latest-good: <strong>{e(tl.latest_good or "none")}</strong><br>{e(tl.summary())}</p>
<figure>
{svg(tl, standalone=False)}</figure>
<h2>Checkpoints</h2>
<table><thead><tr><th>checkpoint</th><th>branch</th><th>step</th><th>verdict</th><th>reasons</th><th>file</th></tr></thead>
<tbody>
{chr(10).join(rows) or '<tr><td colspan="6">no committed checkpoints</td></tr>'}
</tbody></table>
<h2>Detections</h2>
<table><thead><tr><th>branch</th><th>step</th><th>check</th><th>suspect ranks</th><th>suspect interval</th>
<th>rollback window</th></tr></thead>
<tbody>
{chr(10).join(dets) or '<tr><td colspan="6">none</td></tr>'}
</tbody></table>
{("<h2>Branches</h2><ul>" + "".join(forks) + "</ul>") if forks else ""}
{("<h2>Restore drills</h2><ul>" + "".join(drills) + "</ul>") if drills else ""}
</body></html>
"""


def check_format(out_path: str | os.PathLike) -> str:
    """The output format for a path (``.png``, ``.svg``, ``.html``); ConfigurationError for anything else."""
    suffix = os.path.splitext(os.fspath(out_path))[1].lower()
    if suffix == ".htm":
        suffix = ".html"
    if suffix not in FORMATS:
        raise ConfigurationError(
            f"{os.fspath(out_path)}: unsupported report format {suffix or '(none)'!r}; use .png, .svg or .html"
        )
    return suffix


def render(tl: Timeline, out_path: str | os.PathLike) -> str:
    """Draw the timeline to ``out_path`` (a local path); the format follows the suffix.

    Returns:
        The format written (``.png``, ``.svg`` or ``.html``).

    Raises:
        ValueError: another suffix.
        MissingDependencyError: ``.png`` and matplotlib is not installed (``.svg`` and ``.html`` never need it).
    """
    suffix = check_format(out_path)
    path = os.fspath(out_path)
    if suffix == ".png":
        data = _png_bytes(tl)
    elif suffix == ".svg":
        data = svg(tl).encode("utf-8")
    else:
        data = _html(tl).encode("utf-8")
    write_atomic(path, data)
    return suffix
