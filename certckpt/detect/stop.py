"""Stop a training job on an uncontained detection, the way a scheduler can act on.

Wrap the training loop::

    with stop_on_fault(auditor):
        for batch in loader:
            auditor.train_step(batch)

On a ``FaultDetectedError`` every rank prints the incident id, the suspect ranks and nodes, closes
the auditor (flushing events to the ledger) and exits with ``EXIT_FAULT_DETECTED`` (86): "not a
transient failure; do not requeue on the suspect node". A Kubernetes podFailurePolicy rule on that
exit code, or a Slurm epilog that drains the named node, keeps the job off the bad hardware.

A launcher between the ranks and the scheduler may hide that status (``torchrun`` exits 1 whatever
its workers' codes). So each rank also leaves a small marker in ``$CERTCKPT_DETECTION_DIR`` when it
is set, and ``certckpt run -- LAUNCHER ...`` (which sets it) exits 86 when the launcher failed and a
marker says why. The marker carries ``$CERTCKPT_LAUNCH_ID`` (a fresh id ``certckpt run`` gives each
launch): a marker of another launch never counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from certckpt.errors import FaultDetectedError
from certckpt.trust.incident import EXIT_FAULT_DETECTED, incident_id_for, node_of

__all__ = ["stop_on_fault", "EXIT_FAULT_DETECTED", "DETECTION_DIR_ENV", "LAUNCH_ID_ENV"]

DETECTION_DIR_ENV = "CERTCKPT_DETECTION_DIR"
LAUNCH_ID_ENV = "CERTCKPT_LAUNCH_ID"  # set by `certckpt run` for each launch; written into the marker


def _leave_marker(exit_code: int, incident: str | None, suspects: list[int], nodes: list[str], message: str) -> None:
    """Tell a wrapping ``certckpt run`` why this rank stops (best effort: the exit code stands alone).

    The marker names the launch (``$CERTCKPT_LAUNCH_ID``) so that ``certckpt run`` counts only its own.
    It is written to a fresh temporary file (never opened by name: whatever else sits in the directory,
    a FIFO included, cannot block the rank) and renamed into place."""
    directory = os.environ.get(DETECTION_DIR_ENV)
    if not directory:
        return
    doc = {
        "launch": os.environ.get(LAUNCH_ID_ENV),
        "exit": exit_code,
        "incident": incident,
        "suspect_ranks": suspects,
        "nodes": nodes,
        "rank": os.environ.get("RANK"),
        "message": message[:500],
    }
    tmp = None
    try:
        data = json.dumps(doc).encode()
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="detection-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, f"detection-{os.getpid()}.json"))
        tmp = None
    except (OSError, TypeError, ValueError):
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def stop_on_fault(auditor: Any, *, exit_code: int = EXIT_FAULT_DETECTED, hard_exit: bool = False) -> Iterator[None]:
    """Turn a ``FaultDetectedError`` raised inside the block into a documented exit.

    Args:
        exit_code: the process's exit status (default 86).
        hard_exit: leave with ``os._exit`` after flushing and destroying the process group, skipping
            interpreter teardown (torch 2.13's gloo transport sometimes aborts there, which would
            turn the documented status into SIGABRT). Default: raise ``SystemExit``.
    """
    try:
        yield
    except FaultDetectedError as e:
        ev = e.event
        nodes = sorted({node_of(ev.inventory.get(str(r), {})) for r in ev.suspect_ranks} - {""})
        where = f" on node(s) {', '.join(nodes)}" if nodes else ""
        suspects = ", ".join(map(str, ev.suspect_ranks)) or "not attributed"
        # The id follows from the event (every rank and a later `status` derive the same one).
        iid = None if ev.contained else e.incident_id or incident_id_for(ev.to_dict())
        record = f"incident {iid}" if iid else "contained: the bad update never reached the weights, no incident"
        print(
            f"certckpt: {e}; suspect rank(s) {suspects}{where}; {record}; "
            f"exit {exit_code}: do not requeue on the suspect node",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            auditor.close()
        _leave_marker(exit_code, iid, list(ev.suspect_ranks), nodes, str(e))
        if hard_exit:
            import torch.distributed as dist

            sys.stdout.flush()
            sys.stderr.flush()
            with contextlib.suppress(Exception):
                if dist.is_initialized():
                    dist.destroy_process_group()
            os._exit(exit_code)
        raise SystemExit(exit_code) from None
