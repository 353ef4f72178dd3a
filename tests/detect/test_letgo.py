"""letgo.released: a collective's tensors outlive the worker's hold on them, and the wait is bounded."""

from __future__ import annotations

import threading

import pytest
import torch

from certckpt.detect import letgo

pytestmark = pytest.mark.skipif(not hasattr(torch.Tensor, "_use_count"), reason="this torch has no _use_count")


def test_released_waits_until_the_other_holder_lets_go(monkeypatch):
    t = torch.zeros(4)
    held: dict[str, torch.Tensor] = {}
    waiting = threading.Event()

    def yield_(*_):  # released is waiting for the holder now: let it go
        waiting.set()

    monkeypatch.setattr(letgo.os, "sched_yield", yield_)
    worker = threading.Thread(target=lambda: (waiting.wait(), held.clear()))
    with letgo.released(t):
        held["work"] = t.view(-1)  # a view holds its base: another holder, as gloo's work is for a moment
        worker.start()
    assert waiting.is_set() and held == {}  # it left only once the holder had let go
    worker.join()


def test_released_gives_up_after_its_patience(monkeypatch):
    monkeypatch.setattr(letgo, "PATIENCE", 0.01)
    t = torch.zeros(4)
    with letgo.released(t):
        kept = t.view(-1)  # never let go (a process group that keeps its work)
    assert t._use_count() == 2 and kept.data_ptr() == t.data_ptr()  # the caller went on, still held


def test_released_does_not_wait_when_the_block_raised():
    t = torch.zeros(4)
    with pytest.raises(RuntimeError), letgo.released(t):
        kept = t.view(-1)
        raise RuntimeError("collective failed")
    del kept
