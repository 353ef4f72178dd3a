"""``certckpt report``: the run timeline (``certckpt.ops.timeline``) written as a picture or a page.

``render(timeline, path)`` draws it (``.svg``, ``.png``) or writes a self-contained HTML page
(``.html``: the picture inline as SVG, plus tables of the verdicts and the detections).

There is one drawing, ``certckpt.ops.timeline_svg.picture`` (standard library only, so the base
install can draw a report): ``.svg`` and ``.html`` write it as SVG, and ``.png`` paints the same
drawing with matplotlib, an optional extra (``pip install 'certckpt[report]'``) imported only then.
No torch import.
"""

from __future__ import annotations

import os

from certckpt.errors import ConfigurationError
from certckpt.storage import write_atomic

from .drawing import escape, png
from .timeline import (
    AuditMark,
    CheckpointMark,
    DetectionMark,
    DrillMark,
    Lane,
    Timeline,
    timeline,
)
from .timeline_svg import picture, svg

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


# --- the page (.html) -------------------------------------------------------------------------------


def _html(tl: Timeline) -> str:
    """A self-contained page: the picture inline as SVG (no matplotlib, no external file), then tables
    (every string through the pictures' one escape)."""
    e = escape
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
        data = png(picture(tl), needs="a .png report", instead=".svg and .html need nothing more")
    elif suffix == ".svg":
        data = svg(tl).encode("utf-8")
    else:
        data = _html(tl).encode("utf-8")
    write_atomic(path, data)
    return suffix
