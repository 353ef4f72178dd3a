"""A DDP training loop with certckpt's detection hooks. Run on CPU with 3 ranks:

    python -m torch.distributed.run --nproc-per-node 3 examples/audited_ddp.py --dir audited-run
    certckpt status audited-run

``--inject-fault-at STEP`` plants a persistent finite fault on rank 1 (a drill): the replay audit
catches it, an incident is opened in the run store, and every rank exits with status 86.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, Fault, stop_on_fault

parser = argparse.ArgumentParser()
parser.add_argument("--dir", default="audited-run")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--inject-fault-at", type=int, default=None)
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)  # same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
os.makedirs(args.dir, exist_ok=True)
drill = [Fault(kind="backward", rank=1, step=args.inject_fault_at, persistent=True)] if args.inject_fault_at else None

with stop_on_fault(hard_exit=True):  # one line and exit 87 if a fleet registry refuses a rank's device
    auditor = Auditor(
        ddp,
        opt,
        loss_fn=lambda m, batch: F.mse_loss(m(batch[0]), batch[1]),  # loss from (model, batch)
        run="example",
        audit_every=10,  # full audit every 10 steps
        ledger=args.dir,  # events, commits, incidents
        injector_faults=drill,
    )
g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
with stop_on_fault(auditor, hard_exit=True):  # exit 86 on a detected fault
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 32, generator=g)
        loss = auditor.train_step((x, x[:, :8].sin()))  # checks + optimizer step
        if step % 20 == 0:  # checkpoint with audit lineage
            auditor.save(
                {"model": model.state_dict(), "optim": opt.state_dict()},
                f"{args.dir}/{auditor.branch}@{step}.safetensors",
            )
auditor.close()
if dist.get_rank() == 0:
    print(f"trained {args.steps} steps; last clean audit at step {auditor.last_clean_audit}; files in {args.dir}/")
dist.destroy_process_group()
# torch 2.13's gloo transport sometimes aborts in interpreter teardown ("terminate called without an
# active exception"), plain DDP included (2 runs in 8 here): leave without running C++ destructors.
os._exit(0)
