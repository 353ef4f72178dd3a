# What the DDP fragments of the docs take for granted: a gloo process group (torchrun starts the
# ranks), a small model wrapped in DDP, its optimizer, a loss function taking (model, batch), a loader
# of 20 batches (each rank its own data), and `chunks` for gradient accumulation.
import atexit
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import certckpt  # noqa: F401  (the snippets' names)
from certckpt import Ledger  # noqa: F401
from certckpt.detect import Auditor, JsonlSink  # noqa: F401

dist.init_process_group("gloo")
_failed = []
_hook = sys.excepthook
sys.excepthook = lambda *exc: (_failed.append(exc), _hook(*exc))


@atexit.register
def _leave():
    # torch 2.13's gloo transport can abort in interpreter teardown (SIGABRT) when DDP objects outlive
    # the process group: leave once the output is flushed, with the script's own status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if _failed else 0)


torch.manual_seed(0)
os.makedirs("ckpt", exist_ok=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def loss_fn(m, batch):
    return F.mse_loss(m(batch[0]), batch[1])


_g = torch.Generator().manual_seed(dist.get_rank())
loader = [(x, x[:, :4].cos()) for x in (torch.randn(4, 8, generator=_g) for _ in range(20))]


def chunks(batches, n):
    return [batches[i : i + n] for i in range(0, len(batches), n)]
