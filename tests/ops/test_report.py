"""``certckpt report``: the run timeline (pure), its picture (PNG, SVG, HTML) and the command."""

import json
import re
import struct
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from certckpt.errors import MissingDependencyError
from certckpt.ops.report import CheckpointMark, DetectionMark, DrillMark, Lane, Timeline, render, timeline
from certckpt.ops.timeline_svg import svg
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from certckpt_cli.main import main

RANKS = [0, 1, 2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SVG_NS = "{http://www.w3.org/2000/svg}"
HOSTILE = '<script>&"'


def _ev(branch, step, kind, outcome="pass", *, suspects=(), contained=False, details=None, run="tiny-gpt"):
    return {
        "run": run,
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "ranks": RANKS,
        "suspect_ranks": list(suspects),
        "contained": contained,
        "details": details or {},
        "inventory": {},
    }


def _fp(branch, step):
    return f"fp-{branch}-{step:04d}"


def _full_audit(branch, step, *, replay="pass", suspects=()):
    return [
        _ev(branch, step, "nonfinite-pre"),
        _ev(branch, step, "nonfinite-post"),
        _ev(branch, step, "nonfinite"),
        _ev(branch, step, "replay", replay, suspects=suspects),
        _ev(branch, step, "consensus", details={"fp": _fp(branch, step)}),
    ]


def build_store(root, *, run="tiny-gpt"):
    """Full audits every 10 steps, checkpoints every 5, 3 ranks.

    main: checkpoints 5..20; the replay audit at 20 fails naming rank 1 (last clean point 10):
    5 and 10 trusted, 15 and 20 suspect (after-fault), suspect interval (10, 20].
    b2 resumes from main@10: a contained non-finite at 13 (skipped), checkpoints 15..35 with passing
    audits at 20 and 30: 15..30 trusted, 35 verified (awaiting-audit); latest-good b2@30.
    """
    ledger = Ledger(str(root))
    events = []
    for s in (5, 10, 15, 20):
        ledger.commit_checkpoint(
            branch="main",
            step=s,
            location=str(root / f"main-{s:06d}.safetensors"),
            run=run,
            consensus_fp=_fp("main", s),
        )
        if s % 10:
            events.append(_ev("main", s, "consensus", details={"fp": _fp("main", s)}))
    events += _full_audit("main", 10) + _full_audit("main", 20, replay="fail", suspects=[1])
    ledger.append_events(events)

    ledger.start_branch("b2", parent="main@10")
    events = [_ev("b2", 13, "nonfinite-pre", "fail", suspects=[2], contained=True)]
    for s in (15, 20, 25, 30, 35):
        ledger.commit_checkpoint(
            branch="b2",
            step=s,
            location=str(root / f"b2-{s:06d}.safetensors"),
            run=run,
            parent="main@10",
            consensus_fp=_fp("b2", s),
        )
        if s % 10:
            events.append(_ev("b2", s, "consensus", details={"fp": _fp("b2", s)}))
    events += _full_audit("b2", 20) + _full_audit("b2", 30)
    ledger.append_events(events)
    return ledger


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    build_store(root)
    return root


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_timeline_verdicts_interval_fork_and_latest_good(store):
    tl = timeline(certify_store(str(store), write_certificates=False))
    assert tl.run == "tiny-gpt" and tl.latest_good == "b2@30"
    assert [lane.branch for lane in tl.lanes] == ["main", "b2"]
    main_lane, b2 = tl.lane("main"), tl.lane("b2")
    verdicts = {c.ckpt_id: (c.verdict, c.reasons) for c in tl.checkpoints}
    assert verdicts["main@5"] == ("trusted", ()) and verdicts["main@10"] == ("trusted", ())
    assert verdicts["main@15"] == ("suspect", ("after-fault",)) and verdicts["main@20"] == ("suspect", ("after-fault",))
    assert all(verdicts[f"b2@{s}"] == ("trusted", ()) for s in (15, 20, 25, 30))
    # intact and consistent, only its audit is still to come: verified, not trusted
    assert verdicts["b2@35"] == ("verified", ("awaiting-audit",))
    assert [c.ckpt_id for c in tl.checkpoints if c.latest_good] == ["b2@30"]
    b2_35 = next(c for c in b2.checkpoints if c.step == 35)
    assert b2_35.pending and not next(c for c in main_lane.checkpoints if c.step == 20).pending

    assert main_lane.intervals == [(10, 20)] and b2.intervals == []
    (d,) = main_lane.detections
    assert (d.step, d.kind, d.suspect_ranks, d.contained, d.interval, d.rollback_window) == (
        20,
        "replay",
        (1,),
        False,
        (10, 20),
        10,
    )
    (c,) = b2.detections
    assert c.contained and c.interval is None and c.suspect_ranks == (2,) and c.kind == "nonfinite-pre"

    assert (main_lane.parent, main_lane.fork_step, main_lane.start, main_lane.end) == (None, None, 5, 20)
    assert (b2.parent, b2.fork_step, b2.start, b2.end) == ("main@10", 10, 10, 35)

    # audits: one marker per (step, kind), nonfinite-pre/post folded into nonfinite, a failure wins
    at20 = {a.kind: a.outcome for a in main_lane.audits if a.step == 20}
    assert at20 == {"nonfinite": "pass", "replay": "fail", "consensus": "pass"}
    assert len([a for a in main_lane.audits if a.step == 10]) == 3
    assert {a.outcome for a in b2.audits if a.step == 13} == {"fail"}
    assert len({(a.step, a.kind) for a in b2.audits}) == len(b2.audits)

    doc = json.loads(tl.to_json())
    assert doc["latest_good"] == "b2@30" and doc["lanes"][0]["intervals"] == [[10, 20]]


def test_timeline_pruned_revoked_and_drills(store):
    ledger = Ledger(str(store))
    ledger.retire("main@5", reason="keep-last", policy="keep-last-2")
    ledger.revoke("b2@30", reason="bad data shard", by="ops")
    ledger.record_drill({"kind": "restore-drill", "ckpt_id": "b2@25", "step": 25, "outcome": "pass", "passed": True})
    tl = timeline(certify_store(str(store), write_certificates=False))
    m5 = next(c for c in tl.checkpoints if c.ckpt_id == "main@5")
    assert m5.pruned and not m5.held and m5.verdict == "trusted"
    b30 = next(c for c in tl.checkpoints if c.ckpt_id == "b2@30")
    assert "revoked" in b30.reasons and "bad data shard" in b30.note
    assert tl.latest_good == "b2@25"
    assert [(d.ckpt_id, d.step, d.outcome) for d in tl.lane("b2").drills] == [("b2@25", 25, "pass")]


def test_hostile_drill_records_are_reported_invalid_and_the_report_still_renders(store, tmp_path):
    """A writer without a key records drills whose fields are not what a drill holds: each is listed
    as invalid, left out of the timeline, and the picture is drawn (they used to raise TypeError)."""
    ledger = Ledger(str(store))
    for doc in (
        {"ckpt_id": ["b2@25"], "step": 25, "outcome": "pass"},
        {"ckpt_id": 25, "outcome": "pass"},
        {"ckpt_id": "b2@25", "step": "25", "outcome": "pass"},
        {"ckpt_id": "b2@25", "step": 25, "outcome": {"x": 1}},
    ):
        ledger.record_drill(doc)
    status = certify_store(str(store), write_certificates=False)
    assert len([f for f, _ in status.snapshot.invalid if f.startswith("drills/")]) == 4
    tl = timeline(status)
    assert all(not lane.drills for lane in tl.lanes)
    assert render(tl, tmp_path / "t.svg") == ".svg"


def test_png_is_written_and_plausible(store, tmp_path):
    out = tmp_path / "timeline.png"
    assert render(timeline(certify_store(str(store), write_certificates=False)), out) == ".png"
    data = out.read_bytes()
    w, h = _png_size(data)
    assert 1000 <= w <= 24 * 150 + 200 and 400 <= h <= 16 * 150 + 400 and w > h
    assert 20_000 < len(data) < 3_000_000
    image = pytest.importorskip("matplotlib.image").imread(str(out))
    assert image.shape[:2] == (h, w)
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_width_grows_with_the_steps_within_bounds(tmp_path):
    sizes = []
    for n in (4, 60, 2000):
        root = tmp_path / f"r{n}"
        root.mkdir()
        ledger = Ledger(str(root), chain=False)  # the picture's width is the question: no chains to seal 2,000 times
        events = []
        for s in range(1, n + 1):
            ledger.commit_checkpoint(
                branch="main", step=s, location=str(root / f"{s}.safetensors"), consensus_fp=_fp("main", s)
            )
            events += _full_audit("main", s)
        ledger.append_events(events)
        out = tmp_path / f"t{n}.png"
        render(timeline(certify_store(str(root), write_certificates=False)), out)
        sizes.append(_png_size(out.read_bytes()))
    widths = [w for w, _ in sizes]
    assert widths[0] < widths[1] < widths[2] <= 24 * 150 + 200
    assert widths[0] >= 1000


def test_svg_and_html(store, tmp_path):
    tl = timeline(certify_store(str(store), write_certificates=False))
    out = tmp_path / "t.svg"
    assert render(tl, out) == ".svg"
    text = out.read_text(encoding="utf-8")
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>') and text == svg(tl)
    page = tmp_path / "t.html"
    render(tl, page)
    doc = page.read_text()
    assert doc.startswith("<!DOCTYPE html>") and "data:image/png" not in doc and "<?xml" not in doc
    # the picture is inline: the same SVG element, without the XML declaration a page cannot carry
    (inline,) = re.findall(r"<svg .*?</svg>", doc, flags=re.S)
    assert inline == svg(tl, standalone=False).strip() and ET.fromstring(inline).tag == f"{SVG_NS}svg"
    for cid in ("main@5", "main@20", "b2@30", "b2@35"):
        assert f"<td>{cid}" in doc
    assert "after-fault" in doc and "awaiting-audit" in doc and "(10, 20]" in doc and "forked from main@10" in doc
    with pytest.raises(ValueError, match="unsupported report format '.pdf'"):
        render(tl, tmp_path / "t.pdf")
    with pytest.raises(ValueError):
        render(tl, tmp_path / "t")


def _svg_doc(tl) -> ET.Element:
    return ET.fromstring(svg(tl).encode("utf-8"))


def _groups(root: ET.Element, cls: str) -> list[ET.Element]:
    """The <g> elements whose class list names ``cls``."""
    return [g for g in root.iter(f"{SVG_NS}g") if cls in g.get("class", "").split()]


def _title(el: ET.Element) -> str:
    return el.findtext(f"{SVG_NS}title") or ""


def _texts(root: ET.Element) -> list[str]:
    """What the <text> elements show (a tooltip's <title> child is not shown)."""
    return [(t.text or "") + "".join(child.tail or "" for child in t) for t in root.iter(f"{SVG_NS}text")]


def test_svg_draws_the_timeline(store):
    tl = timeline(certify_store(str(store), write_certificates=False))
    root = _svg_doc(tl)
    assert root.tag == f"{SVG_NS}svg"
    w, h = int(root.get("width")), int(root.get("height"))
    assert root.get("viewBox") == f"0 0 {w} {h}" and 1000 <= w <= 2400 and 300 < h < w
    assert _title(root) == "certckpt timeline — run tiny-gpt"

    # every checkpoint, with its id in a tooltip and its verdict as the mark's class
    marks = {_title(g).split(" ")[0]: g.get("class").split() for g in _groups(root, "checkpoint")}
    assert sorted(marks) == sorted(c.ckpt_id for c in tl.checkpoints)
    trusted = {"main@5", "main@10", "b2@15", "b2@20", "b2@25", "b2@30"}
    assert {cid for cid, cls in marks.items() if "trusted" in cls} == trusted
    assert {cid for cid, cls in marks.items() if "suspect" in cls} == {"main@15", "main@20"}
    assert {cid for cid, cls in marks.items() if "verified" in cls} == {"b2@35"}
    assert "after-fault" in next(_title(g) for g in _groups(root, "checkpoint") if _title(g).startswith("main@20 "))

    (lg,) = _groups(root, "latest-good")
    assert _title(lg) == "latest-good b2@30" and lg.find(f"{SVG_NS}polygon") is not None
    assert "latest-good b2@30" in _texts(root)

    # the suspect interval is shaded from main@10 to main@20 and labelled
    (band,) = _groups(root, "interval")
    rect = band.find(f"{SVG_NS}rect")
    cx = {_title(g).split(" ")[0]: float(g.find(f"{SVG_NS}circle").get("cx")) for g in _groups(root, "checkpoint")}
    assert float(rect.get("x")) == pytest.approx(cx["main@10"], abs=0.01)
    assert float(rect.get("x")) + float(rect.get("width")) == pytest.approx(cx["main@20"], abs=0.01)
    assert "suspect (10, 20]: 10 updates" in _texts(root)
    assert cx["main@5"] < cx["main@10"] < cx["main@15"] < cx["main@20"] == pytest.approx(cx["b2@20"])

    assert len(_groups(root, "detection")) == 2 and len(_groups(root, "contained")) == 1
    assert {"replay fail, rank 1", "nonfinite-pre fail, rank 2, contained", "forked from main@10"} <= set(_texts(root))
    (fork,) = _groups(root, "fork")
    assert _title(fork) == "b2 resumed from main@10"
    assert {"main", "b2", "optimizer step", "latest-good", "check failed"} <= set(_texts(root))

    # the step axis: integer ticks, evenly spaced, spanning the run
    ticks = [int(t) for t in _texts(_groups(root, "axis")[0]) if t.isdigit()]
    assert 4 <= len(ticks) <= 20 and ticks[0] <= 5 and ticks[-1] >= 35
    assert len({b - a for a, b in zip(ticks, ticks[1:])}) == 1
    assert svg(tl) == svg(tl)  # deterministic


def test_svg_shows_pruned_revoked_and_drills(store):
    ledger = Ledger(str(store))
    ledger.retire("main@5", reason="keep-last", policy="keep-last-2")
    ledger.revoke("b2@30", reason="bad data shard", by="ops")
    ledger.record_drill({"kind": "restore-drill", "ckpt_id": "b2@25", "step": 25, "outcome": "pass", "passed": True})
    root = _svg_doc(timeline(certify_store(str(store), write_certificates=False)))
    marks = {_title(g).split(" ")[0]: (g.get("class").split(), _title(g)) for g in _groups(root, "checkpoint")}
    assert "pruned" in marks["main@5"][0] and marks["main@5"][1].endswith("file pruned")
    assert marks["main@5"][0][1] == "trusted"
    assert "suspect" in marks["b2@30"][0] and "bad data shard" in marks["b2@30"][1]
    (drill,) = _groups(root, "drill")
    assert "pass" in drill.get("class").split() and _title(drill) == "restore drill pass on b2@25"
    assert _title(_groups(root, "latest-good")[0]) == "latest-good b2@25"
    assert "restore drill (blue: passed, black: failed)" in _texts(root)


def _hostile_store(root):
    """A store whose records an attacker wrote: a checkpoint id, a branch and a note with markup in them."""
    ledger = build_store(root, run=f"run {HOSTILE}")
    ledger.revoke("main@10", reason=f"note {HOSTILE}</text><script>alert(1)</script>", by=HOSTILE)
    evil = f"x{HOSTILE}"
    (root / "_ledger" / "checkpoints" / "evil.json").write_text(
        json.dumps(
            {
                "ckpt_id": f"{evil}@7",
                "run": None,
                "branch": evil,
                "step": 7,
                "url": "x.safetensors",
                "parent": None,
                "committed_at": 1.0,
            }
        )
    )
    # written by the attacker too: no chain seals it, and a failure counts all the same
    (root / "_ledger" / "events" / "zz-evil.jsonl").write_text(json.dumps(_ev(evil, 7, "replay", "fail", suspects=[0])))


def test_svg_escapes_hostile_text(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    _hostile_store(root)
    status = certify_store(str(root), write_certificates=False)
    # the ledger refuses the forged checkpoint id (it is not branch@step); the event's branch still
    # names a lane, and notes and the run name still carry markup: all of it must stay text
    assert [k for k, _ in status.snapshot.invalid] == ["checkpoints/evil.json"]
    tl = timeline(status)
    assert f"x{HOSTILE}@7" not in [c.ckpt_id for c in tl.checkpoints]
    text = svg(tl)
    assert "<script" not in text and HOSTILE not in text
    root_el = ET.fromstring(text.encode("utf-8"))  # well-formed: nothing broke out of its string
    tags = {el.tag for el in root_el.iter()}
    assert tags <= {f"{SVG_NS}{t}" for t in ("svg", "title", "g", "rect", "line", "circle", "polygon", "path", "text")}
    # the hostile strings survive as text: ids in tooltips, names and notes as drawn
    titles = [_title(g) for g in root_el.iter() if _title(g)]
    assert any(f"note {HOSTILE}</text><script>alert(1)</script>" in t for t in titles)
    assert _title(root_el) == f"certckpt timeline — run run {HOSTILE}"
    assert f"x{HOSTILE}" in _texts(root_el)  # the lane's name


def test_svg_survives_characters_xml_cannot_carry():
    lane = Lane(
        branch="a\x00b\x1bc",
        start=1,
        end=9,
        detections=[DetectionMark(step=5, kind="replay\ufffe", suspect_ranks=(1,), interval=(1, 5))],
        intervals=[(1, 5)],
    )
    root = ET.fromstring(svg(Timeline(store="s\x07", run=None, latest_good=None, lanes=[lane])).encode("utf-8"))
    assert "a\ufffdb\ufffdc" in _texts(root) and "replay\ufffd fail, rank 1" in _texts(root)


def test_svg_of_an_empty_timeline_is_a_document():
    root = ET.fromstring(svg(Timeline(store="/x/run", run=None, latest_good=None)).encode("utf-8"))
    assert _title(root) == "certckpt timeline — run run" and "nothing recorded" in _texts(root)


def _crowded_timeline() -> Timeline:
    """Three lanes of 12 checkpoints, detections a step or two apart, two intervals, drills, forks."""

    def lane(branch, first, *, parent=None, dets=(), intervals=(), latest=None):
        steps = range(first, first + 120, 10)
        fork = first - 5 if parent else None
        marks = [
            CheckpointMark(
                ckpt_id=f"{branch}@{s}",
                step=s,
                verdict="trusted" if s < first + 60 else "suspect",
                latest_good=f"{branch}@{s}" == latest,
            )
            for s in steps
        ]
        return Lane(
            branch=branch,
            parent=parent,
            fork_step=fork,
            start=fork or first,
            end=steps[-1],
            checkpoints=marks,
            intervals=list(intervals),
            detections=[DetectionMark(**d) for d in dets],
            drills=[DrillMark(ckpt_id=f"{branch}@{first + 10}", step=first + 10, outcome="pass")],
        )

    main = lane(
        "main",
        10,
        dets=[
            dict(step=41, kind="nonfinite-pre", suspect_ranks=(5,), contained=True),
            dict(step=43, kind="nonfinite-post", suspect_ranks=(5, 6), contained=True),
            dict(step=90, kind="replay", suspect_ranks=(3,), interval=(80, 90)),
            dict(step=92, kind="consensus", suspect_ranks=(3, 4), interval=(80, 92)),
        ],
        intervals=[(80, 90), (80, 92)],
        latest="main@40",
    )
    b2 = lane(
        "b2",
        65,
        parent="main@60",
        dets=[dict(step=s, kind="replay", suspect_ranks=(1,), interval=(s - 10, s)) for s in (125, 127, 135)],
        intervals=[(115, 125), (117, 127)],
    )
    b3 = lane("b3", 85, parent="main@80", latest="b3@125")
    return Timeline(store="s", run="crowded", latest_good="b3@125", lanes=[main, b2, b3])


def test_svg_labels_do_not_overlap():
    root = ET.fromstring(svg(_crowded_timeline()).encode("utf-8"))
    lanes = _groups(root, "lane")
    assert len(lanes) == 3
    shown = set()
    for lane in lanes:
        boxes = []
        for t in lane.iter(f"{SVG_NS}text"):
            size, text = float(t.get("font-size")), (t.text or "") + "".join(c.tail or "" for c in t)
            w = 0.5 * size * len(text)  # narrower than any of the fonts named: a real overlap shows
            cx, cy = float(t.get("x")), float(t.get("y")) - 0.35 * size
            boxes.append((text, cx - w / 2, cy - size / 2, cx + w / 2, cy + size / 2))
            shown.add(text)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not (a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]), (a, b)
    assert {
        "nonfinite-post fail, ranks 5,6, contained",
        "consensus fail, ranks 3,4",
        "suspect (117, 127]: 10 updates",
        "latest-good main@40",
        "latest-good b3@125",
        "forked from main@80",
    } <= shown
    assert not [t for t in _texts(root) if "left out" in t]


def test_svg_leaves_out_labels_it_has_no_room_for_and_says_so():
    dets = [DetectionMark(step=s, kind="replay", suspect_ranks=(s % 4,), interval=(s - 1, s)) for s in range(1, 200)]
    lane = Lane(branch="main", start=0, end=200, detections=dets)
    root = ET.fromstring(svg(Timeline(store="s", run="r", latest_good=None, lanes=[lane])).encode("utf-8"))
    labels = [t for t in _texts(root) if t.startswith("replay fail")]
    assert 20 < len(labels) < len(dets) and len(_groups(root, "detection")) == len(dets)
    (note,) = [t for t in _texts(root) if "left out for room" in t]
    assert note.startswith(f"{len(dets) - len(labels)} labels left out")


def test_svg_sizes_follow_the_run(tmp_path):
    sizes = []
    for n in (4, 60, 400):
        lane = Lane(branch="main", start=1, end=n)
        lane.checkpoints = [CheckpointMark(ckpt_id=f"main@{s}", step=s, verdict="trusted") for s in range(1, n + 1)]
        root = ET.fromstring(svg(Timeline(store="s", run="r", latest_good=None, lanes=[lane])).encode("utf-8"))
        r = float(_groups(root, "checkpoint")[0].find(f"{SVG_NS}circle").get("r"))
        sizes.append((int(root.get("width")), r))
    assert sizes[0][0] == 1000 < sizes[1][0] < sizes[2][0] == 2400
    assert sizes[0][1] > sizes[2][1] >= 2.5  # crowded lanes get smaller marks


BLOCKER = textwrap.dedent("""
    import importlib.abc, json, sys

    class Block(importlib.abc.MetaPathFinder):  # as if none of these were installed
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("matplotlib", "numpy", "PIL", "torch"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, Block())
    from certckpt.errors import MissingDependencyError
    from certckpt.ops.report import render, timeline
    from certckpt.trust.runstore import certify_store

    store, out = sys.argv[1], sys.argv[2]
    tl = timeline(certify_store(store, write_certificates=False))
    written = [render(tl, f"{out}/t.svg"), render(tl, f"{out}/t.html")]
    try:
        render(tl, f"{out}/t.png")
        error = None
    except MissingDependencyError as e:
        error = str(e)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("matplotlib", "numpy", "PIL", "torch"))
    print(json.dumps({"written": written, "png_error": error, "loaded": loaded}))
""")


def test_svg_and_html_need_no_matplotlib_png_names_the_extra(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", BLOCKER, str(store), str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["written"] == [".svg", ".html"] and res["loaded"] == []
    assert res["png_error"] is not None and "\n" not in res["png_error"]
    assert res["png_error"].startswith("a .png report needs matplotlib: pip install 'certckpt[report]'")
    assert not (out / "t.png").exists()
    root = ET.parse(out / "t.svg").getroot()
    assert {"main@5", "b2@30", "b2@35"} <= {_title(g).split(" ")[0] for g in _groups(root, "checkpoint")}
    assert _title(_groups(root, "latest-good")[0]) == "latest-good b2@30"
    assert "suspect (10, 20]: 10 updates" in _texts(root)
    page = (out / "t.html").read_text()
    assert "<td>b2@30 &#9733;</td>" in page and ET.fromstring(re.search(r"<svg .*?</svg>", page, re.S)[0]) is not None


def test_html_escapes_hostile_text(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    hostile_run = "<img src=x onerror=alert(1)>"
    ledger = build_store(root, run=hostile_run)
    ledger.revoke("main@10", reason="<script>alert('pwn')</script> & $x$", by="<b>mallory</b>")
    (root / "_ledger" / "events" / "zz-evil.jsonl").write_text(  # an attacker's segment: it counts (a failure)
        json.dumps(_ev("<i>evil</i> $5", 3, "replay", "fail", suspects=[0], run=hostile_run))
    )
    tl = timeline(certify_store(str(root), write_certificates=False))
    assert "<i>evil</i> $5" in [lane.branch for lane in tl.lanes]
    page = tmp_path / "t.html"
    render(tl, page)
    doc = page.read_text()
    for raw in ("<script>", hostile_run, "<i>", "<b>mallory</b>"):
        assert raw not in doc
    assert "&lt;script&gt;alert(&#x27;pwn&#x27;)&lt;/script&gt; &amp; $x$" in doc
    assert "&lt;i&gt;evil&lt;/i&gt; $5" in doc and "&lt;img src=x onerror=alert(1)&gt;" in doc
    render(tl, tmp_path / "t.png")  # `$` in text is not taken for mathtext
    assert _png_size((tmp_path / "t.png").read_bytes())[0] > 0


def test_missing_matplotlib_names_the_extra(store, tmp_path, monkeypatch):
    tl = timeline(certify_store(str(store), write_certificates=False))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'certckpt\[report\]'"):
        render(tl, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
    assert render(tl, tmp_path / "t.svg") == ".svg" and render(tl, tmp_path / "t.html") == ".html"
    assert "b2@30" in (tmp_path / "t.svg").read_text() and "b2@30" in (tmp_path / "t.html").read_text()


def test_cli_writes_and_refuses_to_overwrite(store, tmp_path):
    out = tmp_path / "timeline.png"
    r = CliRunner().invoke(main, ["report", str(store), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.count("\n") == 1 and str(out) in r.output
    assert "9 checkpoints" in r.output and "2 detections" in r.output and "latest-good b2@30" in r.output
    assert out.read_bytes()[:8] == PNG_MAGIC
    before = out.read_bytes()
    r = CliRunner().invoke(main, ["report", str(store), "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output and "Traceback" not in r.output
    assert out.read_bytes() == before
    r = CliRunner().invoke(main, ["report", str(store), "--out", str(out), "--force"])
    assert r.exit_code == 0, r.output
    # a report reads the store: it records no certificates there
    assert not (store / "_ledger" / "certificates").exists()


def test_cli_json_and_html(store, tmp_path):
    out = tmp_path / "timeline.html"
    r = CliRunner().invoke(main, ["report", str(store), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["latest_good"] == "b2@30" and [lane["branch"] for lane in doc["lanes"]] == ["main", "b2"]
    assert doc["lanes"][1]["parent"] == "main@10" and doc["lanes"][1]["fork_step"] == 10
    assert out.exists() and "b2@30" in out.read_text()


def test_cli_errors_are_one_line_exit_2(tmp_path, store):
    runner = CliRunner()
    r = runner.invoke(main, ["report", str(tmp_path / "nowhere" / "run"), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 2 and "no such run store" in r.output and len(r.output.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    r = runner.invoke(main, ["report", str(empty), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 2 and "no ledger records" in r.output and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(main, ["report", str(store), "--out", str(tmp_path / "a.pdf")])
    assert r.exit_code == 2 and "unsupported report format" in r.output and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(main, ["report", str(store), "--out", str(tmp_path / "no-dir" / "a.png")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    bad = store / "_ledger" / "checkpoints" / "zz@1.json"
    bad.write_text("{not json")
    # a record that is not JSON is evidence of nothing: listed as invalid, the report still drawn
    r = runner.invoke(main, ["report", str(store), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 0 and "Traceback" not in r.output and (tmp_path / "a.png").exists()


def test_help_and_import_stay_light():
    code = (
        "import sys\n"
        "import certckpt.ops.report, certckpt_cli.report_cmd\n"
        "from certckpt_cli.main import main\n"
        "try:\n    main(['report', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch'\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
