"""Issue 45, "Log lines": training says when a checkpoint is committed and when it becomes trusted
(and which one is latest-good then), on rank 0, through the ``certckpt`` logger (off by default)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from certckpt.detect.launch import run_ranks
from certckpt.errors import CheckpointExistsError
from certckpt.trust.ledger import Ledger
from tests.support import ddp_cases


def test_log_lines_a_commit_says_so_once_whatever_wrote_it(tmp_path, caplog):
    led = Ledger(str(tmp_path), signing_key=None)
    with caplog.at_level(logging.INFO, logger="certckpt"):
        led.commit_checkpoint(branch="main", step=5, location=str(tmp_path / "m5.safetensors"))
        with pytest.raises(CheckpointExistsError):  # another checkpoint under the name: refused, not logged
            led.commit_checkpoint(branch="main", step=5, location=str(tmp_path / "other.safetensors"))
    lines = [r.getMessage() for r in caplog.records if r.name == "certckpt.commit"]
    assert lines == [f"committed checkpoint main@5 (step 5 of branch main) in {led.store}"]


def test_log_lines_are_off_in_a_library_by_default(tmp_path):
    code = (
        "from certckpt.trust.ledger import Ledger; import sys; "
        "Ledger(sys.argv[1], signing_key=None).commit_checkpoint(branch='main', step=1, location=sys.argv[1] + '/x')"
    )
    env = {k: v for k, v in os.environ.items() if k != "CERTCKPT_LOG"}
    quiet = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    env["CERTCKPT_LOG"] = "info"
    loud = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], capture_output=True, text=True, env=env)
    assert "certckpt: committed checkpoint main@1" in loud.stderr


@pytest.mark.slow
def test_log_lines_training_says_what_was_committed_and_what_became_trusted(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    out = run_ranks(ddp_cases.rollback, 3, {"store": str(store)}, timeout=180)
    log = [line.split(" (")[0] for line in out[0]["log"]]
    committed = [line.split()[2] for line in log if line.startswith("committed checkpoint")]
    assert committed == ["main@5", "main@10", "main@15", "b2@15", "b2@20", "b2@25", "b2@30"], log
    trusted = [line for line in out[0]["log"] if " trusted: " in line]
    assert [t.split(" trusted")[0] for t in trusted] == [
        "checkpoint(s) main@5",  # at the audit at step 10
        "checkpoint(s) main@10",  # saved right after that clean audit
        "checkpoint(s) b2@15",
        "checkpoint(s) b2@20",
        "checkpoint(s) b2@25",
        "checkpoint(s) b2@30",
    ], trusted
    assert "the audit at step 10 passed" in trusted[0] and "latest-good is now main@5" in trusted[0]
    assert "latest-good is now b2@30" in trusted[-1]
    assert not any("main@15" in t for t in trusted)  # the fault at step 13 was found before it was covered
    assert out[1]["log"] == [] and out[2]["log"] == []  # rank 0 only
