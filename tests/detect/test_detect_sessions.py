"""The behaviour both audit sessions share, asserted for each (``AuditSession`` for DDP,
``ShardedAuditSession`` for FSDP2 / HSDP, one ``core.AuditSessionCore``): the lineage a checkpoint
carries is capped, a signing key signs what the session writes, ``after_update`` says whether the
weight consensus agreed, and a failure raises on every rank only once rank 0 has written its incident.
Each of these once differed between the two sessions. Fast: one gloo rank in this process; slow: 3
gloo ranks (``tests/support/session_cases.py``)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from certckpt.detect import AuditSession, ShardedAuditSession
from certckpt.errors import CertckptError
from certckpt.format.signing import generate_key
from tests.support import session_cases

KINDS = ("ddp", "sharded")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _session(kind: str, **kw):
    """A session of ``kind`` on a small model, on the one-rank group of this process."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        return model, opt, AuditSession(model, opt, loss_fn=lambda mod, b: F.mse_loss(mod(b), b[:, :2]), **kw)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    model = fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return model, opt, ShardedAuditSession(model, opt, **kw)


def _step(kind: str, model, opt, session):
    batch = torch.randn(3, 4)
    if kind == "ddp":
        session.begin_micro_batch(batch)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(batch), batch[:, :2]).backward()
    if session.before_update():
        opt.step()
    return session.after_update()


@pytest.mark.parametrize("kind", KINDS)
def test_the_lineage_a_checkpoint_carries_is_capped(kind, rank0_group, monkeypatch):
    from certckpt.detect import context

    monkeypatch.setattr(context, "MAX_LINEAGE", 3)
    model, opt, session = _session(kind, consensus_every=1)
    for _ in range(5):  # a consensus event per step
        _step(kind, model, opt, session)
    assert len(session.sink.events) >= 5  # every event is still emitted
    assert len(session.state.lineage) == 3  # only the lineage is bounded
    session.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_that_was_never_committed_leaves_its_steps_to_the_next_ones_lineage(kind, rank0_group):
    model, opt, session = _session(kind, consensus_every=1)

    def evidence():  # the sharded session's consensus runs on exactly the state the checkpoint writes
        return session.checkpoint_evidence() if kind == "ddp" else session.checkpoint_evidence(model.state_dict())

    for _ in range(2):
        _step(kind, model, opt, session)
    kept = evidence()  # step 2: committed
    for _ in range(2):
        _step(kind, model, opt, session)
    failed = evidence()  # step 4: its save fails, perhaps in the background
    assert kept.step_range == [1, 2] and failed.step_range == [3, 4]
    for _ in range(2):
        _step(kind, model, opt, session)
    session.reopen_lineage(failed)
    after = evidence()  # step 6: reaches back over the failed checkpoint's steps
    assert after.step_range == [3, 6]
    steps = [a["step"] for a in after.lineage["audits"]]
    assert sorted(set(steps)) == [3, 4, 5, 6], after.lineage
    assert [a for a in after.lineage["audits"] if a["step"] <= 4] == failed.lineage["audits"]
    assert 4 not in session.state.awaiting_trust  # nothing of step 4 is committed to trust later
    session.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_signing_key_signs_the_ledger_the_session_writes(kind, rank0_group, tmp_path):
    for cls in (AuditSession, ShardedAuditSession):
        assert "signing_key" in inspect.signature(cls.__init__).parameters
    private, _ = generate_key(str(tmp_path / "keys" / "writer"))
    model, opt, session = _session(kind, ledger=str(tmp_path / "run"), signing_key=private)
    assert session.signing_key is not None and session.ledger.signing_key is session.signing_key
    _step(kind, model, opt, session)
    session.close()
    with pytest.raises((CertckptError, OSError)):  # a bad key file is refused before any step
        _session(kind, signing_key=str(tmp_path / "no-such-key"))


@pytest.mark.parametrize("kind", KINDS)
def test_after_update_returns_a_bool_on_a_clean_step(kind, rank0_group):
    model, opt, session = _session(kind)
    assert _step(kind, model, opt, session) is True  # no consensus ran
    session.close()
    model, opt, session = _session(kind, consensus_every=1)
    assert _step(kind, model, opt, session) is True  # the consensus ran and agreed
    session.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_disagreement_and_failure_are_the_same_on_every_rank_under_both_sessions(kind, tmp_path):
    """3 gloo ranks, rank 1's weights flipped after step 2: ``after_update`` returns False on every rank
    (``on_fault="continue"``); with ``"raise"`` every rank raises naming rank 1, and none before rank 0
    wrote the incident (slowed down here), through the same synchronisation under both sessions."""
    from certckpt.detect.launch import run_ranks

    args = {"kind": kind, "store": str(tmp_path / "run"), "write_seconds": 1.0}
    out = run_ranks(session_cases.after_update_and_failure_sync, 3, args, timeout=240)
    for r in out:
        assert r["returns"] == [True, False]
        assert r["raised"] is not None and r["raised"]["step"] == 2 and r["raised"]["suspects"] == [1]
        assert r["barriers"] == 0  # one all-reduce, read on the host, in both sessions
    (written,) = out[0]["written"]
    assert all(r["raised"]["at"] >= written for r in out)  # nobody left before rank 0's write was done
    assert len({r["incident"] for r in out}) == 1 and out[0]["incident"]
