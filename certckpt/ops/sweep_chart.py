"""The magnitude sweep as a picture: the catch rate against the fault's magnitude, one panel per
perturbation, one line per site (forward, backward) with the sentinels on (solid) and off (dashed).

Drawn from the sweep's JSON document (``certckpt drill faults --sweep --json``: its ``table`` rows)
as a ``certckpt.ops.drawing`` tree and written as SVG with the standard library alone. The
magnitudes are categories, evenly spaced in the order swept (decades for scales and values, bit
indexes for bit flips), so that each measured point has its own place. Deterministic: the same
table gives the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from certckpt.errors import ConfigurationError
from certckpt.storage import write_atomic

from .drawing import FONT, SVG_NS, Node, el, svg_markup
from .timeline import ORANGE, TEAL

__all__ = ["sweep_svg", "render_sweep"]

_W, _LEFT, _RIGHT, _TOP = 960, 70, 20, 96
_PLOT_H, _PANEL_GAP = 130, 78
_COLORS = {"forward": TEAL, "backward": ORANGE}
_OFFSET = {("forward", "on"): -3, ("backward", "on"): -1, ("forward", "off"): 1, ("backward", "off"): 3}
_TITLES = {
    "scale": "a tensor scaled by (1 + eps): eps",
    "set": "the largest element set to a value",
    "bitflip-fp32": "one bit flipped in the largest element, float32: bit (0-22 mantissa, 23-30 exponent, 31 sign)",
    "bitflip-bf16": "one bit flipped in the largest element, bfloat16: bit (0-6 mantissa, 7-14 exponent, 15 sign)",
    "zero": "a zeroed bucket (backward) or layer output (forward)",
}
_EXPONENT = {"bitflip-fp32": (23, 30), "bitflip-bf16": (7, 14)}  # bit ranges shaded as the exponent


def _panels(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[str]]]:
    """(perturbation, its magnitude labels in sweep order), perturbations in their first row's order."""
    out: dict[str, list[str]] = {}
    for r in rows:
        labels = out.setdefault(r["perturbation"], [])
        if r["label"] not in labels and r["label"] not in ("bucket", "output"):
            labels.append(r["label"])
        elif r["label"] in ("bucket", "output") and "zeroed" not in labels:
            labels.append("zeroed")
    return list(out.items())


def _legend(y: int) -> list[Node]:
    out, x = [], _LEFT
    for site in ("forward", "backward"):
        for on in ("on", "off"):
            dash = None if on == "on" else "5,3"
            out.append(
                el(
                    "line",
                    {
                        "x1": x,
                        "x2": x + 26,
                        "y1": y,
                        "y2": y,
                        "stroke": _COLORS[site],
                        "stroke-width": 2,
                        "stroke-dasharray": dash,
                    },
                )
            )
            fill = _COLORS[site] if on == "on" else "white"
            out.append(
                el(
                    "circle",
                    {"cx": x + 13, "cy": y, "r": 3.5, "fill": fill, "stroke": _COLORS[site], "stroke-width": 1.5},
                )
            )
            out.append(el("text", {"x": x + 32, "y": y + 4}, text=f"{site}, sentinels {on}"))
            x += 200
    return out


def _shown(label: str) -> str:
    """An axis label: a bit index without its ``bit`` prefix (32 of them share one axis)."""
    return label[3:] if label.startswith("bit") else label


def _tip(row: Mapping[str, Any], on: str) -> str:
    cell = row[on]
    how = [
        f"{cell[k]} {w}"
        for k, w in (("triggered", "by a triggered replay"), ("caught_nonfinite", "non-finite"))
        if cell.get(k)
    ]
    late = f", {cell['late']} detected late" if cell.get("late") else ""
    return (
        f"{row['kind']} {row['label']}, sentinels {on}: {cell['caught']}/{cell['runs']} caught"
        + (f" ({', '.join(how)})" if how else "")
        + late
    )


def _panel(name: str, labels: list[str], rows: Sequence[Mapping[str, Any]], top: float) -> list[Node]:
    width = min(_W - _LEFT - _RIGHT, 110 * len(labels))  # a panel of one or two points stays narrow
    step = width / max(len(labels), 1)
    xs = {label: _LEFT + step * (i + 0.5) for i, label in enumerate(labels)}
    right = _LEFT + width
    bottom = top + _PLOT_H
    out = [el("text", {"x": _LEFT, "y": top - 10, "font-weight": "bold"}, text=_TITLES.get(name, name))]
    if name in _EXPONENT:
        lo, hi = (f"bit{b}" for b in _EXPONENT[name])
        if lo in xs and hi in xs:
            x0, x1 = xs[lo] - step / 2, xs[hi] + step / 2
            out.append(el("rect", {"x": x0, "y": top, "width": x1 - x0, "height": _PLOT_H, "fill": "#eef3fb"}))
            mid = {"x": (x0 + x1) / 2, "y": top + 14, "text-anchor": "middle", "fill": "#555"}
            out.append(el("text", mid, text="exponent bits"))
    for pct in (0, 50, 100):
        y = bottom - _PLOT_H * pct / 100
        out.append(el("line", {"x1": _LEFT, "x2": right, "y1": y, "y2": y, "stroke": "#ddd"}))
        out.append(el("text", {"x": _LEFT - 8, "y": y + 4, "text-anchor": "end", "fill": "#555"}, text=f"{pct}%"))
    for label, x in xs.items():
        out.append(el("text", {"x": x, "y": bottom + 16, "text-anchor": "middle", "font-size": 10}, text=_shown(label)))
    for site in ("forward", "backward"):
        mine = [r for r in rows if r["site"] == site]
        for on in ("on", "off"):
            pts = []
            for r in mine:
                label = "zeroed" if r["label"] in ("bucket", "output") else r["label"]
                cell = r[on]
                if label in xs and cell["runs"]:
                    pts.append((xs[label], bottom - _PLOT_H * cell["rate"] + _OFFSET[(site, on)], _tip(r, on)))
            color, dash = _COLORS[site], None if on == "on" else "5,3"
            for (x1, y1, _), (x2, y2, _) in zip(pts, pts[1:]):
                line = {"x1": x1, "y1": y1, "x2": x2, "y2": y2, "stroke": color, "stroke-width": 2}
                out.append(el("line", {**line, "stroke-dasharray": dash}))
            fill = color if on == "on" else "white"
            for x, y, tip in pts:
                dot = {"cx": x, "cy": y, "r": 3.5, "fill": fill, "stroke": color, "stroke-width": 1.5}
                out.append(el("circle", dot, title=tip))
    return out


def _picture(doc: Mapping[str, Any]) -> Node:
    rows = doc.get("table", [])
    panels = _panels(rows)
    height = _TOP + len(panels) * (_PLOT_H + _PANEL_GAP) + 10
    trials = doc.get("trials", "?")
    out = [
        el("rect", {"width": _W, "height": height, "fill": "white"}),
        el(
            "text",
            {"x": 12, "y": 26, "font-size": 16, "font-weight": "bold"},
            text="One-time faults between audits: the share caught, by magnitude",
        ),
        el(
            "text",
            {"x": 12, "y": 46, "fill": "#555"},
            text=f"drill model on {doc.get('ranks', '?')} gloo ranks, audits every {doc.get('audit_every', '?')} "
            f"steps, {trials} run(s) per point; caught: stopped at its step with the faulty rank named",
        ),
        *_legend(70),
    ]
    if not panels:
        out.append(el("text", {"x": 12, "y": _TOP + 20}, text="no faulty run in this sweep"))
    for i, (name, labels) in enumerate(panels):
        top = _TOP + 24 + i * (_PLOT_H + _PANEL_GAP)
        out.extend(_panel(name, labels, [r for r in rows if r["perturbation"] == name], top))
    attrs = {"xmlns": SVG_NS, "width": _W, "height": height, "viewBox": f"0 0 {_W} {height}"}
    return el("svg", {**attrs, "font-family": FONT, "font-size": 12}, children=out)


def sweep_svg(doc: Mapping[str, Any]) -> str:
    """The sweep document (``certckpt drill faults --sweep --json``) as an SVG document.

    Example:
        >>> cell = {"runs": 1, "caught": 1, "rate": 1.0}
        >>> row = {"kind": "backward-scale", "site": "backward", "perturbation": "scale", "label": "1000", \
"on": cell, "off": {**cell, "caught": 0, "rate": 0.0}}
        >>> sweep_svg({"table": [row], "trials": 1}).startswith("<svg")
        True
    """
    return svg_markup(_picture(doc), sep="\n") + "\n"


def render_sweep(doc: Mapping[str, Any], out_path: str | os.PathLike[str]) -> None:
    """Write the picture to ``out_path`` (a ``.svg`` file).

    Raises:
        ConfigurationError: another suffix.
    """
    path = os.fspath(out_path)
    if not path.lower().endswith(".svg"):
        raise ConfigurationError(f"--svg {path}: the picture is written as SVG; name a .svg file")
    write_atomic(path, sweep_svg(doc).encode("utf-8"))
