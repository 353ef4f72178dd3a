"""The run timeline drawn: one picture, written as SVG here and painted as PNG by ``certckpt.ops.report``.

``picture(timeline)`` draws what ``certckpt report`` shows: one lane per branch (first branches on
top, each followed by the branches forked from it), the fork from the parent checkpoint, the
checkpoints coloured by verdict (hollow when the file is gone), latest-good as a star with its id,
the audits under each lane (a failed check as a black X), the detections with the kind and the ranks
they name, the suspect intervals shaded, the steps a device convicted in a fleet registry computed
(a purple bar naming the device and the run and step that convicted it), the restore drills, a step
axis from step 0, a title and a legend of the marks the picture holds.
``svg(timeline)`` writes it as SVG with the standard library alone, so the base install can draw a
report (``.svg``, and inline in ``.html``); ``.png`` paints the same ``certckpt.ops.drawing`` tree with
matplotlib. The palette and the wording come from ``certckpt.ops.timeline``.

The text in a timeline (ids, branch names, notes, the run name) comes from a store that anyone with
write access to it may have written: it stays text (``drawing.escape``, which also replaces the
characters XML forbids). Labels are placed so that none overlaps another or a mark: text widths are
estimated from DejaVu Sans metrics (the font named first, and the one the PNG is painted in; the
fallbacks are narrower, so the estimate errs wide). The output is deterministic: the same timeline
gives the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.trust.records import EventKind

from .drawing import FONT, SVG_NS, Node, el, num, svg_markup
from .timeline import (
    DRILL,
    GOLD,
    GREEN,
    GREY,
    ORANGE,
    PURPLE,
    RED,
    TEAL,
    Lane,
    Timeline,
    conviction_label,
    detection_label,
    headline,
    interval_label,
    ranks_text,
)

TRIGGERED_REPLAY = EventKind.TRIGGERED_REPLAY.value  # a replay the sentinels asked for between audits

__all__ = ["svg", "picture"]

_DRILL_EDGE = "#1f77b4"
_LANE_COLOR, _FORK_COLOR, _TEXT_COLOR = "#5a5a5a", "#555555", "#333333"
_INTERVAL_TEXT, _CONTAINED_TEXT = "#a01010", "#c47a00"

# Geometry in px. Lane-local y grows downwards from the lane line (0).
_MIN_WIDTH, _MAX_WIDTH = 1000, 2400
_HEADER = 74  # title and subtitle
_LANE_GAP = 14  # between one lane's lowest label and the next lane's highest
_MIN_PITCH = 100
_BAND = 28  # half height of a suspect-interval band
_DET = 33  # half height of a detection line
_AUDIT_Y, _DRILL_Y = 18, -18
_MAX_LABEL = 48  # characters of an id or name shown in a label; the tooltip has all of it
_PAD_X, _PAD_Y = 8, 2  # clearance kept between a label and anything else (wider along a line of text)
_MAX_LEVELS = 8  # lines a label may move away from the lane before it is left out


# --- text ------------------------------------------------------------------------------------------


def _clip(s: Any, n: int = _MAX_LABEL) -> str:
    s = " ".join(str(s).split())  # a newline in a note would not show in SVG text anyway
    return s if len(s) <= n else s[: n - 1] + "…"


# DejaVu Sans advance widths in em (regular); unlisted ASCII letters fall back to the class average.
_WIDTHS = {
    **dict.fromkeys("ijl'|", 0.28),
    **dict.fromkeys("ft", 0.37),
    **dict.fromkeys(" .,:;!", 0.33),
    **dict.fromkeys("()[]{}r-/\\", 0.40),
    **dict.fromkeys('"*^_s', 0.52),
    **dict.fromkeys("mw", 0.92),
    **dict.fromkeys("MW%", 0.95),
    **dict.fromkeys("@<>=+~#&", 0.84),
    "…": 1.0,
    "—": 1.0,
    "·": 0.32,
}


def _width(s: str, size: float, *, bold: bool = False) -> float:
    """Estimated advance width of ``s`` in px at font size ``size``."""
    em = 0.0
    for ch in s:
        if ch in _WIDTHS:
            em += _WIDTHS[ch]
        elif ch.isdigit() or ch.islower():
            em += 0.63
        elif ch.isupper():
            em += 0.74
        else:
            em += 1.0 if ord(ch) > 0x2E7F else 0.7  # wide scripts take a full em
    return em * size * (1.1 if bold else 1.0)


# --- SVG elements ----------------------------------------------------------------------------------


def _text(
    x: float,
    y: float,
    s: str,
    *,
    size: float,
    color: str = _TEXT_COLOR,
    anchor: str = "middle",
    bold: bool = False,
    italic: bool = False,
    halo: bool = False,
    title: str | None = None,
) -> Node:
    """Text whose box is vertically centred on ``y`` (the baseline sits a third of the size below).

    Args:
        halo: outline the glyphs in white, so that a line running behind the text (a grid line, a
            fork arrow) does not cut through it.
    """
    attrs = {
        "x": x,
        "y": y + 0.35 * size,
        "font-size": size,
        "fill": color,
        "text-anchor": anchor,
        "font-weight": "bold" if bold else None,
        "font-style": "italic" if italic else None,
    }
    if halo:
        attrs |= {"stroke": "white", "stroke-width": 3, "stroke-linejoin": "round", "paint-order": "stroke"}
    return el("text", attrs, text=s, title=title)


def _line(
    x1: float,
    y1: float,
    x2: float,
    y2: float,
    *,
    color: str,
    width: float = 1.0,
    dash: str | None = None,
    opacity: float | None = None,
) -> Node:
    return el(
        "line",
        {
            "x1": x1,
            "y1": y1,
            "x2": x2,
            "y2": y2,
            "stroke": color,
            "stroke-width": width,
            "stroke-dasharray": dash,
            "stroke-opacity": opacity,
        },
    )


def _star(x: float, y: float, r: float) -> Node:
    """Five-pointed star, point up, outer radius ``r``."""
    pts = []
    for i in range(10):
        rad = r if i % 2 == 0 else r * 0.42
        a = math.pi * i / 5 - math.pi / 2
        pts.append(f"{num(x + rad * math.cos(a))},{num(y + rad * math.sin(a))}")
    return el(
        "polygon",
        {"points": " ".join(pts), "fill": GOLD, "stroke": "black", "stroke-width": 1.0, "stroke-linejoin": "round"},
    )


def _diamond(x: float, y: float, r: float, *, fill: str) -> Node:
    pts = f"{num(x)},{num(y - r)} {num(x + r)},{num(y)} {num(x)},{num(y + r)} {num(x - r)},{num(y)}"
    return el("polygon", {"points": pts, "fill": fill, "stroke": _DRILL_EDGE, "stroke-width": 1.2})


def _cross(x: float, y: float, r: float) -> Node:
    a, b, c, e = num(x - r), num(x + r), num(y - r), num(y + r)
    d = f"M{a},{c}L{b},{e}M{a},{e}L{b},{c}"
    return el("path", {"d": d, "stroke": "black", "stroke-width": 2.4, "stroke-linecap": "round"})


def _circle(x: float, y: float, r: float, *, color: str, held: bool) -> Node:
    """A checkpoint: filled when this store holds the file, hollow when it is gone."""
    if held:  # a white rim keeps neighbours apart; on crowded lanes it would wash the colour out
        return el(
            "circle",
            {
                "cx": x,
                "cy": y,
                "r": r,
                "fill": color,
                "stroke": "white" if r >= 4 else None,
                "stroke-width": 1.2 if r >= 4 else None,
            },
        )
    return el(
        "circle",
        {
            "cx": x,
            "cy": y,
            "r": max(r - 1.0, 1.5),
            "fill": "white",
            "stroke": color,
            "stroke-width": 2.2 if r > 4 else 1.4,
        },
    )


def _arrow_head(x: float, y: float, *, down: bool, color: str) -> Node:
    dy = -7 if down else 7
    pts = f"{num(x)},{num(y)} {num(x - 4)},{num(y + dy)} {num(x + 4)},{num(y + dy)}"
    return el("polygon", {"points": pts, "fill": color})


def _group(cls: str, items: Iterable[Node], *, title: str | None = None, transform: str | None = None) -> Node:
    return el("g", {"class": cls, "transform": transform}, children=items, title=title)


# --- label placement -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Box:
    x0: float
    y0: float
    x1: float
    y1: float

    def hits(self, other: _Box) -> bool:
        return (
            self.x0 < other.x1 + _PAD_X
            and other.x0 < self.x1 + _PAD_X
            and self.y0 < other.y1 + _PAD_Y
            and other.y0 < self.y1 + _PAD_Y
        )


@dataclass(slots=True)
class _Placer:
    """Places labels on one lane so that none covers another label or a mark.

    A label has a preferred box; when that is taken it tries its other horizontal positions, then
    moves one line further from the lane (up for labels above it, down for those below), and so on.
    One that finds no room within ``_MAX_LEVELS`` lines is left out and counted rather than drawn
    over another (a heap of text helps no one); its mark keeps the details in a tooltip.
    """

    left: float
    right: float
    boxes: list[_Box] = field(default_factory=list)
    extent: list[_Box] = field(default_factory=list)  # what the lane needs vertically
    omitted: int = 0

    def block(self, box: _Box, *, counts: bool = True) -> None:
        """Reserve ``box``; ``counts=False`` for one that does not make the lane taller (a fork's arrow head)."""
        self.boxes.append(box)
        if counts:
            self.extent.append(box)

    def place(self, xs: Sequence[float], *, w: float, h: float, y: float, up: bool, must: bool = False) -> _Box | None:
        """The first free box of width ``w`` and height ``h``, reserved; None when there is none.

        Args:
            xs: left edges to try on each line, preferred first (clamped into the lane's room).
            y: the edge nearest the lane of the first line: its bottom when ``up``, else its top.
            up: stack further lines above (towards smaller y) rather than below.
            must: never leave the label out (latest-good): search further, at worst overlap.
        """
        xs = [min(max(x, self.left), self.right - w) for x in xs]
        lo, hi = min(xs) - _PAD_X, max(xs) + w + _PAD_X
        near = [b for b in self.boxes if b.x0 < hi and lo < b.x1]  # nothing else can be in the way
        box = None
        for level in range(_MAX_LEVELS * (8 if must else 1)):
            y0 = y - h - level * (h + 3) if up else y + level * (h + 3)
            for x0 in xs:
                box = _Box(x0, y0, x0 + w, y0 + h)
                if not any(box.hits(b) for b in near):
                    self.block(box)
                    return box
        if must and box is not None:
            self.block(box)
            return box
        self.omitted += 1
        return None

    def bounds(self) -> tuple[float, float]:
        return min((b.y0 for b in self.extent), default=0.0), max((b.y1 for b in self.extent), default=0.0)


# --- layout ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Scale:
    """Steps to px along x, and the sizes that depend on how crowded the lanes are."""

    lo: float
    hi: float
    left: float
    right: float
    r: float  # checkpoint radius

    def __call__(self, step: float) -> float:
        return self.left + (step - self.lo) / (self.hi - self.lo) * (self.right - self.left)

    @property
    def star(self) -> float:
        return min(16.0, max(9.0, 2.1 * self.r))


def _width_for(tl: Timeline) -> int:
    """Canvas width: grows with the number of marked steps, like the figure, within bounds."""
    marked = {c.step for lane in tl.lanes for c in lane.checkpoints}
    marked |= {a.step for lane in tl.lanes for a in lane.audits}
    title, sub = headline(tl)
    need = max(_width(_clip(title, 120), 17, bold=True), _width(sub, 12.5)) + 60
    return int(min(_MAX_WIDTH, max(_MIN_WIDTH, 560 + 13.5 * len(marked), need)))


def _scale(tl: Timeline, *, width: int, left: float) -> _Scale:
    lo = min([0, *(lane.start for lane in tl.lanes)])  # the axis starts at step 0: where the run began
    hi = max(max((lane.end for lane in tl.lanes), default=lo + 1), lo + 1)
    pad = (hi - lo) * 0.03 + 0.5  # as the figure: room for a mark at either end
    proto = _Scale(lo - pad, hi + pad, left, width - 28, 7.5)
    gap = math.inf  # the closest two checkpoints of one lane set the marker size
    for lane in tl.lanes:
        xs = sorted({proto(c.step) for c in lane.checkpoints})
        gap = min([gap, *(b - a for a, b in zip(xs, xs[1:]))])
    r = 7.5 if gap == math.inf else min(7.5, max(2.5, 0.42 * gap))
    return _Scale(proto.lo, proto.hi, proto.left, proto.right, r)


def _ticks(lo: float, hi: float, *, room: float) -> list[int]:
    """Integer ticks at 1, 2, 2.5 or 5 times a power of ten, as many as fit ``room`` px with their labels."""
    label = max(_width(str(int(max(abs(lo), abs(hi)))), 12) + 28, 72.0)  # a tick every ~2 cm at most
    most = int(min(20, max(4, room // label)))
    for k in range(19):
        for m in (1, 2, 2.5, 5):
            step = m * 10**k
            if step != int(step):
                continue
            step = int(step)
            first, last = math.ceil(lo / step) * step, math.floor(hi / step) * step
            if (last - first) // step + 1 <= most:
                return list(range(first, last + 1, step))
    return []


@dataclass(slots=True)
class _LaneArt:
    """One lane drawn in lane-local coordinates, with the vertical room it needs."""

    items: list[Node]
    top: float
    bottom: float
    omitted: int  # labels left out for want of room


def _tooltip(c: Any) -> str:
    state = "pruned" if c.pruned else ("held" if c.held else "not held here")
    why = f" ({', '.join(c.reasons)})" if c.reasons else ""
    note = f" — {c.note}" if c.note else ""
    cov = f"; coverage: {c.coverage_text}" if getattr(c, "coverage_text", "") else ""
    return f"{c.ckpt_id} at step {c.step}: {c.verdict}{why}{note}{cov}; file {state}"


def _checkpoint_color(c: Any) -> tuple[str, str]:
    """Fill colour and CSS class of a checkpoint mark."""
    if c.verdict == "trusted":
        return GREEN, "trusted"
    if c.verdict == "verified":
        return TEAL, "verified"
    return (ORANGE, "pending") if c.pending else (RED, "suspect")


def _audit_marks(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    """One mark per step under the lane: a black X when a check failed; else a tall grey tick for a
    passed audit (a replay ran: the gradients were recomputed) and a small grey dot for a step whose
    passing checks were only the weight consensus or the non-finite summary (nothing was recomputed:
    such a mark inside a suspect band is no evidence against it)."""
    by_step: dict[int, list[str]] = {}
    failed: set[int] = set()
    replayed: set[int] = set()
    triggered: set[int] = set()
    for a in lane.audits:
        by_step.setdefault(a.step, []).append(f"{a.kind} {a.outcome}")
        if a.outcome == "fail":
            failed.add(a.step)
        elif a.kind == "replay":
            replayed.add(a.step)
        elif a.kind == TRIGGERED_REPLAY:
            triggered.add(a.step)
    out = []
    for step, what in sorted(by_step.items()):
        tip = f"step {step}: " + ", ".join(what)
        if step in failed:
            out.append(_group("audit fail", [_cross(x(step), _AUDIT_Y, 4.2)], title=tip))
        elif step in replayed:
            tick = _line(x(step), _AUDIT_Y - 6, x(step), _AUDIT_Y + 6, color=GREY, width=1.6)
            out.append(_group("audit pass", [tick], title=tip))
        elif step in triggered:
            # the sentinels had this step recomputed and it was right: dashed, since it vouches for
            # its own step only, not for the steps before it as an audit does
            tick = _line(x(step), _AUDIT_Y - 6, x(step), _AUDIT_Y + 6, color=GREY, width=1.6, dash="2 2")
            out.append(_group("triggered replay pass", [tick], title=tip))
        else:
            dot = el("circle", {"cx": round(x(step), 2), "cy": _AUDIT_Y, "r": 2.2, "fill": GREY})
            out.append(_group("check pass", [dot], title=tip))
    if by_step:
        placer.block(_Box(x(min(by_step)) - 5, _AUDIT_Y - 6, x(max(by_step)) + 5, _AUDIT_Y + 6))
    return out


def _bands(lane: Lane, x: _Scale) -> list[Node]:
    out = []
    for a, b in lane.intervals:
        out.append(
            _group(
                "interval",
                [
                    el(
                        "rect",
                        {  # at the checkpoints' rounded centres, so that the band meets them exactly
                            "x": round(x(a), 2),
                            "y": -_BAND,
                            "width": max(round(round(x(b), 2) - round(x(a), 2), 2), 1.0),
                            "height": 2 * _BAND,
                            "fill": RED,
                            "fill-opacity": 0.13,
                        },
                    ),
                    _line(x(a), -_BAND, x(a), _BAND, color=RED, width=0.9, dash="2 2", opacity=0.45),
                ],
                title=f"suspect interval ({a}, {b}]: the updates after the last clean audit point {a}",
            )
        )
    return out


_CONV_Y, _CONV_H = -_BAND - 7, 5.0  # the conviction bar: just above the suspect-interval band


def _conviction_tip(c: Any) -> str:
    to = f"{c.end}" if c.end is not None else "the end of the branch"
    where = f"rank {c.rank}" + (f" on host {c.host}" if c.host else "")
    inc = f", incident {c.incident_id}" if c.incident_id else ""
    return (
        f"{conviction_label(c)}{inc}: it computed steps ({c.start}, {to}] here ({where}); every checkpoint "
        f"whose unaudited steps it computed is suspect (device-convicted). Fleet {c.fleet}, conviction "
        f"{c.conviction_id}: `certckpt fleet show {c.device}`"
    )


def _conviction_bars(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    """The steps a convicted device computed on this lane: a purple bar above the lane."""
    out = []
    for c in lane.convictions:
        a, b = x(c.start), x(c.end if c.end is not None else lane.end)
        placer.block(_Box(a, _CONV_Y, max(b, a + 1.0), _CONV_Y + _CONV_H))
        bar = el(
            "rect",
            {"x": a, "y": _CONV_Y, "width": max(b - a, 1.0), "height": _CONV_H, "fill": PURPLE, "fill-opacity": 0.85},
        )
        out.append(_group("conviction", [bar], title=_conviction_tip(c)))
    return out


def _conviction_labels(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    out = []
    for c in lane.convictions:
        a, b = x(c.start), x(c.end if c.end is not None else lane.end)
        out += _label(
            placer,
            conviction_label(c),
            at=[("start", a), ("centre", (a + b) / 2), ("end", b)],
            y=_CONV_Y - 3,
            up=True,
            size=11,
            color=PURPLE,
            bold=True,
            title=_conviction_tip(c),
        )
    return out


def _beside(x: float) -> list[tuple[str, float]]:
    """Where to try a label about a mark at ``x``: centred on it, then starting or ending beside it."""
    return [("centre", x), ("start", x + 5), ("end", x - 5)]


def _lefts(at: Sequence[tuple[str, float]], w: float) -> list[float]:
    """Left edges of a label ``w`` px wide for anchors such as ``("centre", x)``, ``("start", x)``, ``("end", x)``."""
    return [x - w / 2 if how == "centre" else x if how == "start" else x - w for how, x in at]


def _label(
    placer: _Placer,
    s: str,
    *,
    at: Sequence[tuple[str, float]],
    y: float,
    up: bool,
    size: float,
    color: str,
    bold: bool = False,
    italic: bool = False,
    title: str | None = None,
) -> list[Node]:
    """Place and draw one label (nothing when there is no room for it).

    Args:
        at: the horizontal anchors to try on each line, preferred first (see ``_lefts``).
        y, up: as for ``_Placer.place``.
    """
    w, h = _width(s, size, bold=bold), size * 1.25
    box = placer.place(_lefts(at, w), w=w, h=h, y=y, up=up)
    if box is None:
        return []
    return [
        _text(
            (box.x0 + box.x1) / 2,
            (box.y0 + box.y1) / 2,
            s,
            size=size,
            color=color,
            bold=bold,
            italic=italic,
            halo=True,
            title=title,
        )
    ]


def _latest_good(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    lg = next((c for c in lane.checkpoints if c.latest_good), None)
    if lg is None:
        return []
    cx, s = x(lg.step), f"latest-good {_clip(lg.ckpt_id)}"
    w, h = _width(s, 11.5, bold=True) + 12, 20.0
    box = placer.place(_lefts(_beside(cx), w), w=w, h=h, y=x.star + 10, up=False, must=True)
    assert box is not None  # must=True always places
    bx = (box.x0 + box.x1) / 2
    return [
        _group(
            "latest-good",
            [
                _line(cx, x.star * 0.5, bx, box.y0, color="#888888", width=0.9),
                _star(cx, 0, x.star),
                el(
                    "rect",
                    {"x": box.x0, "y": box.y0, "width": w, "height": h, "rx": 4, "fill": "#fff6c2", "stroke": GOLD},
                ),
                _text(bx, box.y0 + h / 2, s, size=11.5, bold=True),
            ],
            title=f"latest-good {lg.ckpt_id}",
        )
    ]


def _fork_label(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    if lane.parent is None or lane.fork_step is None:
        return []
    fx, s = x(lane.fork_step), f"forked from {_clip(lane.parent)}"
    # beside the start of the lane first (nothing of this lane lies left of it), then below
    return _label(
        placer,
        s,
        at=[("end", fx - 18), ("centre", fx)],
        y=-4,
        up=False,
        size=10.5,
        color="#444444",
        italic=True,
        title=f"forked from {lane.parent} at step {lane.fork_step}",
    )


def _detection_lines(lane: Lane, x: _Scale) -> list[Node]:
    out = []
    for d in lane.detections:
        color = ORANGE if d.contained else RED
        iv = f", suspect interval ({d.interval[0]}, {d.interval[1]}]" if d.interval else ", contained"
        ranks = ranks_text(d.suspect_ranks)
        tip = f"detection at step {d.step}: {d.kind} failed, {ranks}{iv}; rollback {d.rollback_window}"
        out.append(
            _group(
                "detection contained" if d.contained else "detection",
                [_line(x(d.step), -_DET, x(d.step), _DET, color=color, width=2.4, dash="6 3" if d.contained else None)],
                title=tip,
            )
        )
    return out


def _detection_labels(lane: Lane, x: _Scale, placer: _Placer, *, contained: bool) -> list[Node]:
    """Labels of the uncontained detections (above the lane) or of the contained ones (below)."""
    out = []
    for d in lane.detections:
        if d.contained != contained:
            continue
        dx = x(d.step)
        if contained:
            out += _label(
                placer,
                detection_label(d),
                at=_beside(dx),
                y=_DET + 3,
                up=False,
                size=10.5,
                color=_CONTAINED_TEXT,
                bold=True,
            )
        else:
            out += _label(
                placer, detection_label(d), at=_beside(dx), y=-_DET - 3, up=True, size=11, color=RED, bold=True
            )
    return out


def _interval_labels(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    out = []
    for a, b in lane.intervals:
        mid, right = (x(a) + x(b)) / 2, x(b)
        # inside the top of the band when it is free, else above; or just left of the band's end
        out += _label(
            placer,
            interval_label(a, b),
            at=[("centre", mid), ("end", right - 10)],
            y=-_BAND + 15,
            up=True,
            size=10.5,
            color=_INTERVAL_TEXT,
        )
    return out


def _drills(lane: Lane, x: _Scale, placer: _Placer) -> list[Node]:
    out = []
    for dr in lane.drills:
        if dr.step is None:
            continue
        dx = x(dr.step)
        placer.block(_Box(dx - 6, _DRILL_Y - 6, dx + 6, _DRILL_Y + 6))
        out.append(
            _group(
                f"drill {dr.outcome}",
                [_diamond(dx, _DRILL_Y, 5.5, fill=DRILL.get(dr.outcome, "white"))],
                title=f"restore drill {dr.outcome} on {dr.ckpt_id}",
            )
        )
    return out


def _lane_art(lane: Lane, x: _Scale, *, above: bool | None) -> _LaneArt:
    """Draw one lane.

    Args:
        above: where the lane's parent lies (True: an earlier lane), None when no fork arrow comes in.
            Labels keep off the arrow head; the rest of the arrow may run behind a (haloed) label.
    """
    placer = _Placer(left=x.left - 6, right=x.right + 22)
    x0, x1 = x(lane.start), x(lane.end)
    if above is not None and lane.fork_step is not None:
        fx = x(lane.fork_step)
        placer.block(_Box(fx - 5, -14, fx + 5, 0) if above else _Box(fx - 5, 0, fx + 5, 14), counts=False)
    placer.block(_Box(x0 - x.r, -x.r, x1 + x.r, x.r))  # the lane and its checkpoints
    for d in lane.detections:
        placer.block(_Box(x(d.step) - 2, -_DET, x(d.step) + 2, _DET))
    lg = next((c for c in lane.checkpoints if c.latest_good), None)
    if lg is not None:
        placer.block(_Box(x(lg.step) - x.star, -x.star, x(lg.step) + x.star, x.star))

    bands = _bands(lane, x)
    convictions = _conviction_bars(lane, x, placer)
    audits = _audit_marks(lane, x, placer)
    drills = _drills(lane, x, placer)
    latest = _latest_good(lane, x, placer)
    # labels by importance: when a lane is too crowded for all of them, the last ones are left out
    labels = [
        *_fork_label(lane, x, placer),
        *_detection_labels(lane, x, placer, contained=False),
        *_conviction_labels(lane, x, placer),
        *_interval_labels(lane, x, placer),
        *_detection_labels(lane, x, placer, contained=True),
    ]
    marks = []
    for c in lane.checkpoints:
        color, cls = _checkpoint_color(c)
        held = "" if c.held else (" pruned" if c.pruned else " not-held")
        marks.append(
            _group(f"checkpoint {cls}{held}", [_circle(x(c.step), 0, x.r, color=color, held=c.held)], title=_tooltip(c))
        )
    line = el(
        "line",
        {"x1": x0, "y1": 0, "x2": x1, "y2": 0, "stroke": _LANE_COLOR, "stroke-width": 2.2, "stroke-linecap": "round"},
    )
    items = [*bands, *convictions, line, *audits, *_detection_lines(lane, x), *marks, *drills, *labels, *latest]
    top, bottom = placer.bounds()
    return _LaneArt(items=items, top=min(top, -_DET), bottom=max(bottom, _DET), omitted=placer.omitted)


def _parent_lanes(tl: Timeline) -> list[int | None]:
    """For each lane, the index of the lane holding its parent checkpoint (None: no arrow to draw)."""
    where = {c.ckpt_id: i for i, lane in enumerate(tl.lanes) for c in lane.checkpoints}
    out: list[int | None] = []
    for j, lane in enumerate(tl.lanes):
        i = where.get(lane.parent) if lane.parent is not None else None
        out.append(None if i == j or lane.fork_step is None else i)
    return out


def _forks(tl: Timeline, x: _Scale, ys: Sequence[float]) -> list[Node]:
    """Dashed arrows from each parent checkpoint to the start of the lane forked from it."""
    out = []
    for j, (lane, i) in enumerate(zip(tl.lanes, _parent_lanes(tl))):
        if i is None or lane.fork_step is None:  # (a lane without a fork step has no parent lane either)
            continue
        fx, down = x(lane.fork_step), ys[i] < ys[j]
        y_from = ys[i] + (x.r + 3 if down else -x.r - 3)
        y_to = ys[j] + (-3 if down else 3)
        out.append(
            _group(
                "fork",
                [
                    _line(fx, y_from, fx, y_to + (-6 if down else 6), color=_FORK_COLOR, width=1.3, dash="5 3"),
                    _arrow_head(fx, y_to, down=down, color=_FORK_COLOR),
                ],
                title=f"{lane.branch} resumed from {lane.parent}",
            )
        )
    return out


def _lane_ys(arts: Sequence[_LaneArt]) -> list[float]:
    """Where each lane line sits: each lane as close below the one before as both lanes' labels allow."""
    ys: list[float] = []
    for k, art in enumerate(arts):
        if k == 0:
            ys.append(_HEADER + 12 - art.top)
        else:
            ys.append(ys[-1] + max(_MIN_PITCH, arts[k - 1].bottom - art.top + _LANE_GAP))
    return ys


# --- axis, legend, header --------------------------------------------------------------------------


def _axis(x: _Scale, *, top: float, y: float) -> tuple[list[Node], list[Node]]:
    """Grid lines (drawn first, behind everything) and the step axis at ``y``."""
    grid, axis = [], [_line(x.left, y, x.right, y, color="#222222", width=1.2)]
    for t in _ticks(x.lo, x.hi, room=x.right - x.left):
        tx = x(t)
        grid.append(_line(tx, top, tx, y, color="#e6e6e6", width=1.0))
        axis.append(_line(tx, y, tx, y + 5, color="#222222", width=1.2))
        axis.append(_text(tx, y + 17, str(t), size=12, color="#222222"))
    axis.append(_text((x.left + x.right) / 2, y + 40, "optimizer step", size=13, color="#222222"))
    return grid, axis


def _suspect_words(tl: Timeline) -> str:
    """The suspect swatch's label, naming the reasons the picture's suspect checkpoints carry."""
    reasons: list[str] = []
    for c in tl.checkpoints:
        if c.verdict == "suspect" and not c.pending:
            reasons += [r for r in c.reasons if r not in reasons]
    return f"suspect ({', '.join(reasons[:4])}{', ...' if len(reasons) > 4 else ''})" if reasons else "suspect"


def _legend_entries(tl: Timeline) -> list[tuple[Node, str]]:
    """(swatch markup centred on 0,0, label): only the marks this picture holds."""
    cks, audits = tl.checkpoints, [a for lane in tl.lanes for a in lane.audits]
    dets = tl.detections
    present: list[tuple[bool, Node, str]] = [
        (any(c.verdict == "trusted" for c in cks), _circle(0, 0, 6.5, color=GREEN, held=True), "checkpoint: trusted"),
        (
            any(c.verdict == "suspect" and not c.pending for c in cks),
            _circle(0, 0, 6.5, color=RED, held=True),
            _suspect_words(tl),
        ),
        (any(c.pending for c in cks), _circle(0, 0, 6.5, color=ORANGE, held=True), "pending (awaiting its audit)"),
        (
            any(c.verdict == "verified" for c in cks),
            _circle(0, 0, 6.5, color=TEAL, held=True),
            "verified (intact; no audit evidence yet)",
        ),
        (any(not c.held for c in cks), _circle(0, 0, 6.5, color=GREY, held=False), "hollow: file pruned / not held"),
        (any(c.latest_good for c in cks), _star(0, 0, 9), "latest-good"),
        (
            any(a.kind == "replay" and a.outcome == "pass" for a in audits),
            _line(0, -6, 0, 6, color=GREY, width=1.6),
            "audit passed (replay + consensus)",
        ),
        (
            any(a.kind == TRIGGERED_REPLAY and a.outcome == "pass" for a in audits),
            _line(0, -6, 0, 6, color=GREY, width=1.6, dash="2 2"),
            "triggered replay passed (its step recomputed)",
        ),
        (
            _consensus_only(tl),
            el("circle", {"cx": 0, "cy": 0, "r": 2.2, "fill": GREY}),
            "consensus only passed (no replay)",
        ),
        (any(a.outcome == "fail" for a in audits), _cross(0, 0, 4.2), "check failed"),
        (any(not d.contained for d in dets), _line(-10, 0, 10, 0, color=RED, width=2.4), "detection (ranks named)"),
        (
            any(d.contained for d in dets),
            _line(-10, 0, 10, 0, color=ORANGE, width=2.4, dash="6 3"),
            "contained detection",
        ),
        (
            any(lane.intervals for lane in tl.lanes),
            el("rect", {"x": -10, "y": -6, "width": 20, "height": 12, "fill": RED, "fill-opacity": 0.18}),
            "suspect interval (c, d]",
        ),
        (
            bool(tl.convictions),
            el("rect", {"x": -10, "y": -2.5, "width": 20, "height": 5, "fill": PURPLE, "fill-opacity": 0.85}),
            "steps a device convicted in the fleet registry computed",
        ),
        (
            any(i is not None for i in _parent_lanes(tl)),
            _line(-10, 0, 10, 0, color=_FORK_COLOR, width=1.3, dash="5 3"),
            "fork (resume from checkpoint)",
        ),
        (
            any(lane.drills for lane in tl.lanes),
            _diamond(0, 0, 5.5, fill=DRILL["pass"]),
            "restore drill (blue: passed, black: failed)",
        ),
    ]
    return [(swatch, label) for shown, swatch, label in present if shown]


def _consensus_only(tl: Timeline) -> bool:
    """Whether a step's passing checks were only the consensus or the non-finite summary (a grey dot)."""
    for lane in tl.lanes:
        steps: dict[int, set[str]] = {}
        for a in lane.audits:
            steps.setdefault(a.step, set()).add(f"{a.kind} {a.outcome}")
        recomputed = ("replay pass", f"{TRIGGERED_REPLAY} pass")
        if any(not any(r in v for r in recomputed) and not any(k.endswith("fail") for k in v) for v in steps.values()):
            return True
    return False


def _legend(tl: Timeline, *, width: float, y: float) -> tuple[list[Node], float]:
    """The legend, centred, in columns filled top to bottom; returns its markup and its height."""
    entries = _legend_entries(tl)
    if not entries:
        return [], 0.0
    col = max(_width(label, 11.5) for _, label in entries) + 48
    ncol = int(max(1, min(6, (width - 40) // col)))
    nrow = math.ceil(len(entries) / ncol)
    ncol = math.ceil(len(entries) / nrow)  # as few columns as the rows allow: no ragged last column
    left = (width - ncol * col) / 2 + 14
    out = []
    for k, (swatch, label) in enumerate(entries):
        cx, cy = left + (k // nrow) * col, y + (k % nrow) * 21
        out.append(_group("legend-entry", [swatch], transform=f"translate({num(cx)},{num(cy)})"))
        out.append(_text(cx + 18, cy, label, size=11.5, anchor="start"))
    return out, nrow * 21


def _names(tl: Timeline, ys: Sequence[float], *, right: float) -> list[Node]:
    return [
        _text(right, y, _clip(lane.branch, 24), size=13, anchor="end", color="#111111", title=lane.branch)
        for lane, y in zip(tl.lanes, ys)
    ]


def _name_room(tl: Timeline) -> float:
    return max([40.0, *(_width(_clip(lane.branch, 24), 13) for lane in tl.lanes)]) + 34


# --- the document ----------------------------------------------------------------------------------


def picture(tl: Timeline) -> Node:
    """Draw the timeline: the ``<svg>`` element tree that ``svg`` writes and ``report`` paints as PNG.

    Args:
        tl: the timeline (``certckpt.ops.timeline.timeline``).

    Returns:
        The drawing; the same timeline always gives the same tree.
    """
    width = _width_for(tl)
    x = _scale(tl, width=width, left=_name_room(tl))
    arts = [
        _lane_art(lane, x, above=None if i is None else i < j)
        for j, (lane, i) in enumerate(zip(tl.lanes, _parent_lanes(tl)))
    ]
    ys = _lane_ys(arts)
    plot_top = _HEADER + 4
    axis_y = (ys[-1] + arts[-1].bottom + 16) if arts else plot_top + 80
    grid, axis = _axis(x, top=plot_top, y=axis_y)
    omitted = sum(art.omitted for art in arts)
    if omitted:  # say so: a reader must not take a missing label for a missing event
        axis.append(
            _text(
                x.right,
                axis_y + 40,
                f"{omitted} label{'s' * (omitted != 1)} left out for room: hover a mark for its details",
                size=11,
                anchor="end",
                color="#666666",
            )
        )
    legend, legend_h = _legend(tl, width=width, y=axis_y + 70)
    height = math.ceil(axis_y + 70 + legend_h + 10)
    title, sub = headline(tl)
    lanes = [_group("lane", art.items, transform=f"translate(0,{num(y)})") for art, y in zip(arts, ys)]
    if not arts:
        lanes = [_text((x.left + x.right) / 2, plot_top + 40, "nothing recorded", size=13, color=GREY)]
    body = [
        el("rect", {"x": 0, "y": 0, "width": width, "height": height, "fill": "white"}),
        _text(x.left - 10, 26, _clip(title, 120), size=17, bold=True, anchor="start", color="#111111"),
        _text(x.left - 10, 52, sub, size=12.5, anchor="start"),
        _group("grid", grid),
        *_forks(tl, x, ys),
        *lanes,
        _group("names", _names(tl, ys, right=x.left - 14)),
        _group("axis", axis),
        _group("legend", legend),
    ]
    return el(
        "svg",
        {
            "xmlns": SVG_NS,
            "version": "1.1",
            "width": width,
            "height": height,
            "viewBox": f"0 0 {width} {height}",
            "role": "img",
            "aria-label": title,
            "font-family": FONT,
        },
        children=body,
        title=title,
    )


def svg(tl: Timeline, *, standalone: bool = True) -> str:
    """Draw the timeline as SVG.

    Args:
        tl: the timeline (``certckpt.ops.timeline.timeline``).
        standalone: a document for a ``.svg`` file (with the XML declaration); False gives the bare
            ``<svg>`` element for inlining in an HTML page.

    Returns:
        The SVG markup; the same timeline always gives the same string.

    Example:
        >>> from certckpt.ops.timeline import Timeline
        >>> svg(Timeline(store="/runs/a", run="a", latest_good=None)).startswith("<?xml")
        True
    """
    markup = svg_markup(picture(tl), sep="\n")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' if standalone else "") + markup + "\n"
