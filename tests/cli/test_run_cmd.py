"""`certckpt run -- LAUNCHER`: the scheduler sees exit 86 when ranks stop on a detected fault, though
`torchrun` itself exits 1 whatever its workers' codes (checked here with the real torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from certckpt.detect.launch import free_port
from tests.support.helpers import console_script

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


# A launcher that leaves hostile files in the detection directory `certckpt run` gave it, optionally runs
# one real rank (SCRIPT, which stops on a detection and leaves its marker), then fails as torchrun does.
LAUNCHER = """
import json, os, subprocess, sys

d, launch = os.environ["CERTCKPT_DETECTION_DIR"], os.environ["CERTCKPT_LAUNCH_ID"]
print("detection dir:", d, flush=True)
assert os.listdir(d) == [], os.listdir(d)  # a fresh directory for each launch


def put(name, text):
    with open(os.path.join(d, name), "w") as f:
        f.write(text)


good = {"exit": 86, "incident": "inc-x", "suspect_ranks": [3], "nodes": ["node-3"], "rank": "3", "message": "m"}
for kind in filter(None, os.environ.get("HOSTILE", "").split(",")):
    if kind == "fifo":
        os.mkfifo(os.path.join(d, "detection-fifo.json"))
    elif kind == "link":
        os.symlink("/dev/zero", os.path.join(d, "detection-link.json"))
    elif kind == "deep":
        put("detection-deep.json", "[" * 200000 + "]" * 200000)
    elif kind == "list":
        put("detection-list.json", json.dumps({**good, "launch": launch, "incident": ["inc-list"]}))
    elif kind == "huge":
        with open(os.path.join(d, "detection-huge.json"), "wb") as f:
            f.truncate(2 << 30)  # sparse: 2 GB that take no disk
    elif kind == "stale":
        put("detection-stale.json", json.dumps({**good, "launch": "0" * 32, "incident": "inc-stale"}))
    elif kind == "many":
        for i in range(25):
            put(f"detection-junk{i:02}.json", "not json")
    else:
        raise SystemExit(f"unknown kind {kind}")
if os.environ.get("REAL"):
    rank = subprocess.run([sys.executable, "train.py"], env={**os.environ, "RANK": "1", "FAIL": "fault"})
    assert rank.returncode == 86, rank.returncode
sys.exit(1)
"""


def _launch(tmp_path, *, hostile: str = "", real: bool = False, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    env = {**os.environ, "HOSTILE": hostile, "REAL": "1" if real else "", **env}
    return subprocess.run(
        [console_script("certckpt"), "run", "--", sys.executable, "launcher.py"],
        capture_output=True,
        text=True,
        timeout=120,  # a guard only: a marker that blocks the reader fails the test instead of hanging it
        cwd=str(tmp_path),
        env=env,
    )


HOSTILE = {
    "fifo": ["detection-fifo.json", "not a regular file (a FIFO); never opened"],
    "link": ["detection-link.json", "not a regular file (a symbolic link); never opened"],
    "deep": ["detection-deep.json", "JSON nested too deep"],
    "list": ["detection-list.json", "'incident' is list, not a printable string"],
    "huge": ["detection-huge.json", "2147483648 bytes, more than any marker"],
    "stale": ["detection-stale.json", "from another launch"],
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_marker_alone_keeps_the_launchers_status(tmp_path, kind):
    r = _launch(tmp_path, hostile=kind)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "exit 86" not in r.stderr and "inc-" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    name, why = HOSTILE[kind]
    assert f"ignored detection marker {name!r}" in lines[0] and why in lines[0]
    assert "no marker of this launch says a rank stopped on a detected fault (1 ignored): exit 1" in lines[1]


def test_a_real_detection_beside_hostile_markers_is_still_86(tmp_path):
    r = _launch(tmp_path, hostile=",".join(sorted(HOSTILE)), real=True)
    assert r.returncode == 86, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "inc-stale" not in r.stderr and "inc-list" not in r.stderr
    lines = r.stderr.strip().splitlines()
    last = lines[-1]
    assert "1 rank(s) stopped on a detected fault" in last and "incident inc-main-30-replay" in last
    assert "suspect rank(s) [1]" in last and "node(s) node-7" in last and "exit 86" in last
    ignored = [ln for ln in lines if ln.startswith("certckpt: ignored detection marker")]
    assert len(ignored) == len(HOSTILE)
    for name, why in HOSTILE.values():
        assert any(name in ln and why in ln for ln in ignored), (name, ignored)


def test_many_malformed_markers_are_summarized(tmp_path):
    r = _launch(tmp_path, hostile="many")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert sum("ignored detection marker" in ln and "not JSON" in ln for ln in lines) == 10
    assert "certckpt: 15 more detection marker(s) ignored" in lines
    assert "(25 ignored): exit 1" in lines[-1]


def test_a_stale_marker_in_the_users_detection_directory_is_never_read(tmp_path):
    """A directory the user sets holds a marker from an earlier launch (written before launch ids, or
    with any id): this launch runs in a fresh directory inside it, removed afterwards."""
    users = tmp_path / "detections"
    users.mkdir()
    stale = users / "detection-1.json"
    stale.write_text('{"exit": 86, "incident": "inc-old", "suspect_ranks": [0], "nodes": ["n"]}')
    r = _launch(tmp_path, CERTCKPT_DETECTION_DIR=str(users))
    assert r.returncode == 1 and r.stderr == "", r.stderr[-2000:]
    given = r.stdout.split("detection dir: ", 1)[1].strip()
    assert os.path.dirname(given) == str(users) and not os.path.exists(given)
    assert sorted(os.listdir(users)) == ["detection-1.json"]


def test_an_unusable_detection_directory_is_2_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    r = _launch(tmp_path, CERTCKPT_DETECTION_DIR=str(tmp_path / "a-file"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot make a detection directory" in r.stderr
    assert "Traceback" not in r.stderr and "detection dir:" not in r.stdout
