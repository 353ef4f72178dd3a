"""Issue 45, "The timeline": a run made suspect by a conviction in a fleet registry shows the
conviction (the device, the run and step that convicted it), its legend lists only the marks it
holds, and its axis starts at step 0."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from certckpt.ops.timeline import timeline
from certckpt.ops.timeline_svg import svg
from certckpt.trust.fleet import Fleet
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store

NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def no_keys(monkeypatch, tmp_path):
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))


def _convicted_run(tmp_path):
    """Run B, resumed at step 40 on gpu-x and audited every 10 steps; later run A's replay audit at
    step 5 convicts gpu-x: every checkpoint of B is suspect, with no detection of its own."""
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    Fleet(str(fleet), signing_key=None).create()
    store = tmp_path / "b"
    store.mkdir()
    led = Ledger(str(store), signing_key=None)
    Fleet(str(fleet), signing_key=None).register_store(str(store))
    led.record_placement(
        branch="main", start_step=40, devices={"0": "gpu-w", "1": "gpu-x"}, hosts={"1": "node-x"}, fleet=str(fleet)
    )
    events = []
    for s in (50, 60, 70):
        for kind in ("replay", "nonfinite", "consensus"):
            events.append(
                {"run": "b", "branch": "main", "step": s, "kind": kind, "outcome": "pass", "ranks": [0, 1]}
                | {"details": {"fp": f"fp{s}"} if kind == "consensus" else {}}
            )
    led.append_events(events)
    for s in (50, 60, 70):
        led.commit_checkpoint(branch="main", step=s, location=str(store / f"m{s}.safetensors"), consensus_fp=f"fp{s}")
    evidence = {"store": str(tmp_path / "a"), "run": "a", "branch": "main", "step": 5, "check": "replay", "rank": 1}
    Fleet(str(fleet), signing_key=None).convict(device="gpu-x", inventory={"host": "node-x"}, evidence=evidence)
    return str(store)


def test_the_timeline_shows_the_conviction_that_made_a_run_suspect(tmp_path):
    status = certify_store(_convicted_run(tmp_path), write_certificates=False)
    tl = timeline(status)
    assert {c.verdict for c in tl.checkpoints} == {"suspect"} and tl.detections == []
    (conv,) = tl.convictions
    assert (conv.device, conv.start, conv.end, conv.by_run, conv.by_step, conv.host) == (
        "gpu-x",
        40,
        None,
        "a",
        5,
        "node-x",
    )
    root = ET.fromstring(svg(tl).split("\n", 1)[1])
    texts = [(t.text or "") + "".join(c.tail or "" for c in t) for t in root.iter(f"{NS}text")]
    sub = next(t for t in texts if t.startswith("latest-good:"))
    assert "0 detections" in sub and "device gpu-x convicted by another run: 3 checkpoints suspect" in sub
    assert "device gpu-x convicted (replay at step 5 of run a)" in texts
    bars = [g for g in root.iter(f"{NS}g") if g.get("class") == "conviction"]
    assert len(bars) == 1 and "computed steps (40, the end of the branch]" in bars[0].find(f"{NS}title").text
    # the legend: only what the picture holds, the suspect reason named
    legend = next(g for g in root.iter(f"{NS}g") if g.get("class") == "legend")
    entries = [t.text for t in legend.iter(f"{NS}text")]
    assert "suspect (device-convicted)" in entries
    assert "steps a device convicted in the fleet registry computed" in entries
    for absent in ("checkpoint: trusted", "detection (ranks named)", "suspect interval (c, d]", "check failed"):
        assert absent not in entries, entries
    assert not any(e.startswith(("fork", "restore drill", "contained", "hollow", "latest-good")) for e in entries)
    # the axis starts at step 0, though the run resumed at step 40
    axis = next(g for g in root.iter(f"{NS}g") if g.get("class") == "axis")
    ticks = [int(t.text) for t in axis.iter(f"{NS}text") if (t.text or "").isdigit()]
    assert ticks[0] == 0 and ticks[-1] >= 70


def test_the_timeline_as_data_carries_the_conviction(tmp_path):
    tl = timeline(certify_store(_convicted_run(tmp_path), write_certificates=False))
    doc = tl.to_dict()
    (lane,) = doc["lanes"]
    assert lane["convictions"][0]["device"] == "gpu-x" and lane["convictions"][0]["by_check"] == "replay"
