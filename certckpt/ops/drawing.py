"""The drawing model every ops picture shares: a tree of SVG elements, written as SVG or painted as PNG.

A picture (the run timeline, the fleet's rates) is built once as ``Node`` s: plain SVG elements with
their attributes as values, never as markup. ``svg_markup`` writes the tree as SVG text with the standard
library alone; ``png`` paints the same tree with matplotlib (an optional extra, imported only then), so
a PNG shows exactly what the SVG shows. ``escape`` is the one XML escape, used for every string of a
picture and of the HTML page around it.

Text in a picture comes from stores that anyone with write access may have written, so every string
is escaped when the tree is written, and the code points XML 1.0 cannot carry become U+FFFD.
"""

from __future__ import annotations

import html
import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from certckpt.errors import MissingDependencyError

__all__ = ["Node", "SVG_NS", "FONT", "el", "escape", "num", "svg_markup", "png"]

_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
SVG_NS = "http://www.w3.org/2000/svg"
# DejaVu Sans first: the labels are measured in it, and matplotlib ships it (the PNG is painted in it)
FONT = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
_PT = 0.72  # points per px: a picture is painted at 100 px to the inch, then scaled by `png`'s scale
_INHERITED = ("font-size", "font-weight", "font-style", "fill", "text-anchor")


def _shown(s: Any) -> str:
    """The text as drawn: each code point XML 1.0 cannot carry (a control character, a lone surrogate
    that no font or encoder takes) becomes U+FFFD, so a reader sees that something was there."""
    return _INVALID_XML.sub("\ufffd", str(s))


def escape(s: Any) -> str:
    """XML-safe text or attribute value (HTML too): escaped, quotes included, and without the code
    points XML 1.0 cannot carry (each becomes U+FFFD).

    Example:
        >>> escape('<a href="x">')
        '&lt;a href=&quot;x&quot;&gt;'
    """
    return html.escape(_shown(s), quote=True)


def num(v: float) -> str:
    """A coordinate, rounded so that the output does not depend on float noise."""
    text = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


@dataclass(frozen=True, slots=True)
class Node:
    """One SVG element.

    Attributes:
        attrs: name and value pairs (numbers are rounded when written; ``None`` values left out).
        children: the elements inside it, in drawing order.
        text: the plain text it shows (a ``<text>``), unescaped.
        title: plain text for a ``<title>`` child: the tooltip a browser shows on hover.
    """

    tag: str
    attrs: tuple[tuple[str, Any], ...] = ()
    children: tuple[Node, ...] = ()
    text: str | None = None
    title: str | None = None

    def get(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.attrs if k == name), default)


def el(
    tag: str,
    attrs: Mapping[str, Any],
    *,
    children: Iterable[Node] = (),
    text: str | None = None,
    title: str | None = None,
) -> Node:
    """One element; attributes whose value is ``None`` are left out.

    Example:
        >>> svg_markup(el("text", {"x": 1.004, "fill": None}, text="a<b"))
        '<text x="1">a&lt;b</text>'
    """
    kept = tuple((k, v) for k, v in attrs.items() if v is not None)
    return Node(tag, kept, tuple(children), text, title)


def svg_markup(node: Node, *, sep: str = "") -> str:
    """``node`` as SVG markup: strings escaped, numbers rounded; ``sep`` between its own children."""
    parts = [node.tag]
    for k, v in node.attrs:
        parts.append(f'{k}="{num(v) if isinstance(v, (int, float)) else escape(v)}"')
    inner = (f"<title>{escape(node.title)}</title>" if node.title is not None else "") + sep.join(
        svg_markup(c) for c in node.children
    )
    if node.text is not None:
        inner += escape(node.text)
    return f"<{' '.join(parts)}>{inner}</{node.tag}>" if inner else f"<{' '.join(parts)}/>"


# --- painting the tree with matplotlib (.png) -----------------------------------------------------


def png(root: Node, *, needs: str, instead: str, scale: float = 1.5) -> bytes:
    """Paint an ``<svg>`` tree as a PNG, ``scale`` pixels to each SVG px, white behind it.

    Understands the elements ``el`` trees of certckpt use: ``svg``, ``g`` (a ``translate``
    transform), ``rect``, ``line``, ``circle``, ``polygon``, ``path`` (``M``/``L`` only) and ``text``
    (in DejaVu Sans, matplotlib's own font and the one the layouts measure). Tooltips are not drawn.

    Args:
        needs, instead: what the message says when matplotlib is missing: what needs it (``a .png
            report``) and what does not (``.svg and .html need nothing more``).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:  # here, not at the top: matplotlib is an optional extra, and only a PNG needs it
        from matplotlib import patches, patheffects
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise MissingDependencyError(
            f"{needs} needs matplotlib: pip install 'certckpt[report]' ({instead}) ({e})"
        ) from e

    width, height = float(root.get("width")), float(root.get("height"))
    fig = Figure(figsize=(width / 100, height / 100), dpi=100 * scale)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # y grows downwards, as in SVG
    ax.set_axis_off()
    _Painter(ax, Line2D, patches, patheffects).paint(root, 0.0, 0.0, {})
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    return buf.getvalue()


def _floats(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?[0-9.]+(?:e-?[0-9]+)?", text)]


@dataclass(slots=True)
class _Painter:
    """Draws a tree on matplotlib axes in SVG px, one artist per element, in document order (the
    matplotlib classes come from ``png``, which imported them or said how to install them)."""

    ax: Any
    line2d: Any
    patches: Any
    patheffects: Any

    def paint(self, node: Node, dx: float, dy: float, inherited: dict[str, Any]) -> None:
        kind = node.tag
        if kind in ("svg", "g"):
            here = {**inherited, **{k: v for k, v in node.attrs if k in _INHERITED}}
            tx, ty = (*_floats(node.get("transform", "")), 0.0, 0.0)[:2]  # translate(x,y), the one transform used
            for child in node.children:
                self.paint(child, dx + tx, dy + ty, here)
        elif kind == "line":
            x1, y1, x2, y2 = (float(node.get(k)) + d for k, d in (("x1", dx), ("y1", dy), ("x2", dx), ("y2", dy)))
            self._line([x1, x2], [y1, y2], node)
        elif kind == "path":
            for seg in re.findall(r"M([^ML]+)L([^ML]+)", node.get("d", "")):
                (x1, y1), (x2, y2) = (_floats(p)[:2] for p in seg)
                self._line([x1 + dx, x2 + dx], [y1 + dy, y2 + dy], node)
        elif kind in ("rect", "circle", "polygon"):
            self._shape(node, dx, dy)
        elif kind == "text" and node.text:
            self._text(node, dx, dy, inherited)

    def _line(self, xs: list[float], ys: list[float], node: Node) -> None:
        lw = float(node.get("stroke-width", 1.0)) * _PT
        dash = node.get("stroke-dasharray")
        cap = "round" if node.get("stroke-linecap") == "round" else "butt"
        line = self.line2d(
            xs,
            ys,
            color=node.get("stroke", "black"),
            linewidth=lw,
            alpha=node.get("stroke-opacity"),
            solid_capstyle=cap,
            dash_capstyle=cap,
        )
        if dash:  # px lengths; matplotlib scales a dash pattern by the line width
            line.set_dashes([v * _PT / max(lw, 1e-6) for v in _floats(dash)])
        self.ax.add_line(line)

    def _shape(self, node: Node, dx: float, dy: float) -> None:
        fill, stroke = node.get("fill", "black"), node.get("stroke")
        style: dict[str, Any] = {
            "facecolor": "none" if fill == "none" else fill,
            "edgecolor": stroke or "none",
            "linewidth": float(node.get("stroke-width", 1.0)) * _PT if stroke else 0.0,
            "joinstyle": "round" if node.get("stroke-linejoin") == "round" else "miter",
        }
        if node.get("fill-opacity") is not None and fill != "none":
            style["facecolor"] = (fill, float(node.get("fill-opacity")))
        if node.tag == "circle":
            centre = (float(node.get("cx")) + dx, float(node.get("cy")) + dy)
            shape: Any = self.patches.Circle(centre, float(node.get("r")))
        elif node.tag == "polygon":
            v = _floats(node.get("points", ""))
            shape = self.patches.Polygon([(x + dx, y + dy) for x, y in zip(v[::2], v[1::2])], closed=True)
        else:
            x, y, w, h = (float(node.get(k, 0)) for k in ("x", "y", "width", "height"))
            rx = float(node.get("rx", 0))
            box = f"round,pad=0,rounding_size={rx}" if rx else "square,pad=0"
            shape = self.patches.FancyBboxPatch((x + dx, y + dy), w, h, boxstyle=box)
        shape.set(**style)
        self.ax.add_patch(shape)

    def _text(self, node: Node, dx: float, dy: float, inherited: dict[str, Any]) -> None:
        attr = {**inherited, **dict(node.attrs)}
        effects = []
        if attr.get("stroke"):  # a halo: the outline under the glyphs (paint-order: stroke)
            halo = float(attr.get("stroke-width", 1)) * _PT
            effects = [self.patheffects.withStroke(linewidth=halo, foreground=attr["stroke"])]
        self.ax.text(
            float(attr.get("x", 0)) + dx,
            float(attr.get("y", 0)) + dy,
            _shown(node.text),
            fontsize=float(attr.get("font-size", 16)) * _PT,
            color=attr.get("fill", "black"),
            ha={"middle": "center", "end": "right"}.get(attr.get("text-anchor", "start"), "left"),
            va="baseline",
            fontweight=attr.get("font-weight", "normal"),
            fontstyle=attr.get("font-style", "normal"),
            family="DejaVu Sans",
            parse_math=False,  # a `$` in a run's name is text, not mathtext
            path_effects=effects,
        )
