"""Issue 46, "``certckpt report`` shows triggered replays on the timeline": a clean replay the
sentinels asked for between audits is its own mark (dashed: it vouches for its step only), listed in
the legend, and never read as a step where nothing was recomputed."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from certckpt.ops.timeline import timeline
from certckpt.ops.timeline_svg import svg
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store

NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def no_keys(monkeypatch, tmp_path):
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))


def _event(step: int, kind: str) -> dict:
    return {"run": "r", "branch": "main", "step": step, "kind": kind, "outcome": "pass", "ranks": [0, 1, 2]} | {
        "details": {"fp": f"fp{step}"} if kind == "consensus" else {}
    }


def test_a_triggered_replay_is_its_own_mark_and_legend_entry(tmp_path):
    led = Ledger(str(tmp_path), signing_key=None)
    events = [_event(s, k) for s in (10, 20) for k in ("replay", "nonfinite", "consensus")]
    events += [_event(13, "nonfinite"), _event(13, "triggered-replay")]
    led.append_events(events)
    for s in (10, 20):
        led.commit_checkpoint(
            branch="main", step=s, location=str(tmp_path / f"m{s}.safetensors"), consensus_fp=f"fp{s}"
        )
    root = ET.fromstring(svg(timeline(certify_store(str(tmp_path), write_certificates=False))).split("\n", 1)[1])
    marks = {g.get("class"): g for g in root.iter(f"{NS}g") if "pass" in (g.get("class") or "")}
    (tick,) = [g for g in root.iter(f"{NS}g") if g.get("class") == "triggered replay pass"]
    assert (
        tick.find(f"{NS}title").text.startswith("step 13: ") and "triggered-replay pass" in tick.find(f"{NS}title").text
    )
    assert tick.find(f"{NS}line").get("stroke-dasharray") == "2 2"
    assert "audit pass" in marks and "check pass" not in marks  # every marked step recomputed something
    legend = next(g for g in root.iter(f"{NS}g") if g.get("class") == "legend")
    entries = [t.text for t in legend.iter(f"{NS}text")]
    assert "triggered replay passed (its step recomputed)" in entries
    assert "consensus only passed (no replay)" not in entries
