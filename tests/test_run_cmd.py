"""`certckpt run -- LAUNCHER`: the scheduler sees exit 86 when ranks stop on a detected fault, though
`torchrun` itself exits 1 whatever its workers' codes (checked here with the real torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import console_script

from certckpt.detect.launch import free_port

SCRIPT = """
import os
from certckpt.detect import stop_on_fault
from certckpt.detect.events import AuditEvent
from certckpt.errors import FaultDetectedError

class Session:
    def close(self):
        pass

rank = int(os.environ["RANK"])
ev = AuditEvent(run="r", branch="main", step=30, kind="replay", outcome="fail", ranks=[0, 1], suspect_ranks=[1],
                inventory={"1": {"host": "node-7"}})
with stop_on_fault(Session()):
    if os.environ.get("FAIL") == "fault":
        raise FaultDetectedError("replay check failed at step 30", ev, incident_id="inc-main-30-replay")
    if os.environ.get("FAIL") == "crash" and rank == 1:
        raise RuntimeError("an ordinary bug")
"""


def _torchrun(tmp_path, *, wrapped: bool, fail: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    cmd = [*launcher, str(free_port()), "train.py"]
    if wrapped:
        cmd = [console_script("certckpt"), "run", "--", *cmd]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=str(tmp_path), env={**os.environ, "FAIL": fail}
    )


@pytest.mark.slow
def test_the_scheduler_sees_86_through_torchrun_only_with_certckpt_run(tmp_path):
    bare = _torchrun(tmp_path, wrapped=False, fail="fault")
    assert bare.returncode == 1  # what a scheduler sees from torchrun alone: a crash like any other
    wrapped = _torchrun(tmp_path, wrapped=True, fail="fault")
    assert wrapped.returncode == 86, wrapped.stderr[-2000:]
    last = wrapped.stderr.strip().splitlines()[-1]
    assert "incident inc-main-30-replay" in last and "suspect rank(s) [1]" in last and "node-7" in last


@pytest.mark.slow
def test_an_ordinary_crash_keeps_the_launchers_status(tmp_path):
    r = _torchrun(tmp_path, wrapped=True, fail="crash")
    assert r.returncode == 1 and "exit 86" not in r.stderr
    ok = _torchrun(tmp_path, wrapped=True, fail="none")
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_a_command_that_cannot_start_is_127_in_one_line(tmp_path):
    r = subprocess.run(
        [console_script("certckpt"), "run", "--", str(tmp_path / "no-such-launcher")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 127 and r.stderr.count("\n") == 1 and "cannot start" in r.stderr
