"""Issue 45, "Refusals a scheduler understands": a run refused on a convicted device prints one line
per rank and exits 87 (``EXIT_DEVICE_REFUSED``), through ``stop_on_fault`` and through ``certckpt run``
around torchrun (which itself exits 1); the run that convicted the device says so in its exit line."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from certckpt.detect.launch import free_port
from certckpt.detect.stop import EXIT_DEVICE_REFUSED, stop_on_fault
from certckpt.errors import DeviceConvictedError, FaultDetectedError
from certckpt.trust.fleet import Fleet
from tests.support.helpers import console_script

SCRIPT = """
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, Fault, MemorySink, stop_on_fault

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
faults = [Fault(kind="backward", rank=1, step=3, persistent=True)] if os.environ.get("INJECT") else None


def build():
    return Auditor(
        DDP(model), opt, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), run=os.environ["RUN"], audit_every=5,
        ledger=os.environ["STORE"], fleet=os.environ["FLEET"], injector_faults=faults,
        sink=None if rank == 0 else MemorySink(),
    )


if os.environ.get("WRAP"):
    with stop_on_fault(hard_exit=True):  # the constructor looks the devices up: one line and exit 87
        aud = build()
else:
    aud = build()
g = torch.Generator().manual_seed(rank)
with stop_on_fault(aud, hard_exit=True):
    for s in range(1, 11):
        x = torch.randn(4, 8, generator=g)
        aud.train_step((x, x[:, :4].cos()))
aud.close()
dist.destroy_process_group()
os._exit(0)
"""


def test_refusals_a_scheduler_understands_one_line_and_exit_87(capsys, monkeypatch):
    monkeypatch.delenv("CERTCKPT_DETECTION_DIR", raising=False)
    err = DeviceConvictedError("fleet check ...: rank 1 runs on device gpu-x", devices=[("1", "gpu-x", "node-x")])
    with pytest.raises(SystemExit) as e, stop_on_fault():
        raise err
    assert e.value.code == EXIT_DEVICE_REFUSED == 87
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("certckpt: refused: fleet check") and "exit 87" in line and "gpu-x (host node-x)" in line
    # the registry could not vouch for anyone: not the device's fault, the CLI's "cannot answer"
    with pytest.raises(SystemExit) as e, stop_on_fault():
        raise DeviceConvictedError("fleet registry /f is tampered")
    assert e.value.code == 2 and "cannot vouch" in capsys.readouterr().err


def test_refusals_a_scheduler_understands_the_convicting_run_says_so(capsys):
    from certckpt.detect.events import AuditEvent

    ev = AuditEvent(run="r", branch="main", step=5, kind="replay", outcome="fail", ranks=[0, 1, 2], suspect_ranks=[1])
    with pytest.raises(SystemExit) as e, stop_on_fault():
        raise FaultDetectedError(
            "step 5: replay failed", ev, incident_id="inc-main-5-replay", convicted=["gpu-x"], fleet="/f"
        )
    assert e.value.code == 86
    (line,) = capsys.readouterr().err.splitlines()
    assert "convicted device(s) gpu-x in fleet registry /f" in line and "exit 86" in line


class _Writes(io.RawIOBase):
    """A raw stream that keeps each system-call-sized write apart."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.calls.append(bytes(b))
        return len(b)


def test_each_refusal_and_exit_line_reaches_stderr_in_one_write(monkeypatch):
    # ranks share one stderr; under PYTHONUNBUFFERED (CI runners, many launchers) a line written as
    # text then newline is two writes, and another rank's line can land between them (stop 49's CI)
    from certckpt.detect.events import AuditEvent

    raw = _Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    monkeypatch.delenv("CERTCKPT_DETECTION_DIR", raising=False)
    with pytest.raises(SystemExit), stop_on_fault():
        raise DeviceConvictedError("fleet check: rank 1 runs on device gpu-x", devices=[("1", "gpu-x", "node-x")])
    ev = AuditEvent(run="r", branch="main", step=5, kind="replay", outcome="fail", ranks=[0, 1, 2], suspect_ranks=[1])
    with pytest.raises(SystemExit), stop_on_fault():
        raise FaultDetectedError("step 5: replay failed", ev, incident_id="inc-main-5-replay")
    sys.stderr.flush()
    assert len(raw.calls) == 2 and all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in raw.calls), raw.calls
    assert raw.calls[0].startswith(b"certckpt: refused: ") and raw.calls[1].startswith(b"certckpt: step 5")


def _torchrun(tmp_path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.py").write_text(SCRIPT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port"]
    cmd = [console_script("certckpt"), "run", "--", *launcher, str(free_port()), "train.py"]
    inventory = {"*": {"host": "node-a"}, "1": {"device_id": "gpu-x", "host": "node-x"}}
    full = {**os.environ, "CERTCKPT_INVENTORY": json.dumps(inventory), "FLEET": str(tmp_path / "fleet"), **env}
    for k in ("CERTCKPT_TRUSTED_KEYS", "CERTCKPT_SIGNING_KEY", "CERTCKPT_DETECTION_DIR"):
        full.pop(k, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=full)


@pytest.mark.slow
def test_refusals_a_scheduler_understands_through_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    (tmp_path / "fleet").mkdir()
    Fleet(str(tmp_path / "fleet"), signing_key=None).create()
    for store in ("a", "d", "e"):
        (tmp_path / store).mkdir()
    # run a: rank 1's device, gpu-x, computes a fault; the replay audit at step 5 convicts it
    a = _torchrun(tmp_path, RUN="a", STORE=str(tmp_path / "a"), INJECT="1")
    assert a.returncode == 86, a.stderr[-3000:]
    # torchrun stops the other workers as soon as one exits, so a rank may go before its own line:
    # every line that was printed says what the run convicted, and at least one was
    exits = [ln for ln in a.stderr.splitlines() if ln.startswith("certckpt: step 5")]
    assert 1 <= len(exits) <= 3 and all("convicted device(s) gpu-x in fleet registry" in ln for ln in exits), exits
    # run d on gpu-x, its construction inside stop_on_fault: one line per rank, no traceback, exit 87
    d = _torchrun(tmp_path, RUN="d", STORE=str(tmp_path / "d"), WRAP="1")
    assert d.returncode == 87, d.stderr[-3000:]
    refused = [ln for ln in d.stderr.splitlines() if ln.startswith("certckpt: refused: ")]
    distinct = sorted(set(refused))
    assert 1 <= len(refused) <= 3 and len(distinct) == 1 and "gpu-x (host node-x)" in refused[0], distinct
    assert "DeviceConvictedError" not in d.stderr and 'train.py", line' not in d.stderr
    last = d.stderr.strip().splitlines()[-1]
    assert re.search(
        r"[123] rank\(s\) refused to start on convicted device\(s\) gpu-x \(node\(s\) node-x\): exit 87", last
    ), last
    # run e lets the error escape (three tracebacks): the refusal's own marker still makes it 87
    e = _torchrun(tmp_path, RUN="e", STORE=str(tmp_path / "e"))
    assert e.returncode == 87 and "DeviceConvictedError" in e.stderr, e.stderr[-3000:]
