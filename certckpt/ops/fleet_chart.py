"""The fleet's detection rates as a picture: one horizontal bar per device (grouped by host), its
length the detections per million device-steps, its label the counts behind it.

``.svg`` is drawn with the standard library alone (like ``timeline_svg``), ``.png`` with matplotlib
(like ``report``; an optional extra, imported when a ``.png`` is drawn). Device and host names come
from records anyone with write access to a fleet registry may have written: every string is escaped
and stripped of the characters XML forbids. Deterministic: the same rates give the same bytes.
"""

from __future__ import annotations

import html
import io
import os
import re
from collections.abc import Mapping
from typing import Any

from certckpt.errors import ConfigurationError, MissingDependencyError
from certckpt.storage import write_atomic

from .timeline import GREY, ORANGE, RED

__all__ = ["rates_svg", "render_rates"]

_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
_FONT = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
_ROW, _TOP, _LEFT, _BAR, _RIGHT = 26, 70, 330, 520, 210
_MAX_ROWS = 200


def _esc(s: Any, limit: int = 60) -> str:
    text = _XML_BAD.sub("", str(s))
    return html.escape(text if len(text) <= limit else text[: limit - 1] + "…")


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


def rates_svg(doc: Mapping[str, Any]) -> str:
    """The rates document (``certckpt.trust.fleetscan.fleet_rates``) as an SVG document."""
    rows = _rows(doc)
    top = max([r["per_million"] or 0.0 for r in rows] + [1e-9])
    height = _TOP + _ROW * max(1, len(rows)) + 30
    width = _LEFT + _BAR + _RIGHT
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{_FONT}" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="12" y="26" font-size="16" font-weight="bold">Detections per million device-steps: '
        f"{_esc(doc.get('fleet', ''), 80)}</text>",
        f'<text x="12" y="48" fill="#555">{len(rows)} device(s); a red bar is a device convicted at least once; '
        "grey: detections with no recorded steps</text>",
    ]
    if not rows:
        out.append(f'<text x="12" y="{_TOP + 16}">no device has reported yet</text>')
    last_host = None
    for i, r in enumerate(rows):
        y = _TOP + i * _ROW
        host = r.get("host", "")
        if host != last_host:
            out.append(f'<line x1="8" x2="{width - 8}" y1="{y}" y2="{y}" stroke="#ddd"/>')
            last_host = host
        rate = r["per_million"]
        length = _BAR * (rate / top) if rate else 0.0
        color = GREY if rate is None else RED if r["detections"] else ORANGE
        name = f"{_esc(host, 24)} / {_esc(r['device'], 30)}"
        out.append(f'<text x="{_LEFT - 8}" y="{y + 17}" text-anchor="end">{name}</text>')
        w = max(length, 2.0 if r["detections"] else 0.0) if rate is not None else 6.0
        out.append(f'<rect x="{_LEFT}" y="{y + 5}" width="{w:.1f}" height="{_ROW - 10}" fill="{color}"/>')
        out.append(f'<text x="{_LEFT + w + 6:.1f}" y="{y + 17}">{_esc(_label(r), 60)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png(doc: Mapping[str, Any]) -> bytes:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # an optional extra
        raise MissingDependencyError(
            f"a .png picture needs matplotlib: pip install 'certckpt[report]' (.svg needs nothing more) ({e})"
        ) from e
    rows = _rows(doc)
    fig = Figure(figsize=(10, 1.2 + 0.35 * max(1, len(rows))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    names = [f"{r.get('host', '')} / {r['device']}"[:60] for r in rows]
    values = [r["per_million"] or 0.0 for r in rows]
    colors = [GREY if r["per_million"] is None else RED if r["detections"] else ORANGE for r in rows]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(values[i], i, " " + _label(r), va="center", fontsize=8)
    ax.set_xlabel("detections per million device-steps")
    ax.set_title(f"Detection rates: {doc.get('fleet', '')}"[:100])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def render_rates(doc: Mapping[str, Any], out_path: str | os.PathLike[str]) -> str:
    """Draw the rates to ``out_path`` (``.svg`` or ``.png``); returns the suffix written."""
    path = os.fspath(out_path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".svg", ".png"):
        raise ConfigurationError(f"--out {path}: draw a .svg or a .png")
    data = rates_svg(doc).encode("utf-8") if suffix == ".svg" else _png(doc)
    write_atomic(path, data)
    return suffix
