"""Atomic, create-only writes: killed writers, refused overwrites, a full disk."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import certckpt

# One writer per kill, each forked from a process that imported torch and certckpt once (a fresh
# python would spend seconds importing torch per writer). A request line "PATH OVERWRITE SEED" forks
# a writer, which prints "ready" once its state is built and "done" once the save returned; the next
# line, "kill" or "wait", has the forker SIGKILL it at once or let it finish, then reap it and print
# "exited STATUS". Only the forker signals it, before reaping it: a writer that already finished is a
# zombie then, never another process under a reused pid.
FORKER = textwrap.dedent(
    """
    import os, signal, sys, torch, certckpt
    for line in sys.stdin:
        path, overwrite, seed = line.split()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            torch.manual_seed(int(seed))
            state = {f"t{i}": torch.randn(2_000_000) for i in range(12)}  # ~96 MB
            print("ready", flush=True)
            certckpt.save(state, path, step=int(seed), overwrite=overwrite == "1")
            print("done", flush=True)
            os._exit(0)
        if sys.stdin.readline().strip() == "kill":
            os.kill(pid, signal.SIGKILL)
        print("exited", os.waitpid(pid, 0)[1], flush=True)
    """
)


class Writers:
    def __init__(self):
        self.forker = subprocess.Popen(
            [sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, line: str) -> None:
        self.forker.stdin.write(line + "\n")
        self.forker.stdin.flush()

    def start(self, path, overwrite, seed) -> None:
        """A writer saving to ``path``, once its state is built."""
        self.send(f"{path} {1 if overwrite else 0} {seed}")
        assert self.line() == "ready"

    def line(self) -> str:
        return self.forker.stdout.readline().strip()

    def end(self, how: str) -> None:
        """``kill`` the writer now or ``wait`` for it; returns once it is reaped (a "done" before
        that is its save finishing)."""
        self.send(how)
        while not self.line().startswith("exited"):
            pass

    def close(self):
        self.forker.stdin.close()
        self.forker.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [False, True])
def test_killed_writer_leaves_old_or_complete_checkpoint(tmp_path, overwrite):
    final = tmp_path / "ck.safetensors"
    certckpt.save({"old": torch.ones(3)}, final, step=0)
    if not overwrite:
        final = tmp_path / "new.safetensors"
    outcomes = set()
    writers = Writers()
    for i, delay in enumerate([0.0, 0.02, 0.05, 0.1, 0.2, 0.4, None]):
        writers.start(final, overwrite, seed=i + 1)
        if delay is None:  # the last one is let finish: "done", then it exits
            assert writers.line() == "done"
            writers.end("wait")
        else:
            time.sleep(delay)
            writers.end("kill")  # SIGKILL (a no-op on one that already finished)
        if final.exists():
            report = certckpt.verify(final)
            assert report.ok, report.problems  # never a partial file under the final name
            step = report.info.record.step
            outcomes.add("old" if step == 0 else "new")
            if not overwrite and step != 0:
                final.unlink()
        else:
            outcomes.add("absent")
        # the previous good checkpoint is untouched in every case
        old = tmp_path / "ck.safetensors"
        if not overwrite:
            assert certckpt.verify(old).ok and torch.equal(certckpt.load(old)["old"], torch.ones(3))
    writers.close()
    # the schedule spans "killed before publishing" and "finished": both outcomes must occur
    assert len(outcomes) >= 2, outcomes


def test_existing_name_is_refused_and_unchanged(tmp_path):
    p = tmp_path / "ck.safetensors"
    certckpt.save({"a": torch.ones(2)}, p)
    before = p.read_bytes()
    with pytest.raises(certckpt.CheckpointExistsError) as ei:
        certckpt.save({"a": torch.zeros(2)}, p, overwrite=False)
    assert isinstance(ei.value, FileExistsError) and "overwrite=True" in str(ei.value)
    assert p.read_bytes() == before
    assert [f for f in os.listdir(tmp_path)] == ["ck.safetensors"]  # no temp file left behind


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(certckpt.StorageError, match="directory does not exist"):
        certckpt.save({"a": torch.ones(2)}, tmp_path / "nope" / "ck.safetensors")


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, torch, certckpt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    try:
        certckpt.save({"big": torch.randn(1_000_000)}, sys.argv[1])  # replaces by default
    except certckpt.StorageError as e:
        print("StorageError:", e)
    """
)


def test_full_disk_keeps_previous_checkpoint(tmp_path):
    p = tmp_path / "ck.safetensors"
    certckpt.save({"small": torch.ones(3)}, p)
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(p)], capture_output=True, text=True, timeout=120)
    assert (
        "StorageError:" in out.stdout
        and "write failed" in out.stdout
        and "previous checkpoint is untouched" in out.stdout
    ), out
    assert certckpt.verify(p).ok and torch.equal(certckpt.load(p)["small"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ck.safetensors"]
