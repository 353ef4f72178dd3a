"""Who wrote a checkpoint: host, software versions and devices, for the record and for incidents."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from certckpt.version import __version__

__all__ = ["writer_inventory", "SCHEDULER_ENV"]

# Identifiers schedulers and clouds set; kept when present so a rank can be traced to a node.
SCHEDULER_ENV = (
    "SLURM_JOB_ID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "KUBERNETES_POD_NAME",
    "POD_NAME",
    "NODE_NAME",
    "HOSTNAME",
    "INSTANCE_ID",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
)


def writer_inventory(devices: set[str]) -> dict[str, Any]:
    """Inventory of the writing process; ``devices`` are the torch device strings of saved tensors."""
    import torch  # the writer has it loaded already; the module itself stays importable without it

    names: list[str] = []
    for d in sorted(devices):
        if d.startswith("cuda") and torch.cuda.is_available():
            idx = torch.device(d).index or 0
            props = torch.cuda.get_device_properties(idx)
            uuid = str(getattr(props, "uuid", "")) or None
            names.append(f"{d}: {props.name}" + (f" (GPU-{uuid})" if uuid else ""))
        else:
            names.append(d)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "certckpt": __version__,
        "torch": torch.__version__,
        "devices": names,
        "env": {k: os.environ[k] for k in SCHEDULER_ENV if k in os.environ},
    }
