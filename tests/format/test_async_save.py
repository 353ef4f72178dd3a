"""Asynchronous saves: the caller waits for a snapshot only; the file, its durability, its publish and
its commit follow in the background with the synchronous path's guarantees; failures are never lost."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import certckpt
from certckpt.format import asyncsave


def _state(seed: int = 0, n: int = 1 << 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g).half()},
        "optim": {"step": 3, "lr": 0.1, "m": torch.zeros(5, dtype=torch.int64)},
        "flag": torch.ones(3, dtype=torch.bool),
    }


def test_the_file_holds_the_state_at_the_call_not_after(tmp_path):
    state = _state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    saver = certckpt.AsyncSaver()
    pending = saver.save(state, tmp_path / "a.safetensors", step=3, run="r")
    state["model"]["w"].add_(1.0)  # training goes on at once: the snapshot was taken before returning
    state["model"]["b"].zero_()
    result = pending.result()
    saver.close()
    loaded = certckpt.load(tmp_path / "a.safetensors")
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())
    assert loaded["optim"]["step"] == 3 and loaded["flag"].dtype == torch.bool
    report = certckpt.verify(tmp_path / "a.safetensors", deep=True)  # fingerprints recomputed from bytes
    assert report.ok, report.problems
    sync = certckpt.save(
        {"model": expected, "optim": state["optim"], "flag": state["flag"]}, tmp_path / "s.safetensors", step=3
    )
    assert result.state_fp == sync.state_fp and result.location == str(tmp_path / "a.safetensors")
    assert pending.blocking_seconds > 0 and pending.location == str(tmp_path / "a.safetensors")


def test_staging_memory_is_sized_to_the_state_and_reused(tmp_path):
    state = _state(n=1 << 18)
    saver = certckpt.AsyncSaver()
    saver.save(state, tmp_path / "1.safetensors").result()
    held = saver.staging_bytes
    data = sum(t.numel() * t.element_size() for t in (*state["model"].values(), state["optim"]["m"], state["flag"]))
    assert data <= held < data + 64  # the data region's bytes (and its alignment), nothing more
    area = saver._areas[0]
    before = area._buffer.data_ptr()
    saver.save(state, tmp_path / "2.safetensors").result()
    assert area._buffer.data_ptr() == before and saver.staging_bytes == held  # the same memory, again
    saver.close()
    assert saver.staging_bytes == 0  # close gives it back


def test_one_save_in_flight_a_second_waits_for_the_first(tmp_path, monkeypatch):
    release = threading.Event()
    real_publish = asyncsave.publish

    def slow_publish(job, target, **kw):
        release.wait(30)
        return real_publish(job, target, **kw)

    monkeypatch.setattr(asyncsave, "publish", slow_publish)
    saver = certckpt.AsyncSaver()
    first = saver.save(_state(1), tmp_path / "1.safetensors")
    second_done = threading.Event()

    def second():
        saver.save(_state(2), tmp_path / "2.safetensors").result()
        second_done.set()

    t = threading.Thread(target=second)
    t.start()
    assert not second_done.wait(0.3) and not first.done()  # the second waits while the first is in flight
    release.set()
    t.join(30)
    assert first.done() and second_done.is_set()
    saver.close()


def test_two_in_flight_on_request(tmp_path, monkeypatch):
    release = threading.Event()
    real_publish = asyncsave.publish
    monkeypatch.setattr(
        asyncsave, "publish", lambda job, target, **kw: (release.wait(30), real_publish(job, target, **kw))[1]
    )
    saver = certckpt.AsyncSaver(max_in_flight=2)
    a = saver.save(_state(1), tmp_path / "1.safetensors")
    b = saver.save(_state(2), tmp_path / "2.safetensors")  # returns: a second staging area is free
    assert not a.done() and not b.done()
    release.set()
    assert a.result().location != b.result().location
    assert len(saver._areas) == 2
    saver.close()
    with pytest.raises(certckpt.ConfigurationError, match="max_in_flight"):
        certckpt.AsyncSaver(max_in_flight=0)


def test_a_failure_nobody_asked_for_surfaces_at_the_next_save(tmp_path):
    saver = certckpt.AsyncSaver()
    failing = saver.save(_state(), tmp_path / "missing-dir" / "a.safetensors")
    concurrent.futures.wait([failing])  # done, and nobody has looked at its outcome
    with pytest.raises(certckpt.AsyncSaveError, match="missing-dir/a.safetensors: the asynchronous save failed") as ei:
        saver.save(_state(), tmp_path / "b.safetensors")
    assert isinstance(ei.value.__cause__, certckpt.StorageError) and "directory does not exist" in str(ei.value)
    assert not (tmp_path / "b.safetensors").exists()  # the refused call started nothing
    saver.save(_state(), tmp_path / "b.safetensors").result()  # raised once: the saver goes on
    saver.close()


def test_a_failure_seen_through_its_future_is_not_raised_again(tmp_path):
    saver = certckpt.AsyncSaver()
    pending = saver.save(_state(), tmp_path / "missing-dir" / "a.safetensors")
    with pytest.raises(certckpt.StorageError, match="directory does not exist"):
        pending.result()
    saver.save(_state(), tmp_path / "b.safetensors").result()
    saver.close()


def test_close_raises_what_failed_in_the_background(tmp_path):
    saver = certckpt.AsyncSaver()
    saver.save(_state(), tmp_path / "missing-dir" / "a.safetensors")
    with pytest.raises(certckpt.AsyncSaveError, match="nothing was published"):
        saver.close()
    assert saver.staging_bytes == 0  # given back all the same


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_background_runs_at_a_lower_cpu_priority_than_the_caller(tmp_path):
    seen: dict[str, int] = {}

    def then(result):  # runs in the background thread, after the write
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver = certckpt.AsyncSaver()
    saver.save(_state(), tmp_path / "a.safetensors", then=then).result()
    assert seen["nice"] == min(19, mine + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is untouched
    same = certckpt.AsyncSaver(background_nice=0)
    same.save(_state(), tmp_path / "b.safetensors", then=then).result()
    assert seen["nice"] == mine
    with pytest.raises(certckpt.ConfigurationError, match="background_nice"):
        certckpt.AsyncSaver(background_nice=20)


def test_bad_input_is_refused_in_the_callers_thread(tmp_path):
    saver = certckpt.AsyncSaver()
    with pytest.raises(certckpt.UnsupportedObjectError):
        saver.save({"f": lambda: 0}, tmp_path / "a.safetensors")
    with pytest.raises(certckpt.ArgumentTypeError):
        saver.save(_state(), tmp_path / "a.safetensors", overwrite="yes")
    saver.save(_state(), tmp_path / "a.safetensors").result()  # the staging area was given back
    saver.close()


def test_latest_good_never_names_a_checkpoint_still_being_written(tmp_path, monkeypatch):
    store = tmp_path / "run"
    store.mkdir()
    certckpt.save(_state(0), store / "main@10.safetensors", ledger=str(store), step=10)
    release = threading.Event()
    real_publish = asyncsave.publish
    monkeypatch.setattr(
        asyncsave, "publish", lambda job, target, **kw: (release.wait(30), real_publish(job, target, **kw))[1]
    )
    pending = certckpt.async_save(_state(1), store / "main@20.safetensors", ledger=str(store), step=20)
    _, latest = certckpt.find_latest_good(str(store), accept="verified", write_certificates=False)
    assert latest == "main@10" and not (store / "main@20.safetensors").exists()
    release.set()
    assert pending.result().location == str(store / "main@20.safetensors")
    _, latest = certckpt.find_latest_good(str(store), accept="verified", write_certificates=False)
    assert latest == "main@20"


def test_a_ledger_name_already_taken_is_refused_at_the_call(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    certckpt.save(_state(0), store / "main@10.safetensors", ledger=str(store), step=10)
    with pytest.raises(certckpt.CheckpointExistsError, match="keeps every committed checkpoint"):
        certckpt.async_save(_state(1), store / "main@10.safetensors", ledger=str(store), step=11)
    with pytest.raises(certckpt.ConfigurationError, match="needs step"):
        certckpt.async_save(_state(1), store / "x.safetensors", ledger=str(store))


EXIT_IN_FLIGHT = textwrap.dedent(
    """
    import sys, torch, certckpt
    state = {f"t{i}": torch.randn(1_000_000) for i in range(8)}
    certckpt.async_save(state, sys.argv[1], ledger=sys.argv[2], step=5)
    print("returned", flush=True)
    # the interpreter exits here with the save in flight
    """
)


def test_a_process_exiting_with_a_save_in_flight_finishes_it(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", EXIT_IN_FLIGHT, str(store / "main@5.safetensors"), str(store)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "returned", out
    assert certckpt.verify(store / "main@5.safetensors").ok
    _, latest = certckpt.find_latest_good(str(store), accept="verified", write_certificates=False)
    assert latest == "main@5"  # and its commit record was written before the process ended


KILLER = textwrap.dedent(
    """
    # One fork per kill: a fresh python would spend a second importing torch each time. Every kill is
    # tied to what the child has done, never to how long it has run (a busy machine's slow child gets
    # the same kills): each child reports every committed save on a pipe, and is killed only after
    # its first. Then even kills land at a random point of its stream of saves, odd ones the moment
    # its own temp file shows in the store (in the middle of a write).
    import glob, json, os, random, select, signal, sys, time
    import torch, certckpt
    store, kills = sys.argv[1], int(sys.argv[2])
    rng = random.Random(7)
    mid_write = 0

    def wait_for(what, check, deadline=120.0):
        end = time.monotonic() + deadline
        while not check():
            if time.monotonic() > end:
                sys.exit(f"no {what} within {deadline:.0f} s")
            time.sleep(0.0005)

    for i in range(kills):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            torch.set_num_threads(1)
            state = {f"t{j}": torch.full((200_000,), float(i * 100 + j)) for j in range(8)}
            k = 0
            while True:
                step = i * 1000 + k
                done = certckpt.async_save(state, f"{store}/main@{step}.safetensors", ledger=store, step=step)
                done.add_done_callback(lambda f: os.write(w, b"." if f.exception() is None else b"!"))
                k += 1
        os.close(w)
        ready, _, _ = select.select([r], [], [], 120)
        first = os.read(r, 1) if ready else b""
        if first != b".":  # the child's first save failed, or never finished
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sys.exit(f"kill {i}: the child's first save did not commit ({first!r})")
        temps = os.path.join(store, f".main@*.certckpt-tmp-{pid}-*")
        if i % 2 == 0:
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGKILL)
        else:
            wait_for("temp file", lambda: glob.glob(temps))
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        mid_write += i % 2 == 1 and bool(glob.glob(temps))  # still there: the kill cut a write
    print(json.dumps({"kills": kills, "mid_write": mid_write}))
    """
)


@pytest.mark.slow
def test_kill_9_during_background_writes_leaves_nothing_partial_and_the_ledger_coherent(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    kills = 50  # 25 at a random point of the stream of saves, 25 in the middle of a write
    out = subprocess.run(
        [sys.executable, "-c", KILLER, str(store), str(kills)], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["kills"] == kills
    visible = sorted(n for n in os.listdir(store) if n.endswith(".safetensors") and not n.startswith("."))
    assert len(visible) >= kills  # every child was killed after its first save had committed...
    # ...and some in the middle of a write: its temp file is left, hidden, and nothing names it
    assert report["mid_write"] >= 1 and any("certckpt-tmp" in n for n in os.listdir(store))
    for name in visible:  # never a partial file under a checkpoint's name
        result = certckpt.verify(store / name)
        assert result.ok, (name, result.problems)
    status = certckpt.certify_store(str(store), write_certificates=False)
    snap = status.snapshot
    assert not snap.breaks, snap.breaks  # every writer's chain intact, killed or not
    committed = {r["url"] for r in snap.records.values()}
    assert committed <= set(visible)  # a commit record only ever names a published file
    assert len(committed) >= len(visible) - kills  # at most one published-but-uncommitted file per kill
    _, latest = certckpt.find_latest_good(str(store), accept="verified", write_certificates=False)
    assert latest is not None and f"{latest}.safetensors" in visible


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensors_are_fingerprinted_on_the_device_and_staged_pinned(tmp_path):
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.randn(3, device="cuda").half()}
    saver = certckpt.AsyncSaver()
    pending = saver.save(state, tmp_path / "g.safetensors", step=1)
    state["w"].mul_(2)  # after the call returns: not in the file
    pending.result()
    assert saver._areas[0].pinned
    loaded = certckpt.load(tmp_path / "g.safetensors")
    assert torch.equal(loaded["w"], (state["w"] / 2).cpu())
    assert certckpt.verify(tmp_path / "g.safetensors", deep=True).ok
    saver.close()


def _resident_fraction(path) -> float:
    """The share of a file's pages in the page cache (mincore on a read-only mapping; mapping a
    file reads nothing into the cache)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap failed: errno {ctypes.get_errno()}")
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise are Linux's here")
def test_a_background_save_leaves_the_page_cache_to_training(tmp_path):
    state = {"w": torch.randn(8 << 20)}  # 32 MiB
    certckpt.save(state, tmp_path / "sync.safetensors")
    if _resident_fraction(tmp_path / "sync.safetensors") < 0.9:
        pytest.skip("this file system does not keep written files in the page cache")
    saver = certckpt.AsyncSaver()
    saver.save(state, tmp_path / "async.safetensors").result()
    saver.close()
    assert _resident_fraction(tmp_path / "async.safetensors") < 0.1  # dropped once durable
    assert certckpt.verify(tmp_path / "async.safetensors").ok  # and read back from the disk whole
