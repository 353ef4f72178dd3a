"""Issue 45, "Fleet answers that go stale or lie": `fleet impact` before and after a conviction, a store
the registry cannot read (exit 2, never "nothing affected"), rates by the host a detection ran on,
`incident show`'s current latest-good, and a registry read once while it is unchanged."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from certckpt.trust.fleet import Fleet
from certckpt.trust.fleetscan import fleet_rates, impact
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store, open_incident
from certckpt_cli.main import main


@pytest.fixture(autouse=True)
def no_keys(monkeypatch, tmp_path):
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))


def _events(branch: str, steps, *, run="r"):
    out = []
    for s in steps:
        for kind in ("replay", "nonfinite", "consensus"):
            details = {"fp": f"fp{s}"} if kind == "consensus" else {}
            out.append(
                {"run": run, "branch": branch, "step": s, "kind": kind, "outcome": "pass", "ranks": [0, 1, 2]}
                | {"details": details}
            )
    return out


def _store(tmp_path, fleet: str, name="run", *, devices=None, hosts=None) -> tuple[str, Ledger]:
    """A run store placed on ``devices`` from step 0 under ``fleet``, audited every 5 steps, with
    checkpoints at 5, 10 and 15."""
    store = tmp_path / name
    store.mkdir()
    led = Ledger(str(store), signing_key=None)
    Fleet(fleet, signing_key=None).register_store(str(store))
    led.record_placement(branch="main", start_step=0, devices=devices or {"0": "gpu-y"}, hosts=hosts or {}, fleet=fleet)
    led.append_events(_events("main", (5, 10, 15, 20)))
    for s in (5, 10, 15):
        led.commit_checkpoint(branch="main", step=s, location=str(store / f"m{s}.safetensors"), consensus_fp=f"fp{s}")
    return str(store), led


def _fleet(tmp_path) -> str:
    root = tmp_path / "fleet"
    root.mkdir()
    Fleet(str(root), signing_key=None).create()
    return str(root)


EVIDENCE = {"run": "r", "branch": "main", "step": 20, "check": "replay", "rank": 0, "incident_id": "i"}


def test_fleet_answers_impact_lists_what_a_conviction_made_suspect_before_and_after(tmp_path):
    fleet = _fleet(tmp_path)
    store, _ = _store(tmp_path, fleet)
    before = impact(fleet, "gpu-y")
    assert [(c["ckpt_id"], c["verdict"], c["verdict_with"]) for c in before.changes] == [
        ("main@10", "trusted", "suspect"),
        ("main@15", "trusted", "suspect"),
        ("main@5", "trusted", "suspect"),
    ]
    Fleet(fleet, signing_key=None).convict(device="gpu-y", inventory={}, evidence={**EVIDENCE, "store": store})
    after = impact(fleet, "gpu-y")
    assert after.already_convicted and [c["ckpt_id"] for c in after.changes] == [c["ckpt_id"] for c in before.changes]
    assert {c["verdict"] for c in after.changes} == {"suspect"} and {c["verdict_without"] for c in after.changes} == {
        "trusted"
    }
    r = CliRunner().invoke(main, ["fleet", "impact", "gpu-y", "--fleet", fleet])
    assert r.exit_code == 0, r.output
    assert "gpu-y (convicted): 3 checkpoint(s) are suspect because of its conviction" in r.output
    assert "main@15" in r.output and "no checkpoint" not in r.output
    # what `status` shows agrees with it
    verdicts = certify_store(store, write_certificates=False).certification.verdicts
    assert sorted(c for c, v in verdicts.items() if "device-convicted" in v.reasons) == ["main@10", "main@15", "main@5"]


def test_fleet_answers_a_store_that_cannot_be_read_exits_2_never_nothing_affected(tmp_path, monkeypatch):
    fleet = _fleet(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    os.mkdir("runD")
    Fleet(fleet, signing_key=None).register_store("runD")  # as `ledger="runD"` gives it: recorded absolute
    assert Fleet(fleet, signing_key=None).read().stores == [str(work / "runD")]
    monkeypatch.chdir(tmp_path)  # another directory
    ok = CliRunner().invoke(main, ["fleet", "impact", "gpu-y", "--fleet", fleet])
    assert ok.exit_code == 0, ok.output
    # a registry written before URLs were made absolute: a relative name is never resolved here
    Fleet(fleet, signing_key=None).ledger.write_record("stores", "old.json", {"store": "runE"})
    r = CliRunner().invoke(main, ["fleet", "impact", "gpu-y", "--fleet", fleet])
    assert r.exit_code == 2 and "cannot read store runE: recorded by the relative path" in r.output, r.output
    assert "could not be read" in r.output
    r = CliRunner().invoke(main, ["fleet", "rates", "--fleet", fleet, "--json"])
    assert r.exit_code == 2
    # a registered store deleted: the same
    store, _ = _store(tmp_path, fleet, "gone")
    import shutil

    shutil.rmtree(store)
    out = impact(fleet, "gpu-y")
    assert not out.complete and {u["store"] for u in out.unreadable} == {"runE", store}


def test_fleet_answers_rates_put_a_detection_on_the_host_its_step_ran_on(tmp_path):
    fleet = _fleet(tmp_path)
    store = tmp_path / "run"
    store.mkdir()
    led = Ledger(str(store), signing_key=None)
    Fleet(fleet, signing_key=None).register_store(str(store))
    # one device id on two hosts (an inventory override reused, or a part moved): main on h1, other on h2
    led.record_placement(branch="main", start_step=0, devices={"0": "gpu-0"}, hosts={"0": "h1"}, fleet=fleet)
    led.record_placement(branch="other", start_step=0, devices={"0": "gpu-0"}, hosts={"0": "h2"}, fleet=fleet)
    for b in ("main", "other"):
        led.commit_checkpoint(branch=b, step=10, location=str(store / f"{b}.safetensors"))
    evidence = {**EVIDENCE, "store": str(store), "branch": "other", "step": 5}
    Fleet(fleet, signing_key=None).convict(device="gpu-0", inventory={}, evidence=evidence)  # no host of its own
    doc = fleet_rates(fleet)
    hosts = {r["host"]: (r["detections"], r["device_steps"]) for r in doc["hosts"]}
    assert hosts == {"h1": (0, 10), "h2": (1, 10)}, doc
    (dev,) = doc["devices"]
    assert (dev["device"], dev["detections"], dev["device_steps"], dev["host"]) == ("gpu-0", 1, 20, "h1, h2")


def test_fleet_answers_incident_show_gives_the_current_latest_good_beside_the_recorded_one(tmp_path):
    fleet = _fleet(tmp_path)
    store = tmp_path / "run"
    store.mkdir()
    led = Ledger(str(store), signing_key=None)
    Fleet(fleet, signing_key=None).register_store(str(store))
    led.record_placement(branch="main", start_step=0, devices={"0": "gpu-a"}, fleet=fleet)
    led.record_placement(branch="main", start_step=10, devices={"0": "gpu-x"}, fleet=fleet)
    led.append_events(_events("main", (5, 10, 15, 20)))
    for s in (5, 10, 15):
        led.commit_checkpoint(branch="main", step=s, location=str(store / f"m{s}.safetensors"), consensus_fp=f"fp{s}")
    fail = {"run": "r", "branch": "main", "step": 25, "kind": "replay", "outcome": "fail", "ranks": [0, 1, 2]}
    fail |= {"suspect_ranks": [1], "details": {}}
    led.append_events([fail])
    iid = open_incident(led, fail)
    r = CliRunner().invoke(main, ["incident", "show", str(store), iid])
    assert "latest-good     main@15 (recorded at the detection)" in r.output, r.output
    assert "latest-good now main@15 (unchanged)" in r.output
    # later, another run convicts gpu-x, which computed steps 11..15: main@15 is suspect now
    Fleet(fleet, signing_key=None).convict(device="gpu-x", inventory={}, evidence={**EVIDENCE, "store": "elsewhere"})
    r = CliRunner().invoke(main, ["incident", "show", str(store), iid])
    assert "latest-good     main@15 (recorded at the detection)" in r.output, r.output
    assert "latest-good now main@10 (changed since the detection; main@15 is suspect: device-convicted)" in r.output
    doc = json.loads(CliRunner().invoke(main, ["incident", "show", str(store), iid, "--json"]).output)
    assert doc["opened"]["checkpoints"]["latest_good"] == "main@15" and doc["latest_good_now"]["ckpt"] == "main@10"


def test_fleet_answers_status_reads_an_unchanged_registry_once(tmp_path, monkeypatch):
    fleet = _fleet(tmp_path)
    store, _ = _store(tmp_path, fleet)
    reads = []
    real = Ledger.snapshot

    def counting(self, **kw):
        if self.store == fleet:
            reads.append(1)
        return real(self, **kw)

    monkeypatch.setattr(Ledger, "snapshot", counting)
    first = certify_store(store, write_certificates=False)
    assert len(reads) == 1 and first.certification.verdicts["main@15"].trusted
    certify_store(store, write_certificates=False)
    assert len(reads) == 1  # unchanged: what the chains proved is taken from this reader's memory
    Fleet(fleet, signing_key=None).convict(device="gpu-y", inventory={}, evidence={**EVIDENCE, "store": store})
    after = certify_store(store, write_certificates=False)
    assert len(reads) == 2 and after.certification.verdicts["main@15"].reasons[-1] == "device-convicted"
    certify_store(store, write_certificates=False)
    assert len(reads) == 2
    # a conviction deleted behind the reader's back: the listing changed, the registry is read again
    (conv,) = (tmp_path / "fleet" / "_ledger" / "convictions").iterdir()
    conv.unlink()
    again = certify_store(store, write_certificates=False)
    assert len(reads) == 3 and again.certification.verdicts["main@15"].reasons[-1] == "tampered"
    # an edited record, same size: its change detector (times, inode) moved
    assert Fleet(fleet, signing_key=None).read().breaks
