"""The demo's training job: a small model, 3 gloo ranks on CPU, the auditor, a planted fault.

``certckpt demo`` (certckpt_cli/demo.py) drives it in two launches:

1. ``train_faulty``: branch ``main`` from scratch, checkpoint every ``ckpt_every`` steps; a
   persistent finite fault on one rank from ``fault_step`` (bad hardware that keeps computing
   wrong but plausible gradients). The replay audit catches it, the auditor opens an incident and
   training stops.
2. ``train_recovery``: a clean reference run from scratch (what training would have been without
   the fault; its metrics are what the restore drill compares with), then branch ``b2`` resumed
   from latest-good with the faulty node replaced, to the end.

The model has no dropout and the data are a function of (rank, step), so the recovered branch
retraces the clean reference: up to latest-good the weights are identical, after it they agree to
float rounding (a restarted DDP job may sum gradients in a different order), well within the
drill's tolerance.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["make_model", "evaluate", "train_faulty", "train_recovery", "SCHEDULE"]

SCHEDULE = {"steps": 60, "audit_every": 10, "ckpt_every": 5, "fault_step": 23, "fault_rank": 1}


def make_model():
    """The demo model, freshly built (``--model certckpt.tools.demo:make_model``)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    )


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :8] * 1.7).sin() + 0.3 * x[:, 8:]


def _loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


def evaluate(model) -> dict[str, float]:
    """Held-out loss (``--eval certckpt.tools.demo:evaluate``)."""
    import torch

    model.eval()
    with torch.no_grad():
        return {"eval_loss": float(_loss(model, _batch(999, 0)))}


def _setup(*, lr: float = 3e-3):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, DDP(model), opt


def _train(
    auditor,
    model,
    opt,
    *,
    first: int,
    last: int,
    ckpt_every: int,
    store: str | None,
    rank: int,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from certckpt.detect.auditor import FaultDetectedError

    for step in range(first, last + 1):
        try:
            auditor.train_step(_batch(rank, step))
        except FaultDetectedError as e:
            return {
                "stopped_at": step,
                "incident": e.incident_id,
                "kind": e.event.kind,
                "suspect_ranks": e.event.suspect_ranks,
            }
        if step % ckpt_every == 0:
            if metrics is not None and rank == 0:
                metrics[str(step)] = evaluate(model)
                model.train()
            if store is not None:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                auditor.save(state, os.path.join(store, f"{auditor.branch}-step{step:06d}.safetensors"))
    return {"stopped_at": None}


def train_faulty(args: dict[str, Any]) -> dict[str, Any]:
    """Launch 1, per rank: branch main with the planted fault, until the checks stop it."""
    import torch.distributed as dist

    from certckpt.detect.auditor import Auditor
    from certckpt.detect.inject import Fault
    from certckpt.trust.ledger import Ledger

    rank = dist.get_rank()
    s = args["schedule"]
    model, ddp, opt = _setup()
    fault = Fault(kind="backward", rank=s["fault_rank"], step=s["fault_step"], persistent=True, scale=0.05)
    auditor = Auditor(
        ddp,
        opt,
        loss_fn=_loss,
        run="demo",
        audit_every=s["audit_every"],
        ledger=Ledger(args["store"]),
        injector_faults=[fault],
    )
    out = _train(
        auditor, model, opt, first=1, last=s["steps"], ckpt_every=s["ckpt_every"], store=args["store"], rank=rank
    )
    auditor.close()
    dist.barrier()
    return out


def train_recovery(args: dict[str, Any]) -> dict[str, Any]:
    """Launch 2, per rank: the clean reference run, then branch b2 resumed from latest-good."""
    import torch.distributed as dist

    from certckpt.detect.auditor import Auditor
    from certckpt.detect.events import MemorySink
    from certckpt.format.reader import load
    from certckpt.trust.ledger import Ledger

    rank = dist.get_rank()
    s = args["schedule"]
    # the clean reference: the same job without the fault (its metrics, not its files, are kept)
    model, ddp, opt = _setup()
    reference: dict[str, Any] = {}
    ref_auditor = Auditor(
        ddp, opt, loss_fn=_loss, run="demo-reference", audit_every=s["audit_every"], sink=MemorySink()
    )
    _train(
        ref_auditor,
        model,
        opt,
        first=1,
        last=s["steps"],
        ckpt_every=s["ckpt_every"],
        store=None,
        rank=rank,
        metrics=reference,
    )
    ref_auditor.close()
    if rank == 0:
        with open(args["reference_out"], "w", encoding="utf-8") as f:
            json.dump(reference, f, indent=2, sort_keys=True)
    dist.barrier()
    # branch b2 from latest-good, on healthy hardware
    model, ddp, opt = _setup()
    state = load(args["resume_from"])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    start = int(state["step"])
    ledger = Ledger(args["store"])
    if rank == 0:
        ledger.start_branch("b2", parent=args["parent"])
    auditor = Auditor(
        ddp,
        opt,
        loss_fn=_loss,
        run="demo",
        branch="b2",
        audit_every=s["audit_every"],
        ledger=ledger,
        parent=args["parent"],
        start_step=start,
    )
    out = _train(
        auditor,
        model,
        opt,
        first=start + 1,
        last=s["steps"],
        ckpt_every=s["ckpt_every"],
        store=args["store"],
        rank=rank,
    )
    auditor.close()
    dist.barrier()
    return out
