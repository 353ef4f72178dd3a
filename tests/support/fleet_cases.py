"""Per-rank function for the fleet registry test (run through certckpt.detect.launch): four run stores
and a fleet, every run in one launch of 3 gloo ranks, device identities set by CERTCKPT_INVENTORY."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, Fault, FaultDetectedError, MemorySink
from certckpt.errors import DeviceConvictedError
from certckpt.format.signing import SigningKey
from certckpt.trust.fleet import Fleet
from certckpt.trust.fleetscan import impact
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from tests.support.ddp_cases import _batch, _loss, _model


def _devices(prefix: str, *, rank1: str | None = None, host: str = "") -> None:
    inv = {str(r): {"device_id": f"{prefix}{r}", "host": host or f"node-{prefix}"} for r in range(3)}
    if rank1 is not None:
        inv["1"] = {"device_id": rank1, "host": "node-x"}
    os.environ["CERTCKPT_INVENTORY"] = json.dumps(inv)


def _train(args, store, *, steps, first=1, branch="main", parent=None, faults=None, saves=()):
    """One run (or one start of a branch) on ``store``; returns the step a fault stopped it at."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    aud = Auditor(
        DDP(m),
        opt,
        loss_fn=_loss,
        run=os.path.basename(store),
        branch=branch,
        parent=parent,
        start_step=first - 1,
        audit_every=5,
        ledger=store,
        sink=None if dist.get_rank() == 0 else MemorySink(),
        injector_faults=faults,
        fleet=args["fleet"],
    )
    try:
        for s in range(first, first + steps):
            aud.train_step(_batch(s))
            if s in saves:
                aud.save({"model": m.state_dict()}, f"{store}/{branch}-{s:03d}.safetensors")
    except FaultDetectedError as e:
        return e.event.step
    finally:
        aud.close()
    return None


def _refused(args, store):
    try:
        _train(args, store, steps=1)
    except DeviceConvictedError as e:
        return str(e)
    return None


def _verdicts(store):
    st = certify_store(store, write_certificates=False)
    return {cid: [v.label, list(v.reasons)] for cid, v in st.certification.verdicts.items()}


def fleet_story(args):
    rank = dist.get_rank()
    a, b, c, d = (args[k] for k in ("a", "b", "c", "d"))
    out: dict = {}
    # run B: `main` on its own devices, then (a restart) branch b2 with rank 1 on gpu-x
    _devices("gpu-b", host="node-b")
    _train(args, b, steps=10, saves=(5, 10))
    _devices("gpu-b", rank1="gpu-x", host="node-b")
    _train(args, b, steps=10, first=11, branch="b2", parent="main@10", saves=(15, 20))
    # run C never touches gpu-x
    _devices("gpu-c", host="node-c")
    _train(args, c, steps=10, saves=(5, 10))
    dist.barrier()
    if rank == 0:
        out["impact_before"] = impact(args["fleet"], "gpu-x").to_dict()
        out["b_before"] = _verdicts(b)
    dist.barrier()
    # run A: a persistent fault on rank 1, which runs on gpu-x: detected, gpu-x convicted
    _devices("gpu-a", rank1="gpu-x", host="node-a")
    out["a_caught"] = _train(args, a, steps=10, faults=[Fault(kind="backward", rank=1, step=3, persistent=True)])
    dist.barrier()
    if rank == 0:
        out["b_after"], out["c_after"] = _verdicts(b), _verdicts(c)
    # run D on gpu-x: refused on every rank
    _devices("gpu-d", rank1="gpu-x", host="node-d")
    out["d_refused"] = _refused(args, d)
    dist.barrier()
    if rank == 0:  # someone with write access and no key: an unsigned appeal and clearance
        forger = Fleet(args["fleet"], signing_key=None)
        conv = [cv["conviction_id"] for cv in forger.read().devices["gpu-x"].convictions]
        forger.ledger.write_record(
            "appeals",
            "appeal-forged.json",
            {"appeal_id": "appeal-forged", "device": "gpu-x", "convictions": conv, "by": "mallory", "reason": "x"},
        )
        forger.ledger.write_record(
            "clearances",
            "clear-f.json",
            {
                "clearance_id": "clear-forged",
                "device": "gpu-x",
                "approves": "appeal-forged",
                "by": "eve",
                "reason": "x",
            },
        )
    dist.barrier()
    out["d_refused_after_forgery"] = _refused(args, d)
    dist.barrier()
    if rank == 0:  # the real thing: alice appeals with her key, bob clears with his
        appeal = Fleet(args["fleet"], signing_key=SigningKey.load(args["alice"])).appeal(
            "gpu-x", by="alice", reason="bad cable, reseated; burn-in passed"
        )
        Fleet(args["fleet"], signing_key=SigningKey.load(args["bob"])).clear(
            "gpu-x", approves=appeal["appeal_id"], by="bob", reason="burn-in logs checked"
        )
    dist.barrier()
    out["d_refused_after_clearance"] = _refused(args, d)
    if rank == 0:
        out["b_cleared"] = _verdicts(b)
        out["d_placements"] = len(Ledger(d).list_raw("placements"))
    return out
