"""Per-rank functions for tests/detect/test_detect_sessions.py: the same scenario under both audit sessions.

``kind`` is ``"ddp"`` (``AuditSession`` on a DDP model) or ``"sharded"`` (``ShardedAuditSession`` on an
HSDP model whose every rank is a replica: a 3 x 1 mesh), so that a flipped weight on one rank is a
consensus failure naming it under either session. Run through ``certckpt.detect.launch.run_ranks``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from certckpt.detect import AuditSession, events
from certckpt.errors import FaultDetectedError


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))


def _loss(model: Any, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


class Run:
    """One audited model under ``kind``'s session, stepped by a loop of the user's own."""

    def __init__(self, kind: str, **session_kw: Any) -> None:
        self.kind = kind
        m = _model()
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model: Any = DDP(m)
            self.opt = torch.optim.SGD(m.parameters(), lr=0.1)
            self.first = m[0].weight
            self.session: Any = AuditSession(self.model, self.opt, loss_fn=_loss, audit_every=100, **session_kw)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            from certckpt.detect import ShardedAuditSession

            mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            self.model = fully_shard(m, mesh=mesh)
            self.opt = torch.optim.SGD(m.parameters(), lr=0.1)
            self.first = m[0].weight
            self.session = ShardedAuditSession(self.model, self.opt, **session_kw)
        self.gen = torch.Generator().manual_seed(10 + dist.get_rank())

    def step(self, *, flip: bool = False) -> Any:
        """One optimizer step; ``flip``: a bit flipped in this rank's copy of a weight after the update."""
        x = torch.randn(4, 6, generator=self.gen)
        batch = (x, x[:, :3].sin())
        if self.kind == "ddp":
            self.session.begin_micro_batch(batch)
        self.opt.zero_grad(set_to_none=True)
        _loss(self.model, batch).backward()
        if self.session.before_update():
            self.opt.step()
        if flip:
            with torch.no_grad():
                local = self.first.to_local() if hasattr(self.first, "to_local") else self.first
                local.view(-1).view(torch.int32)[2] ^= 1 << 20
        return self.session.after_update()


def after_update_and_failure_sync(args: dict[str, Any]) -> dict[str, Any]:
    """What ``after_update`` returns (a clean step; a disagreement under ``on_fault="continue"``), and
    how every rank leaves a failure under ``on_fault="raise"``: when, against rank 0's incident write."""
    kind, rank = args["kind"], dist.get_rank()
    out: dict[str, Any] = {}
    run = Run(kind, consensus_every=1, on_fault="continue", ledger=args["store"] + "-continue")
    out["returns"] = [run.step(), run.step(flip=rank == 1)]
    run.session.close()

    barriers: list[int] = []
    real_barrier = dist.barrier

    def counted_barrier(*a: Any, **kw: Any) -> Any:
        barriers.append(1)
        return real_barrier(*a, **kw)

    written: list[float] = []
    real_open = events.open_incident

    def slow_open(*a: Any, **kw: Any) -> Any:  # rank 0's incident write takes a while
        time.sleep(args["write_seconds"])
        result = real_open(*a, **kw)
        written.append(time.time())
        return result

    dist.barrier = counted_barrier  # type: ignore[assignment]
    events.open_incident = slow_open  # type: ignore[assignment]
    try:
        run = Run(kind, consensus_every=1, on_fault="raise", ledger=args["store"])
        run.step()
        try:
            run.step(flip=rank == 1)
            out["raised"] = None
        except FaultDetectedError as e:
            out["raised"] = {"at": time.time(), "step": e.event.step, "suspects": e.event.suspect_ranks}
            out["incident"] = e.incident_id
        run.session.close()
    finally:
        dist.barrier = real_barrier  # type: ignore[assignment]
        events.open_incident = real_open  # type: ignore[assignment]
    out["written"] = written
    out["barriers"] = len(barriers)
    return out
