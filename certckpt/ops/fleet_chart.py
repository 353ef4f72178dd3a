"""The fleet's detection rates as a picture: one horizontal bar per device (grouped by host), its
length the detections per million device-steps, its label the counts behind it.

Drawn once as a ``certckpt.ops.drawing`` tree, like the run timeline: ``.svg`` writes it with the
standard library alone, ``.png`` paints the same drawing with matplotlib (an optional extra, imported
when a ``.png`` is drawn). Device and host names come from records anyone with write access to a
fleet registry may have written: they stay text (``drawing.escape`` when written). Deterministic: the
same rates give the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from certckpt.errors import ConfigurationError
from certckpt.storage import write_atomic

from .drawing import FONT, SVG_NS, Node, el, png, svg_markup
from .timeline import GREY, ORANGE, RED

__all__ = ["rates_svg", "render_rates"]

_ROW, _TOP, _LEFT, _BAR, _RIGHT = 26, 70, 330, 520, 210
_MAX_ROWS = 200


def _clip(s: Any, limit: int = 60) -> str:
    text = str(s)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Devices by host (highest host rate first), each host's devices highest rate first."""
    hosts = [h["host"] for h in doc.get("hosts", [])]
    order = {h: i for i, h in enumerate(hosts)}
    devices = list(doc.get("devices", []))
    devices.sort(key=lambda r: (order.get(r.get("host", ""), len(order)), -(r["per_million"] or 0), r["device"]))
    return devices[:_MAX_ROWS]


def _label(r: Mapping[str, Any]) -> str:
    rate = r["per_million"]
    per = "no recorded steps" if rate is None else f"{rate:,.1f} per M"
    return f"{per} ({r['detections']} in {r['device_steps']:,} steps)"


def _picture(doc: Mapping[str, Any]) -> Node:
    """The rates document (``certckpt.trust.fleetscan.fleet_rates``) drawn as an ``<svg>`` tree."""
    rows = _rows(doc)
    top = max([r["per_million"] or 0.0 for r in rows] + [1e-9])
    height = _TOP + _ROW * max(1, len(rows)) + 30
    width = _LEFT + _BAR + _RIGHT
    out = [
        el("rect", {"width": width, "height": height, "fill": "white"}),
        el(
            "text",
            {"x": 12, "y": 26, "font-size": 16, "font-weight": "bold"},
            text=f"Detections per million device-steps: {_clip(doc.get('fleet', ''), 80)}",
        ),
        el(
            "text",
            {"x": 12, "y": 48, "fill": "#555"},
            text=f"{len(rows)} device(s); a red bar is a device convicted at least once; "
            "grey: detections with no recorded steps",
        ),
    ]
    if not rows:
        out.append(el("text", {"x": 12, "y": _TOP + 16}, text="no device has reported yet"))
    last_host = None
    for i, r in enumerate(rows):
        y = _TOP + i * _ROW
        host = r.get("host", "")
        if host != last_host:
            out.append(el("line", {"x1": 8, "x2": width - 8, "y1": y, "y2": y, "stroke": "#ddd"}))
            last_host = host
        rate = r["per_million"]
        length = _BAR * (rate / top) if rate else 0.0
        color = GREY if rate is None else RED if r["detections"] else ORANGE
        name = f"{_clip(host, 24)} / {_clip(r['device'], 30)}"
        out.append(el("text", {"x": _LEFT - 8, "y": y + 17, "text-anchor": "end"}, text=name))
        w = max(length, 2.0 if r["detections"] else 0.0) if rate is not None else 6.0
        out.append(el("rect", {"x": _LEFT, "y": y + 5, "width": w, "height": _ROW - 10, "fill": color}))
        out.append(el("text", {"x": _LEFT + w + 6, "y": y + 17}, text=_clip(_label(r), 60)))
    attrs = {"xmlns": SVG_NS, "width": width, "height": height, "viewBox": f"0 0 {width} {height}"}
    return el("svg", {**attrs, "font-family": FONT, "font-size": 12}, children=out)


def rates_svg(doc: Mapping[str, Any]) -> str:
    """The rates document (``certckpt.trust.fleetscan.fleet_rates``) as an SVG document."""
    return svg_markup(_picture(doc), sep="\n") + "\n"


def render_rates(doc: Mapping[str, Any], out_path: str | os.PathLike[str]) -> str:
    """Draw the rates to ``out_path`` (``.svg`` or ``.png``); returns the suffix written."""
    path = os.fspath(out_path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".svg", ".png"):
        raise ConfigurationError(f"--out {path}: draw a .svg or a .png")
    if suffix == ".svg":
        data = rates_svg(doc).encode("utf-8")
    else:
        data = png(_picture(doc), needs="a .png picture", instead=".svg needs nothing more")
    write_atomic(path, data)
    return suffix
