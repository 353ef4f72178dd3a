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

A run refused at its start because a rank's device is convicted in the fleet registry
(``DeviceConvictedError``, raised by the session's constructor) is not a crash either: wrap the
construction too (``with stop_on_fault(): auditor = Auditor(...)``) and every rank prints one line
and exits ``EXIT_DEVICE_REFUSED`` (87): "requeue, but not on that device". The refusal leaves its
marker itself, so ``certckpt run`` exits 87 even when the script lets the error escape. A refusal
because the registry cannot vouch for its convictions (missing, unreadable, tampered) exits 2, as
any question that cannot be answered: fix the registry, the device is not to blame.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from certckpt.errors import DeviceConvictedError, FaultDetectedError
from certckpt.log import say
from certckpt.trust.incident import EXIT_DEVICE_REFUSED, EXIT_FAULT_DETECTED, incident_id_for, node_of

__all__ = [
    "stop_on_fault",
    "leave_refusal_marker",
    "refusal_exit_code",
    "EXIT_FAULT_DETECTED",
    "EXIT_DEVICE_REFUSED",
    "EXIT_REGISTRY_UNVERIFIABLE",
    "DETECTION_DIR_ENV",
    "LAUNCH_ID_ENV",
]

DETECTION_DIR_ENV = "CERTCKPT_DETECTION_DIR"
LAUNCH_ID_ENV = "CERTCKPT_LAUNCH_ID"  # set by `certckpt run` for each launch; written into the marker
EXIT_REGISTRY_UNVERIFIABLE = 2  # refused because the fleet registry cannot vouch (the CLI's "cannot answer")


def _leave_marker(
    exit_code: int,
    incident: str | None,
    suspects: list[int],
    nodes: list[str],
    message: str,
    *,
    kind: str = "detection",
    devices: list[str] | None = None,
) -> None:
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
        "kind": kind,
        "devices": devices or [],
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


def refusal_exit_code(error: DeviceConvictedError) -> int:
    """87 when a convicted device refused the run; 2 when the registry could not vouch for anyone."""
    return EXIT_DEVICE_REFUSED if error.devices else EXIT_REGISTRY_UNVERIFIABLE


def leave_refusal_marker(error: DeviceConvictedError) -> None:
    """The marker of a run refused at its start (every rank leaves one; best effort)."""
    ranks = [int(r) for r, _, _ in error.devices if str(r).isdigit()]
    hosts = sorted({h for _, _, h in error.devices if h})
    devices = sorted({d for _, d, _ in error.devices})
    _leave_marker(refusal_exit_code(error), None, ranks, hosts, str(error), kind="device-refused", devices=devices)


def _refusal_line(error: DeviceConvictedError, exit_code: int) -> str:
    if not error.devices:
        return f"certckpt: refused: {error}; exit {exit_code}: the fleet registry cannot vouch for its convictions"
    devices = ", ".join(sorted({f"{d} (host {h or '?'})" for _, d, h in error.devices}))
    return (
        f"certckpt: refused: {error}; exit {exit_code}: convicted device(s) {devices}; requeue on other devices, "
        "not on these"
    )


def _exit(code: int, *, hard_exit: bool) -> None:
    if hard_exit:
        import torch.distributed as dist

        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        os._exit(code)
    raise SystemExit(code) from None


@contextlib.contextmanager
def stop_on_fault(
    auditor: Any = None, *, exit_code: int = EXIT_FAULT_DETECTED, hard_exit: bool = False
) -> Iterator[None]:
    """Turn a ``FaultDetectedError`` raised inside the block into a documented exit, and a run
    refused at its start (``DeviceConvictedError``) into one line and exit 87.

    Args:
        auditor: the session (or callback) to close on a detection; None around its construction
            (``with stop_on_fault(): auditor = Auditor(..., fleet=...)``).
        exit_code: the process's exit status on a detection (default 86).
        hard_exit: leave with ``os._exit`` after flushing and destroying the process group, skipping
            interpreter teardown (torch 2.13's gloo transport sometimes aborts there, which would
            turn the documented status into SIGABRT). Default: raise ``SystemExit``.
    """
    try:
        yield
    except DeviceConvictedError as e:
        code = refusal_exit_code(e)
        say(_refusal_line(e, code))
        leave_refusal_marker(e)
        if auditor is not None:
            with contextlib.suppress(Exception):
                auditor.close()
        _exit(code, hard_exit=hard_exit)
    except FaultDetectedError as e:
        ev = e.event
        nodes = sorted({node_of(ev.inventory.get(str(r), {})) for r in ev.suspect_ranks} - {""})
        where = f" on node(s) {', '.join(nodes)}" if nodes else ""
        suspects = ", ".join(map(str, ev.suspect_ranks)) or "not attributed"
        # The id follows from the event (every rank and a later `status` derive the same one).
        iid = None if ev.contained else e.incident_id or incident_id_for(ev.to_dict())
        record = f"incident {iid}" if iid else "contained: the bad update never reached the weights, no incident"
        convicted = list(getattr(e, "convicted", []) or [])
        conviction = (
            f"; convicted device(s) {', '.join(convicted)} in fleet registry {e.fleet}"
            f" (`certckpt fleet show {convicted[0]}`)"
            if convicted
            else ""
        )
        say(
            f"certckpt: {e}; suspect rank(s) {suspects}{where}; {record}{conviction}; "
            f"exit {exit_code}: do not requeue on the suspect node"
        )
        if auditor is not None:
            with contextlib.suppress(Exception):
                auditor.close()
        _leave_marker(exit_code, iid, list(ev.suspect_ranks), nodes, str(e), devices=convicted)
        _exit(exit_code, hard_exit=hard_exit)
