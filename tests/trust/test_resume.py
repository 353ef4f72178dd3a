"""Resuming a run: always on a new branch from latest-good; what the interrupted run left after that
point is superseded by the branch record (never overwritten), and ids and file names never collide."""

from __future__ import annotations

import pytest

import certckpt
from certckpt.trust.certify import CheckpointEntry, certify
from certckpt.trust.ledger import Ledger
from certckpt.trust.resume import BranchAfterLoad, branch_after_load, next_branch, plan_resume, recorded_branches
from certckpt.trust.runstore import certify_store, find_latest_good
from tests.support.helpers import event_dict

_ev = event_dict


def _audit(branch, step):
    return [_ev(branch, step, k) for k in ("nonfinite-pre", "nonfinite-post", "replay")] + [
        _ev(branch, step, "consensus", fp=f"fp{step}")
    ]


@pytest.fixture
def killed_run(tmp_path):
    """Audits every 10, checkpoints every 5: main@10, main@20 trusted; main@25 and main@30 await
    the audit at 40 that never came (the job was killed at step 33)."""
    led = Ledger(str(tmp_path), signing_key=None, trusted_keys=None)
    for s in (10, 20, 25, 30):
        led.commit_checkpoint(
            branch="main", step=s, location=str(tmp_path / f"main@{s}.safetensors"), run="r", consensus_fp=f"fp{s}"
        )
    led.append_events(
        _audit("main", 10) + _audit("main", 20) + [_ev("main", s, "consensus", fp=f"fp{s}") for s in (25, 30)]
    )
    return tmp_path


def test_next_branch_names_never_collide():
    assert next_branch("main", set()) == "main-r1"
    assert next_branch("main", {"main-r1", "main-r2"}) == "main-r3"
    assert next_branch("main-r2", {"main-r1", "main-r2"}) == "main-r3"  # resumes of resumes stay flat
    assert next_branch("b2", {"main-r1"}) == "b2-r1"


def test_branch_after_load_gives_a_parent_only_to_the_committed_files_and_a_name_nobody_took():
    records = {
        "main@10": {"branch": "main", "step": 10, "header_digest": "aa"},
        "main-r1@12": {"branch": "main-r1", "step": 12, "header_digest": "bb"},
    }

    def after(branch, step, digest, recorded=()):
        return branch_after_load(
            branch=branch,
            step=step,
            header_digest=digest,
            records=records,
            branch_parents={"main-r2"},
            recorded=recorded,
        )

    # the committed files: their id is the parent; main-r1 (a commit) and main-r2 (a branch record) are taken
    assert after(None, 10, "aa") == BranchAfterLoad(source="main@10", parent="main@10", branch="main-r3", step=10)
    # the same id, other bytes (replaced after the commit, or another store's): no parent, still a new branch
    assert after("main", 10, "cc") == BranchAfterLoad(source="main@10", parent=None, branch="main-r3", step=10)
    # a resume of a resume stays flat, and a name recorded only as a (damaged) branch record is skipped too
    assert after("main-r1", 12, "bb", recorded={"main-r3"}).branch == "main-r4"
    # files of a store that committed nothing: main@0 when they carry no step
    empty = branch_after_load(branch=None, step=None, header_digest="aa", records={}, branch_parents=(), recorded=())
    assert empty == BranchAfterLoad(source="main@0", parent=None, branch="main-r1", step=0)


def test_branch_after_load_takes_a_requested_name_only_when_it_is_new_and_valid():
    records = {"main@10": {"branch": "main", "step": 10, "header_digest": "aa"}}

    def after(requested, digest="aa"):
        return branch_after_load(
            branch=None,
            step=10,
            header_digest=digest,
            records=records,
            branch_parents={"main-r1"},
            recorded={"old"},
            requested=requested,
            store="runs/r1",
        )

    # a new name replaces the next free one; the parent is decided as without it
    assert after("exp2") == BranchAfterLoad(source="main@10", parent="main@10", branch="exp2", step=10)
    assert after("exp2", digest="cc").parent is None
    # a taken name (a commit's branch, a branch record, a recorded name): one line saying what to do
    for taken in ("main", "main-r1", "old"):
        with pytest.raises(certckpt.ConfigurationError) as e:
            after(taken)
        assert str(e.value) == (
            f"branch {taken!r} exists in runs/r1 already and a resume opens a new branch: pass a new branch name,"
            " or none (then it is 'main-r2', after the branch resumed from)"
        )
    for bad in ("", "a/b", "x" * 101, ".."):
        with pytest.raises(certckpt.ConfigurationError, match=r"is not a branch name: use 1-100 letters.*'main-r2'"):
            after(bad)


def test_recorded_branches_lists_every_branch_record(killed_run):
    led = Ledger(str(killed_run), signing_key=None, trusted_keys=None)
    assert recorded_branches(led) == set()
    led.start_branch("main-r1", parent="main@20")
    assert recorded_branches(led) == {"main-r1"}


def test_plan_resume_takes_latest_good_and_a_new_branch(killed_run):
    before = certify_store(str(killed_run), write_certificates=False)
    assert before.certification.verdicts["main@30"].label == "verified"  # awaiting its audit
    rp = plan_resume(str(killed_run), verify_bytes=False)
    assert (rp.parent, rp.step, rp.branch, rp.consensus_fp, rp.level) == ("main@20", 20, "main-r1", "fp20", "trusted")
    assert rp.url.endswith("main@20.safetensors")
    # planning writes nothing: the abandoned checkpoints are superseded only once the branch starts
    assert certify_store(str(killed_run), write_certificates=False).certification.verdicts["main@30"].verified


def test_the_branch_record_supersedes_the_abandoned_checkpoints(killed_run):
    rp = plan_resume(str(killed_run), verify_bytes=False)
    led = Ledger(str(killed_run), signing_key=None, trusted_keys=None)
    led.start_branch(rp.branch, parent=rp.parent)  # what Auditor(branch=..., parent=...) records
    st = certify_store(str(killed_run), write_certificates=False)
    v = st.certification.verdicts
    for cid in ("main@25", "main@30"):
        assert v[cid].label == "suspect" and "superseded" in v[cid].reasons and not v[cid].verified
    assert v["main@20"].trusted and v["main@10"].trusted  # trusted ones keep their verdict
    _, good = find_latest_good(str(killed_run), verify_bytes=False, write_certificates=False, accept="verified")
    assert good == "main@20"  # abandoned work is never the answer, even with --accept verified
    # the new branch trains from 20 again: the same steps, new ids, no collision
    for s in (25, 30):
        led.commit_checkpoint(
            branch=rp.branch,
            step=s,
            location=str(killed_run / f"{rp.branch}@{s}.safetensors"),
            run="r",
            consensus_fp=f"fp{s}b",
        )
    led.append_events(
        [_ev(rp.branch, s, "consensus", fp=f"fp{s}b") for s in (25, 30)]
        + [_ev(rp.branch, 30, k) for k in ("nonfinite-pre", "nonfinite-post", "replay")]
    )
    st = certify_store(str(killed_run), write_certificates=False)
    assert st.certification.latest_good == "main-r1@30"
    assert plan_resume(str(killed_run), verify_bytes=False).branch == "main-r2"


def test_superseding_is_a_pure_rule_of_the_certifier():
    cks = [
        CheckpointEntry(ckpt_id="main@10", branch="main", step=10),
        CheckpointEntry(ckpt_id="main@15", branch="main", step=15),
        CheckpointEntry(ckpt_id="main-r1@15", branch="main-r1", step=15, parent="main@10"),
    ]
    cert = certify(cks, [], branch_parents={"main-r1": "main@10"})
    assert "superseded" in cert.verdicts["main@15"].reasons
    assert "superseded" not in cert.verdicts["main@10"].reasons
    assert "superseded" not in cert.verdicts["main-r1@15"].reasons
    assert cert.candidates("verified") == ["main-r1@15", "main@10"]


def test_plan_resume_without_a_good_checkpoint_is_a_clear_error(tmp_path):
    Ledger(str(tmp_path), signing_key=None, trusted_keys=None).commit_checkpoint(
        branch="main", step=5, location=str(tmp_path / "main@5.safetensors"), run="r"
    )
    with pytest.raises(certckpt.CheckpointNotFoundError, match="no trusted checkpoint to resume from"):
        plan_resume(str(tmp_path), verify_bytes=False)


RESUME_CHECK = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import certckpt
from certckpt.detect import Auditor
from certckpt.errors import AuditSetupError
d = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
loss = lambda mm, b: F.mse_loss(mm(b[0]), b[1])
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(m.parameters(), lr=0.1)
a = Auditor(DDP(m), opt, loss_fn=loss, ledger=d + "/run", audit_every=2)
for s in range(4):
    a.train_step((torch.randn(5, 4), torch.randn(5, 2)))
a.save({"model": m.state_dict()}, f"{d}/run/{a.branch}@{a.step}.safetensors")
a.close()
rp = certckpt.plan_resume(d + "/run", accept="verified")
fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
try:  # the wrong weights (a fresh model): refused before a step, and no branch recorded
    Auditor(DDP(fresh), torch.optim.SGD(fresh.parameters(), lr=0.1), loss_fn=loss, ledger=d + "/run",
            branch=rp.branch, parent=rp.parent, start_step=rp.step, expect_consensus_fp=rp.consensus_fp)
    print("NOT REFUSED")
except AuditSetupError as e:
    print("REFUSED", "consensus fingerprint" in str(e))
fresh.load_state_dict(certckpt.load(rp.url)["model"])
b = Auditor(DDP(fresh), torch.optim.SGD(fresh.parameters(), lr=0.1), loss_fn=loss, ledger=d + "/run",
            branch=rp.branch, parent=rp.parent, start_step=rp.step, expect_consensus_fp=rp.consensus_fp)
b.train_step((torch.randn(5, 4), torch.randn(5, 2)))
b.close()
print("RESUMED", rp.branch, rp.parent, b.step)
dist.destroy_process_group()
"""


def test_a_resumed_auditor_refuses_weights_that_are_not_the_parent_checkpoint(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    r = subprocess.run(
        [sys.executable, "-c", RESUME_CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("CERTCKPT_")}
        | {"CERTCKPT_STATE_DIR": str(tmp_path / "state")},  # the reader's memory stays here, never in ~/.cache
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "REFUSED True" in r.stdout and "RESUMED main-r1 main@4 5" in r.stdout, r.stdout
    branches = os.listdir(tmp_path / "run" / "_ledger" / "branches")
    assert branches == ["main-r1.json"]  # recorded once, by the auditor that started
