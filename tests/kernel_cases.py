"""Per-rank function that builds the trust kernel's world (run through certckpt.detect.launch): two
signed runs of 3 gloo ranks placed under one fleet registry. Run ``det`` has a persistent fault on
rank 1, whose device (gpu-x) is convicted; run ``clean`` trains without one. The test promotes the
clean run into a vault afterwards and then attacks copies of all of it (tests/test_trust_kernel.py,
tests/test_attack_model.py)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from ddp_cases import _batch, _loss, _model
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, Fault, FaultDetectedError, MemorySink


def _devices(prefix: str, *, rank1: str | None = None) -> None:
    inv = {str(r): {"device_id": f"{prefix}{r}", "host": f"node-{prefix}"} for r in range(3)}
    if rank1 is not None:
        inv["1"] = {"device_id": rank1, "host": "node-x"}
    os.environ["CERTCKPT_INVENTORY"] = json.dumps(inv)


def _train(store: str, fleet: str, *, steps: int, saves: tuple[int, ...], faults=None) -> int | None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    aud = Auditor(
        DDP(m),
        opt,
        loss_fn=_loss,
        run=os.path.basename(store),
        audit_every=5,
        ledger=store,
        sink=None if dist.get_rank() == 0 else MemorySink(),
        injector_faults=faults,
        fleet=fleet,
    )
    try:
        for s in range(1, steps + 1):
            aud.train_step(_batch(s))
            if s in saves:
                aud.save({"model": m.state_dict()}, f"{store}/main-{s:03d}.safetensors")
    except FaultDetectedError as e:
        return e.event.step
    finally:
        aud.close()
    return None


def kernel_world(args):
    """``clean``: checkpoints at 5, 10, 15, 20, all trusted. ``prior``: rank 1 on gpu-x before anyone
    knew, checkpoints at 5 and 10 (trusted until the conviction: their unaudited steps ran there).
    ``det``: checkpoints at 5, 10 (trusted) and 13 (after the fault at 12 that the audit at 15
    catches, naming rank 1 on gpu-x, which the registry then convicts)."""
    _devices("gpu-c")
    _train(args["clean"], args["fleet"], steps=20, saves=(5, 10, 15, 20))
    dist.barrier()
    _devices("gpu-p", rank1="gpu-x")
    _train(args["prior"], args["fleet"], steps=10, saves=(5, 10))
    dist.barrier()
    _devices("gpu-d", rank1="gpu-x")
    fault = Fault(kind="backward", rank=1, step=12, persistent=True)
    caught = _train(args["det"], args["fleet"], steps=20, saves=(5, 10, 13), faults=[fault])
    dist.barrier()
    return {"caught": caught}
