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


@pytest.mark.parametrize("sentinels", [True, False])
def test_a_sessions_exchanges_never_wait_out_their_patience(rank0_group, monkeypatch, sentinels):
    """The early exchange of a step's flags (sentinel rows, or summed flags) is asynchronous: its work
    object holds the tensors until it is dropped, so a wait for the worker begun while the work is
    alive would cost every step ``PATIENCE``. Each step here goes through that exchange."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.detect import AuditSession, Triggers
    from certckpt.detect.nonfinite import NonFiniteCheck

    settled = []
    settle = NonFiniteCheck._settle_early
    monkeypatch.setattr(NonFiniteCheck, "_settle_early", lambda self: settled.append(r := settle(self)) or r)
    monkeypatch.setattr(letgo, "gave_up", 0)
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    model, opt = DDP(m), torch.optim.SGD(m.parameters(), lr=0.1)
    triggers = {} if sentinels else {"triggers": Triggers(enabled=False)}
    session = AuditSession(
        model, opt, loss_fn=lambda mod, b: F.mse_loss(mod(b), b[:, :2]), exchange_flags="every-step", **triggers
    )
    for _ in range(3):
        batch = torch.randn(3, 4)
        session.begin_micro_batch(batch)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(batch), batch[:, :2]).backward()
        session.after_backward()  # starts the early exchange
        assert session.before_update()
        opt.step()
        session.after_update()
    session.close()
    assert [r is not None for r in settled].count(True) == 3  # every step's exchange was an early one
    assert letgo.gave_up == 0
