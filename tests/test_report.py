"""``certckpt report``: the run timeline (pure), its picture (PNG, SVG, HTML) and the command."""

import json
import struct
import subprocess
import sys

import pytest
from click.testing import CliRunner

from certckpt.errors import MissingDependencyError
from certckpt.trust.ledger import Ledger
from certckpt.ops.report import render, timeline
from certckpt.trust.runstore import certify_store
from certckpt_cli.main import main

RANKS = [0, 1, 2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ev(branch, step, kind, outcome="pass", *, suspects=(), contained=False, details=None, run="tiny-gpt"):
    return {"run": run, "branch": branch, "step": step, "kind": kind, "outcome": outcome, "ranks": RANKS,
            "suspect_ranks": list(suspects), "contained": contained, "details": details or {}, "inventory": {}}


def _fp(branch, step):
    return f"fp-{branch}-{step:04d}"


def _full_audit(branch, step, *, replay="pass", suspects=()):
    return [_ev(branch, step, "nonfinite-pre"), _ev(branch, step, "nonfinite-post"), _ev(branch, step, "nonfinite"),
            _ev(branch, step, "replay", replay, suspects=suspects),
            _ev(branch, step, "consensus", details={"fp": _fp(branch, step)})]


def build_store(root, *, run="tiny-gpt"):
    """Full audits every 10 steps, checkpoints every 5, 3 ranks.

    main: checkpoints 5..20; the replay audit at 20 fails naming rank 1 (last clean point 10):
    5 and 10 trusted, 15 and 20 suspect (after-fault), suspect interval (10, 20].
    b2 resumes from main@10: a contained non-finite at 13 (skipped), checkpoints 15..35 with passing
    audits at 20 and 30: 15..30 trusted, 35 suspect (awaiting-audit); latest-good b2@30.
    """
    ledger = Ledger(str(root))
    events = []
    for s in (5, 10, 15, 20):
        ledger.commit_checkpoint(branch="main", step=s, location=str(root / f"main-{s:06d}.safetensors"), run=run,
                                 consensus_fp=_fp("main", s))
        if s % 10:
            events.append(_ev("main", s, "consensus", details={"fp": _fp("main", s)}))
    events += _full_audit("main", 10) + _full_audit("main", 20, replay="fail", suspects=[1])
    ledger.append_events(events)

    ledger.start_branch("b2", parent="main@10")
    events = [_ev("b2", 13, "nonfinite-pre", "fail", suspects=[2], contained=True)]
    for s in (15, 20, 25, 30, 35):
        ledger.commit_checkpoint(branch="b2", step=s, location=str(root / f"b2-{s:06d}.safetensors"), run=run,
                                 parent="main@10", consensus_fp=_fp("b2", s))
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
    assert verdicts["b2@35"] == ("suspect", ("awaiting-audit",))
    assert [c.ckpt_id for c in tl.checkpoints if c.latest_good] == ["b2@30"]
    b2_35 = next(c for c in b2.checkpoints if c.step == 35)
    assert b2_35.pending and not next(c for c in main_lane.checkpoints if c.step == 20).pending

    assert main_lane.intervals == [(10, 20)] and b2.intervals == []
    (d,) = main_lane.detections
    assert (d.step, d.kind, d.suspect_ranks, d.contained, d.interval, d.rollback_window) == (20, "replay", (1,), False, (10, 20), 10)
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
        ledger = Ledger(str(root))
        events = []
        for s in range(1, n + 1):
            ledger.commit_checkpoint(branch="main", step=s, location=str(root / f"{s}.safetensors"), consensus_fp=_fp("main", s))
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
    svg = tmp_path / "t.svg"
    render(tl, svg)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    page = tmp_path / "t.html"
    render(tl, page)
    doc = page.read_text()
    assert doc.startswith("<!DOCTYPE html>") and "data:image/png;base64," in doc
    for cid in ("main@5", "main@20", "b2@30", "b2@35"):
        assert f"<td>{cid}" in doc
    assert "after-fault" in doc and "awaiting-audit" in doc and "(10, 20]" in doc and "forked from main@10" in doc
    with pytest.raises(ValueError, match="unsupported report format '.pdf'"):
        render(tl, tmp_path / "t.pdf")
    with pytest.raises(ValueError):
        render(tl, tmp_path / "t")


def test_html_escapes_hostile_text(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    hostile_run = "<img src=x onerror=alert(1)>"
    ledger = build_store(root, run=hostile_run)
    ledger.revoke("main@10", reason="<script>alert('pwn')</script> & $x$", by="<b>mallory</b>")
    ledger.append_events([_ev("<i>evil</i> $5", 3, "replay", "fail", suspects=[0], run=hostile_run)])
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
    r = runner.invoke(main, ["report", str(store), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 2 and "unreadable" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "a.png").exists()


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
