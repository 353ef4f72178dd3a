"""``certckpt.ops.drawing``: the one drawing model of the ops pictures, its one escape, and the PNG
painted from the same tree as the SVG (the timeline's and the fleet's)."""

import struct
import sys
import xml.etree.ElementTree as ET

import pytest

from certckpt.errors import MissingDependencyError
from certckpt.ops.drawing import el, escape, png, svg_markup
from certckpt.ops.fleet_chart import rates_svg, render_rates
from certckpt.ops.report import render
from certckpt.ops.timeline import DetectionMark, Lane, Timeline
from certckpt.ops.timeline_svg import picture, svg

HOSTILE = 'a\x00<b>&"\ud800\ufffe'


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_one_escape_for_text_and_attributes():
    assert escape(HOSTILE) == "a\ufffd&lt;b&gt;&amp;&quot;\ufffd\ufffd"
    node = el("g", {"class": HOSTILE, "x": 1.005, "y": None}, children=[el("text", {}, text=HOSTILE)], title="<t>")
    markup = svg_markup(node)
    root = ET.fromstring(markup)
    assert root.get("class") == 'a\ufffd<b>&"\ufffd\ufffd' and root.get("x") == "1" and root.get("y") is None
    assert root.findtext("title") == "<t>" and root.findtext("text") == 'a\ufffd<b>&"\ufffd\ufffd'


def _hostile_timeline() -> Timeline:
    lane = Lane(
        branch=HOSTILE,
        start=1,
        end=9,
        detections=[DetectionMark(step=5, kind=f"replay {HOSTILE} $x$", suspect_ranks=(1,), interval=(1, 5))],
        intervals=[(1, 5)],
    )
    return Timeline(store="s", run=f"run {HOSTILE}", latest_good=None, lanes=[lane])


def test_the_png_is_painted_from_the_svg_drawing(tmp_path):
    pytest.importorskip("matplotlib")
    tl = _hostile_timeline()
    root = ET.fromstring(svg(tl).encode("utf-8"))  # a lone surrogate and NUL are drawn as U+FFFD
    assert render(tl, tmp_path / "t.png") == ".png"
    w, h = _png_size((tmp_path / "t.png").read_bytes())
    # one drawing: the PNG is the SVG canvas at 1.5 pixels per SVG px
    assert (w, h) == (int(1.5 * int(root.get("width"))), int(1.5 * int(root.get("height"))))
    assert picture(tl).get("width") == int(root.get("width"))


def test_fleet_chart_uses_the_same_drawing_and_escape(tmp_path):
    doc = {
        "fleet": f"fleet {HOSTILE}",
        "hosts": [{"host": "node-a"}],
        "devices": [
            {
                "host": "node-a",
                "device": f"gpu {HOSTILE}",
                "per_million": 12.5,
                "detections": 1,
                "device_steps": 80_000,
            },
            {"host": "node-a", "device": "gpu-1", "per_million": None, "detections": 1, "device_steps": 0},
        ],
    }
    text = rates_svg(doc)
    assert text.startswith("<svg") and "<b>" not in text
    root = ET.fromstring(text.encode("utf-8"))
    shown = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert 'node-a / gpu a\ufffd<b>&"\ufffd\ufffd' in shown and "no recorded steps (1 in 0 steps)" in shown
    assert render_rates(doc, tmp_path / "r.svg") == ".svg"
    pytest.importorskip("matplotlib")
    assert render_rates(doc, tmp_path / "r.png") == ".png"
    assert _png_size((tmp_path / "r.png").read_bytes()) == (int(1.5 * 1060), int(1.5 * int(root.get("height"))))


def test_png_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        MissingDependencyError, match=r"a \.png chart needs matplotlib: pip install 'certckpt\[report\]' \(x\)"
    ):
        png(el("svg", {"width": 10, "height": 10}), needs="a .png chart", instead="x")
