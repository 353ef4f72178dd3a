"""Every benchmark in benchmarks/ runs, in its tiny mode, so that none of them rots unnoticed.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``) makes a script run its whole code path on toy
sizes in seconds. Each script runs in its own process, two at a time (the next one starts while a
test waits for its own); the test asserts that it exits 0 and prints its table's header, never a
timing (tiny figures mean nothing). The GPU benchmarks skip without CUDA, as the GPU tests do.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.support.helpers import ROOT

BENCH = ROOT / "benchmarks"

# script -> what its report prints (its table's header), heaviest first: they start in this order
HEADERS: dict[str, tuple[str, ...]] = {
    "bench_fsdp_detect.py": ("ms/step median [min-max]", "Where the time goes", "inside the audit steps"),
    "bench_detect.py": ("ms/step median [min-max]", "Where the extra time goes", "inside the audit steps"),
    "bench_false_triggers.py": ("false triggers per 1,000 steps", "largest clean score"),
    "bench_lightning.py": ("save, CertifiedCheckpointIO", "load, CertifiedCheckpointIO"),
    "bench_format.py": ("1. SAVE (fsync included)", "2. VERIFY", "3. FINGERPRINT THROUGHPUT"),
    "bench_transformers.py": ("checkpoint save", "ratio certified / plain"),
    "bench_deepspeed.py": ("checkpoint save", "ratio certified / plain"),
    "bench_megatron.py": ("contender", "ratio save certified / torch_dist", "ratio load certified / torch_dist"),
    "bench_torchtitan.py": ("checkpoint save / load", "ratio certified / plain"),
    "bench_accelerate.py": ("save_state", "ratio certified / plain", "premium - floor"),
    "bench_dcp.py": ("1 process:", "2 gloo ranks", "dcp.save  certckpt", "dcp.load  certckpt"),
    "bench_keyed.py": ("keyed reads and signed writes", "tensors (whole processes)"),
    "bench_async.py": ("async save blocking / clone() of every tensor", "training loop"),
    "bench_vault.py": ("certckpt vault copies:", "ratio S3 restore"),
    "bench_certify.py": ("signed ledger:", "ledger scale:"),
    "bench_store_scale.py": ("requests per checkpoint commit, per writer", "latest-good (in process", "what it costs:"),
    "bench_startup.py": ("start-up, whole process", "certckpt verify"),
    "bench_gpu.py": ("bench_gpu on",),
    "gpu_session.sh": ("bench_gpu on",),
}
GPU_ONLY = {"bench_gpu.py", "gpu_session.sh"}
# script -> the optional package it measures (skipped without it)
NEEDS = {"bench_deepspeed.py": "deepspeed", "bench_megatron.py": "megatron.core", "bench_torchtitan.py": "torchtitan"}
TIMEOUT = 300  # seconds per script; tiny runs take 1-40 s on 2 cores


def _scripts() -> list[str]:
    return sorted(p.name for p in BENCH.iterdir() if p.name.startswith("bench_") or p.suffix == ".sh")


def test_every_benchmark_is_smoke_tested():
    """A new script in benchmarks/ needs its header here (and a tiny mode: it reads CERTCKPT_BENCH_TINY)."""
    assert sorted(HEADERS) == _scripts()
    for name in _scripts():
        text = (BENCH / name).read_text(encoding="utf-8")
        assert "tinymode" in text or "CERTCKPT_BENCH_TINY" in text, f"{name} has no tiny mode"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _installed(name: str) -> bool:
    import importlib.util

    return name not in NEEDS or importlib.util.find_spec(NEEDS[name]) is not None


class _Runs:
    """The tiny runs, started on demand two at a time: asking for one also starts the next in line
    (unless pytest-xdist splits the tests, when each worker runs only what it is asked for)."""

    def __init__(self, out: pathlib.Path, selected: list[str]) -> None:
        self.out = out
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.prefetch = "PYTEST_XDIST_WORKER" not in os.environ
        self.order = [n for n in HEADERS if n in selected and (n not in GPU_ONLY or _cuda()) and _installed(n)]

    def _start(self, name: str) -> Future:
        with self.lock:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self._run, name)
            return self.futures[name]

    def _run(self, name: str) -> tuple[subprocess.CompletedProcess, float]:
        env = dict(os.environ, CERTCKPT_BENCH_TINY="1", OUT=str(self.out / name), PYTHONUNBUFFERED="1")
        cmd = ["bash", str(BENCH / name)] if name.endswith(".sh") else [sys.executable, str(BENCH / name)]
        if name == "gpu_session.sh":
            env["GPU_SESSION_DEVICE"] = "cuda"
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        return r, time.perf_counter() - t0

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, float]:
        future = self._start(name)
        if self.prefetch and name in self.order:
            rest = self.order[self.order.index(name) + 1 :]
            if rest:
                self._start(rest[0])
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_benchmark_runs_tiny"
    ]
    r = _Runs(tmp_path_factory.mktemp("bench-out"), selected)
    yield r
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEADERS))
def test_benchmark_runs_tiny(runs, name):
    if name in GPU_ONLY and not _cuda():
        pytest.skip("needs CUDA (a session lent a GPU runs it: benchmarks/README.md)")
    if not _installed(name):
        pytest.skip(f"needs {NEEDS[name]} (bash scripts/install.sh {NEEDS[name]})")
    r, seconds = runs.result(name)
    tail = f"--- stdout ---\n{r.stdout[-6000:]}\n--- stderr ---\n{r.stderr[-6000:]}"
    assert r.returncode == 0, f"{name} exited {r.returncode} after {seconds:.0f} s\n{tail}"
    missing = [h for h in HEADERS[name] if h not in r.stdout]
    assert not missing, f"{name} printed no {missing}\n{tail}"


def test_timing_marks_are_off_outside_a_recording_and_nest_inside_one():
    """certckpt.detect.timing, which bench_detect's breakdown reads: a no-op without ``record()``;
    inside, every mark counts, and a mark within another also as ``outer/inner``."""
    from certckpt.detect import timing

    @timing.timed("outer")
    def outer() -> int:
        with timing.span("inner"):
            return 7

    assert outer() == 7 and outer.__name__ == "outer"
    with timing.record() as rec:
        assert outer() == 7
        with timing.span("inner"):
            pass
        with pytest.raises(RuntimeError), timing.record():
            pass
    assert rec.calls == {"outer": 1, "inner": 2, "outer/inner": 1}
    assert set(rec.seconds) == set(rec.calls) and all(v >= 0 for v in rec.seconds.values())
    outer()  # the recording is closed: nothing more counts
    assert rec.calls["outer"] == 1
    assert set(timing.PARTS) >= {"train_signature", "ring_shift", "replay", "replay_audit", "consensus"}
