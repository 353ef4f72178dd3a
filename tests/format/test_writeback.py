"""Writeback started while a file is written (``certckpt.format.writeback``): the ranges handed to
``sync_file_range``, a no-op where the platform lacks it, and certified files that still verify."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import certckpt
from certckpt.format import writeback as wbmod
from certckpt.format.durable import durable_together
from certckpt.format.writeback import SYNC_FILE_RANGE_WRITE, Writeback


def _recorder() -> tuple[list[tuple[int, int, int, int]], wbmod.Starter]:
    calls: list[tuple[int, int, int, int]] = []

    def starter(fd: int, offset: int, n: int, flags: int) -> int:
        calls.append((fd, offset, n, flags))
        return 0

    return calls, starter


def test_writeback_starts_each_full_stretch_once_and_leaves_the_rest_and_the_header_to_the_fsync():
    calls, starter = _recorder()
    wb = Writeback(7, every=25, starter=starter)
    assert wb.active
    for k in range(9):  # 90 bytes in pieces of 10, after a 16-byte header's place
        wb.written(16 + 10 * k, 10)
    wb.written(0, 16)  # the header, written last: behind what was started
    assert calls == [(7, 0, 26, SYNC_FILE_RANGE_WRITE), (7, 26, 30, SYNC_FILE_RANGE_WRITE),
                     (7, 56, 30, SYNC_FILE_RANGE_WRITE)]  # fmt: skip
    assert wb.calls == 3  # bytes 86..106 are fewer than `every`: the fsync takes them


def test_a_large_write_starts_at_once_and_a_gap_is_covered_by_the_next_start():
    calls, starter = _recorder()
    wb = Writeback(3, every=100, starter=starter)
    wb.written(0, 250)
    wb.written(300, 10)  # 250..300 not written yet: pending, not started
    wb.written(250, 50)  # the gap filled: the start covers it and what followed
    wb.written(310, 40)
    assert calls == [(3, 0, 250, SYNC_FILE_RANGE_WRITE), (3, 250, 100, SYNC_FILE_RANGE_WRITE)]


@pytest.mark.parametrize("starter", [None, False])
def test_without_a_starter_writeback_does_nothing(starter):
    wb = Writeback(5, every=1, starter=starter)
    assert not wb.active
    wb.written(0, 1 << 30)
    assert wb.calls == 0


def test_no_starter_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert wbmod._load_starter() is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_system_call_is_found_on_linux_and_the_bytes_written_around_it_read_back(tmp_path):
    assert wbmod.system_starter() is not None
    data = os.urandom(3 << 20)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        wb = Writeback(fd, every=1 << 20)
        for off in range(0, len(data), 300_000):  # pieces that do not line up with pages
            os.pwrite(fd, data[off : off + 300_000], off)
            wb.written(off, len(data[off : off + 300_000]))
        os.fsync(fd)
    finally:
        os.close(fd)
    assert wb.calls == 2  # at 1_200_000 and 2_400_000 bytes; the last 0.7 MiB left to the fsync
    assert path.read_bytes() == data


def test_preallocate_reserves_the_whole_size_or_says_it_did_not(tmp_path, monkeypatch):
    fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert not wbmod.preallocate(fd, 0)
        reserved = wbmod.preallocate(fd, 1_000_003)
        assert os.fstat(fd).st_size == (1_000_003 if reserved else 0)
        if sys.platform.startswith("linux"):
            assert wbmod._FALLOCATE is not None  # the call exists; a file system may still refuse it
    finally:
        os.close(fd)
    monkeypatch.setattr(wbmod, "_FALLOCATE", None)  # off Linux, or a libc without it
    fd = os.open(tmp_path / "b", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert not wbmod.preallocate(fd, 4096)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert wbmod._load_fallocate() is None


@pytest.mark.parametrize("fallocate", ["system", "refused"])
def test_certified_saves_with_writeback_every_few_bytes_verify_byte_for_byte(tmp_path, monkeypatch, fallocate):
    """The writer's ranges, started every 4 KiB (tensors of odd sizes, a header written last), make
    files that verify and load back equal, alone and inside a durable_together block, whether the
    file was preallocated or the file system refused it."""
    if fallocate == "refused":
        monkeypatch.setattr(wbmod, "_FALLOCATE", lambda fd, mode, off, n: -1)
    calls, starter = _recorder()
    real = wbmod.system_starter()

    def both(fd: int, offset: int, n: int, flags: int) -> int:
        starter(fd, offset, n, flags)
        return real(fd, offset, n, flags) if real is not None else 0

    monkeypatch.setattr(wbmod, "WRITEBACK_BYTES", 4096)
    monkeypatch.setattr(wbmod, "_SYSTEM", both)
    g = torch.Generator().manual_seed(0)
    state = {
        "a": torch.randn(1000, 37, generator=g),
        "b": torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=g),
        "c": torch.randn(3, dtype=torch.float64, generator=g),
    }
    alone = tmp_path / "alone.safetensors"
    certckpt.save(state, alone, step=1)
    with durable_together():
        certckpt.save(state, tmp_path / "together.safetensors", step=1)
    assert calls, "the writer never started writeback"
    assert min(off for _, off, _, _ in calls) > 0  # the header's place (written last) is never started
    for f in (alone, tmp_path / "together.safetensors"):
        assert os.path.getsize(f) == os.path.getsize(alone)  # nothing reserved past the end
        assert certckpt.verify(f, deep=True).ok
        back = certckpt.load(f)
        assert all(torch.equal(back[k], v) for k, v in state.items())
