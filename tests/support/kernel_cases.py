"""Per-rank function that builds the trust kernel's world (run through certckpt.detect.launch): four
signed runs of 3 gloo ranks, three of them placed under one fleet registry. Run ``det`` has a persistent fault on
rank 1, whose device (gpu-x) is convicted; run ``prior`` ran on gpu-x before anyone knew; run
``clean`` trains without one. The test promotes the clean run into a vault afterwards and then
attacks copies of all of it (tests/trust/test_trust_kernel.py, tests/trust/test_attack_model.py)."""

from __future__ import annotations

import torch.distributed as dist

from certckpt.detect import Fault
from tests.support.fleet_cases import _devices, _train


def kernel_world(args):
    """``clean``: checkpoints at 5, 10, 15, 20, all trusted. ``prior``: rank 1 on gpu-x before anyone
    knew, checkpoints at 5 and 10 (trusted until the conviction: their unaudited steps ran there).
    ``det``: checkpoints at 5, 10 (trusted) and 13 (after the fault at 12 that the audit at 15
    catches, naming rank 1 on gpu-x, which the registry then convicts). ``solo``: the same, under no
    registry (its after-fault checkpoint is suspect by its own ledger's failure alone)."""
    _devices("gpu-c")
    _train(args, args["clean"], steps=20, saves=(5, 10, 15, 20))
    dist.barrier()
    _devices("gpu-p", rank1="gpu-x")
    _train(args, args["prior"], steps=10, saves=(5, 10))
    dist.barrier()
    _devices("gpu-d", rank1="gpu-x")
    fault = Fault(kind="backward", rank=1, step=12, persistent=True)
    caught = _train(args, args["det"], steps=20, saves=(5, 10, 13), faults=[fault])
    dist.barrier()
    _devices("gpu-s")  # the same fault, in a run under no registry: nothing but its own ledger judges it
    solo = _train({"fleet": None}, args["solo"], steps=20, saves=(5, 10, 13), faults=[fault])
    dist.barrier()
    return {"caught": caught, "solo": solo}
