"""Incidents: opened by uncontained detections, write-once decisions, the rules for resolve and close."""

import json
import os
import re
import subprocess
import sys

import pytest

from certckpt.errors import IncidentError
from certckpt.trust.incident import (
    EXIT_FAULT_DETECTED,
    Incident,
    build_opening,
    check_decision,
    incident_id_for,
    incident_state,
)
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store, decide, get_incident, list_incidents
from certckpt.vault import promote, prune
from certckpt.vault.retention import KeepLatest
from tests.support.helpers import ROOT, console_script

EVENT = {
    "run": "r",
    "branch": "main",
    "step": 20,
    "kind": "replay",
    "outcome": "fail",
    "ranks": [0, 1, 2],
    "suspect_ranks": [1],
    "contained": False,
    "details": {"mismatched": {"0->1": ["0.weight", "2.bias"], "1->2": ["0.weight"]}},
    "inventory": {
        "0": {"host": "a"},
        "1": {"host": "b", "NODE_NAME": "node-7", "device_uuid": "GPU-1"},
        "2": {"host": "c"},
    },
}


def opened(**kw):
    doc = build_opening(EVENT, latest_good="main@10", made_suspect=["main@15"], interval=(10, 20), now=100.0)
    doc.update(kw)
    return doc


def dec(action, by="alice", at=200.0, **kw):
    return {
        "incident_id": "inc-main-20-replay",
        "record": "decision",
        "decision_id": f"d-{action}-{at}",
        "action": action,
        "by": by,
        "reason": "because",
        "at": at,
        **kw,
    }


def test_opening_record_holds_the_evidence():
    doc = opened()
    assert doc["incident_id"] == incident_id_for(EVENT) == "inc-main-20-replay"
    assert doc["signature"]["check"] == "replay" and doc["signature"]["tensors"] == ["0.weight", "2.bias"]
    assert doc["suspect_ranks"] == [1] and doc["ranks"] == [0, 1, 2]
    assert doc["suspect_nodes"] == ["node-7"]  # the scheduler's node name wins over the host name
    assert doc["inventory"]["1"]["device_uuid"] == "GPU-1"
    assert doc["checkpoints"] == {"latest_good": "main@10", "made_suspect": ["main@15"]} and doc[
        "suspect_interval"
    ] == [10, 20]
    assert incident_id_for({**EVENT, "branch": "b/2"}) == "inc-b_2-20-replay"  # always a safe record name


def test_resolve_needs_a_rollback_naming_a_trusted_checkpoint_and_approvals():
    inc = Incident(incident_id="inc-main-20-replay", opened=opened())
    with pytest.raises(IncidentError, match="no rollback decision names the checkpoint"):
        check_decision(inc, dec("resolve"), trusted=["main@10"])
    with pytest.raises(IncidentError, match="must name the checkpoint"):
        check_decision(inc, dec("rollback"), trusted=["main@10"])
    with pytest.raises(IncidentError, match="main@15 is not a trusted checkpoint"):
        check_decision(inc, dec("rollback", ckpt="main@15"), trusted=["main@10"])
    with pytest.raises(IncidentError, match="--by NAME and --reason"):
        check_decision(inc, {**dec("quarantine"), "by": " "})
    inc.decisions += [dec("rollback", ckpt="main@10", at=201.0), dec("replace", at=202.0)]
    assert inc.rollback_to == "main@10" and [d["action"] for d in inc.pending_approvals()] == ["replace"]
    with pytest.raises(IncidentError, match="await approval"):
        check_decision(inc, dec("resolve"))
    with pytest.raises(IncidentError, match="someone else must approve"):
        check_decision(inc, dec("approve", by="Alice", approves="d-replace-202.0"))
    with pytest.raises(IncidentError, match="pending replace or return-to-service"):
        check_decision(inc, dec("approve", by="bob", approves="d-rollback-201.0"))
    check_decision(inc, dec("approve", by="bob", approves="d-replace-202.0"))  # allowed
    inc.decisions.append(dec("approve", by="bob", approves="d-replace-202.0", at=203.0))
    check_decision(inc, dec("resolve"))
    assert inc.status == "open"


def test_close_needs_a_passing_drill_against_a_reference_run_after_the_incident_opened():
    inc = Incident(
        incident_id="inc-main-20-replay",
        opened=opened(),
        decisions=[dec("rollback", ckpt="main@10"), dec("resolve", at=210.0)],
    )
    assert inc.status == "resolved" and inc.is_open
    good = {"drill_id": "d1", "at": 300.0, "outcome": "pass", "stages": {"metrics": {"ok": True}}}
    with pytest.raises(IncidentError, match="needs a restore drill"):
        check_decision(inc, dec("close"), drills=[good])
    with pytest.raises(IncidentError, match="ran before the incident opened"):
        check_decision(inc, dec("close", drill="d0"), drills=[{**good, "drill_id": "d0", "at": 50.0}])
    with pytest.raises(IncidentError, match="did not pass against a clean reference"):
        check_decision(
            inc,
            dec("close", drill="d2"),
            drills=[{**good, "drill_id": "d2", "outcome": "incomplete", "stages": {"metrics": {"ok": None}}}],
        )
    check_decision(inc, dec("close", drill="d1"), drills=[good])
    inc.decisions.append(dec("close", drill="d1", at=400.0))
    assert inc.status == "closed" and not inc.is_open
    with pytest.raises(IncidentError, match="is closed"):
        check_decision(inc, dec("quarantine"))
    open_inc = Incident(incident_id="x", opened=opened())
    with pytest.raises(IncidentError, match="resolve it before closing"):
        check_decision(open_inc, dec("close", drill="d1"), drills=[good])


def test_state_orders_decisions_by_time_and_ignores_orphans():
    recs = [
        dec("resolve", at=300.0),
        opened(),
        dec("rollback", ckpt="main@10", at=250.0),
        {**dec("quarantine"), "incident_id": "nope"},
    ]
    state = incident_state(recs)
    assert list(state) == ["inc-main-20-replay"]
    assert [d["action"] for d in state["inc-main-20-replay"].decisions] == ["rollback", "resolve"]


# --- on real run stores ----------------------------------------------------------------------------


@pytest.mark.slow
def test_status_opens_one_incident_per_uncontained_detection(copy_run):
    run = copy_run("faulty")
    certify_store(run)
    certify_store(run)  # again: the same incident, not a second one
    incs = list_incidents(run)
    assert [i.incident_id for i in incs] == ["inc-main-20-replay"]
    o = incs[0].opened
    assert o["suspect_ranks"] == [1] and o["suspect_interval"] == [10, 20] and o["signature"]["tensors"]
    assert o["checkpoints"] == {"latest_good": "main@10", "made_suspect": ["main@15"]}
    assert set(o["inventory"]) == {"0", "1", "2"} and all("host" in v and "pid" in v for v in o["inventory"].values())
    assert len([n for n in os.listdir(os.path.join(run, "_ledger", "incidents"))]) == 1
    clean = copy_run("clean")
    certify_store(clean)
    assert list_incidents(clean) == []


@pytest.mark.slow
def test_open_incident_blocks_pruning_until_closed_with_a_drill(copy_run, drill_runs, tmp_path):
    from certckpt.detect.drill import evaluate, make_model
    from certckpt.vault.drill import drill_restore
    from tests.vault.test_vault import _reference

    run, vault = copy_run("faulty"), str(tmp_path / "vault")
    certify_store(run)
    promote(run, vault)  # mirrors the open incident
    plan = prune(vault, KeepLatest(0)).plan
    assert plan.delete == [] and plan.blocked_by == ["inc-main-20-replay"]
    iid = "inc-main-20-replay"
    decide(run, iid, action="quarantine", by="alice", reason="rank 1 named by replay")
    decide(run, iid, action="rollback", by="alice", reason="restart from latest-good", ckpt="main@10")
    decide(run, iid, action="resolve", by="alice", reason="training resumed on b2")
    with pytest.raises(IncidentError, match="needs a restore drill"):
        decide(run, iid, action="close", by="alice", reason="done", drill="latest", vault=vault)
    d = drill_restore(vault, model_factory=make_model, eval_fn=evaluate, reference=_reference(drill_runs["clean"], 10))
    assert d.passed and d.drill_id
    decide(run, iid, action="close", by="alice", reason="drill passed", drill=d.drill_id, vault=vault)
    inc = get_incident(run, iid)
    assert inc.status == "closed" and inc.rollback_to == "main@10" and inc.decisions[-1]["drill"] == d.drill_id
    quarantine = inc.decisions[0]
    assert quarantine["nodes"] == inc.opened["suspect_nodes"] != []
    promote(run, vault)  # the closing decision reaches the vault
    plan = prune(vault, KeepLatest(0)).plan
    assert plan.delete == ["main@5"] and plan.blocked_by == []
    # records are write-once: every decision is its own file, the opening is untouched
    names = sorted(os.listdir(os.path.join(run, "_ledger", "incidents")))
    assert len(names) == 5 and names[0].endswith("-opened.json")


def cli(*args):
    return subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_incident_cli(copy_run):
    run = copy_run("faulty")
    assert cli("status", run).returncode == 0
    r = cli("incident", "ls", run)
    assert r.returncode == 0 and "inc-main-20-replay  open" in r.stdout and "replay" in r.stdout
    r = cli("incident", "show", run, "inc-main-20-replay")
    assert (
        r.returncode == 0
        and "suspect steps   (10, 20]" in r.stdout
        and "(suspect)" in r.stdout
        and "latest-good     main@10" in r.stdout
    )
    doc = json.loads(cli("incident", "show", run, "inc-main-20-replay", "--json").stdout)
    assert doc["status"] == "open" and doc["opened"]["suspect_ranks"] == [1]
    r = cli("incident", "decide", run, "inc-main-20-replay", "--action", "resolve", "--by", "a", "--reason", "b")
    assert r.returncode == 1 and r.stderr.startswith("certckpt: refused:") and r.stderr.count("\n") == 1
    r = cli(
        "incident",
        "decide",
        run,
        "inc-main-20-replay",
        "--action",
        "rollback",
        "--ckpt",
        "main@10",
        "--by",
        "a",
        "--reason",
        "b",
    )
    assert r.returncode == 0 and "recorded rollback" in r.stdout
    r = cli("incident", "show", run, "nope")
    assert r.returncode == 2 and "no incident 'nope'" in r.stderr


@pytest.mark.slow
def test_training_job_opens_the_incident_and_exits_86_on_every_rank(tmp_path):
    from certckpt.detect.launch import free_port

    root = str(ROOT)
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-port",
            str(free_port()),
            os.path.join(root, "examples", "audited_ddp.py"),
            "--dir",
            str(run),
            "--inject-fault-at",
            "13",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(tmp_path),
    )
    # Every rank detects at the same step and leaves with 86; torchrun stops the ranks still running
    # once the first has exited (SIGTERM, -15), so each rank's code is 86 or, for the late ones, -15.
    codes = re.findall(r"exitcode\s+:\s*(-?\d+)", out.stderr)  # torchrun's per-rank summary lines
    assert len(codes) == 3 and str(EXIT_FAULT_DETECTED) in codes, out.stderr[-3000:]
    assert set(codes) <= {str(EXIT_FAULT_DETECTED), "-15"}, out.stderr[-3000:]
    assert "incident inc-main-20-replay; exit 86: do not requeue on the suspect node" in out.stderr
    incs = list_incidents(str(run))  # written by the training job itself, before any `status`
    assert [i.incident_id for i in incs] == ["inc-main-20-replay"] and incs[0].opened["suspect_ranks"] == [1]
    assert Ledger(str(run)).snapshot().open_incidents() == ["inc-main-20-replay"]


@pytest.mark.parametrize("contained", [False, True])
def test_stop_on_fault_prints_the_incident_and_exits_86(contained, capsys):
    from certckpt.detect.auditor import FaultDetectedError
    from certckpt.detect.events import AuditEvent
    from certckpt.detect.stop import stop_on_fault

    class Closable:
        closed = False

        def close(self):
            self.closed = True

    ev = AuditEvent(
        run="r",
        branch="main",
        step=20,
        kind="nonfinite-pre" if contained else "replay",
        outcome="fail",
        ranks=[0, 1, 2],
        suspect_ranks=[1],
        contained=contained,
        inventory={"1": {"host": "h1", "SLURMD_NODENAME": "node-7"}},
    )
    aud = Closable()
    with pytest.raises(SystemExit) as e, stop_on_fault(aud):
        raise FaultDetectedError("step 20: check failed", ev)
    err = capsys.readouterr().err
    assert e.value.code == EXIT_FAULT_DETECTED == 86 and aud.closed and err.count("\n") == 1
    assert "suspect rank(s) 1 on node(s) node-7" in err and "do not requeue on the suspect node" in err
    if contained:
        assert "no incident" in err and "None" not in err
    else:
        assert "incident inc-main-20-replay;" in err
