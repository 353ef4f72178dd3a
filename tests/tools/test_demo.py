"""The main job end to end: `certckpt demo` as a newcomer runs it."""

import json
import os
import subprocess
from xml.etree import ElementTree

import pytest

import certckpt
from certckpt.tools.demo import SCHEDULE
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import find_latest_good, get_incident
from tests.support.helpers import console_script

pytestmark = pytest.mark.slow


def test_demo_catches_the_fault_rolls_back_and_proves_the_restore(demo_run):
    d, r = demo_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "warn" not in (out + r.stderr).lower(), r.stderr[-3000:]  # e.g. torch's "Failed to initialize NumPy"
    for n in range(1, 8):
        assert f"[{n}/7]" in out  # progress as it goes
    K, fault = SCHEDULE["audit_every"], SCHEDULE["fault_step"]
    detected = -(-fault // K) * K  # the next audit step after the fault
    assert f"step {detected}: the replay check failed and named rank(s) [{SCHEDULE['fault_rank']}]" in out
    store, vault = str(d / "run"), str(d / "vault")
    # the run store tells the same story to the other commands
    status, good = find_latest_good(store)
    det = [x for x in status.certification.detections if x.branch == "main"]
    assert [(x.step, x.suspect_ranks, x.interval) for x in det] == [
        (detected, (SCHEDULE["fault_rank"],), (detected - K, detected))
    ]
    verdicts = status.certification.verdicts
    assert verdicts["main@20"].trusted and verdicts["main@25"].reasons == ("after-fault",)
    assert good == "b2@60" and Ledger(store).snapshot().branch_parents == {"b2": "main@20"}
    assert (
        "main@20  ->  " in out and int("main@20".rpartition("@")[2]) <= detected - K
    )  # latest-good precedes the interval
    iid = f"inc-main-{detected}-replay"
    inc = get_incident(store, iid)
    assert inc.status == "closed" and inc.rollback_to == "main@20"
    # the restore drill passed every stage, against the clean reference run
    drills = Ledger(vault).snapshot().drills
    assert len(drills) == 1 and drills[0]["outcome"] == "pass" and drills[0]["ckpt_id"] == "b2@60"
    assert all(drills[0]["stages"][s]["ok"] for s in ("bytes", "fingerprints", "load", "metrics"))
    ref = json.loads((d / "reference-metrics.json").read_text())
    # the recovered run retraces the clean one (to float rounding after the restart)
    assert drills[0]["metrics"]["eval_loss"] == pytest.approx(ref["60"]["eval_loss"], rel=1e-5)
    assert drills[0]["reference"] == ref["60"]
    # artefacts left for the user
    picture = ElementTree.parse(d / "timeline.svg").getroot()  # drawn without matplotlib
    assert picture.tag == "{http://www.w3.org/2000/svg}svg" and "latest-good b2@60" in "".join(picture.itertext())
    assert certckpt.verify(os.path.join(vault, "b2@60.safetensors"), deep=True).ok
    r2 = subprocess.run(
        [console_script("certckpt"), "demo", "--dir", str(d)], capture_output=True, text=True, timeout=60
    )
    assert r2.returncode == 2 and "is not empty" in r2.stderr and r2.stderr.count("\n") == 1
