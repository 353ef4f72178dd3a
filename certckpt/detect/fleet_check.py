"""The fleet registry at a run's start: every rank's device looked up before the first step.

Rank 0 reads the registry once and decides; every rank receives the same text in one all-gather,
then all refuse together (``DeviceConvictedError``, the same message on every rank) or all warn,
by the ``fleet_policy`` option. A registry that cannot be read refuses too (a run that cannot look
its devices up is not allowed to skip the look-up). A run that starts registers its store with the
registry and records where each rank runs (a placement) in its own ledger, so a later conviction
of one of its devices re-judges its checkpoints.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from certckpt.errors import CertckptError, DeviceConvictedError
from certckpt.trust.devices import device_of, host_of
from certckpt.trust.fleet import Fleet

from .agreement import all_gather_bytes

__all__ = ["fleet_for", "check_fleet_at_start"]


def fleet_for(value: Any, *, signing_key: Any) -> Fleet | None:
    """A session's ``fleet`` option: a ``Fleet``, its URL, or None."""
    if value is None or isinstance(value, Fleet):
        return value
    return Fleet(str(value), signing_key=signing_key)


def _rank0_verdict(fleet: Fleet, devices: dict[str, str]) -> str:
    try:
        return fleet.read().start_problem(devices) or ""
    except (CertckptError, OSError) as e:
        return f"fleet registry {fleet.url} cannot be read ({str(e).splitlines()[0][:300]}); no run starts unchecked"


def check_fleet_at_start(
    fleet: Fleet,
    *,
    policy: str,
    inventory: dict[str, dict[str, Any]],
    rank: int,
    group: Any,
    wire_device: Any,
    ledger: Any,
    run: str,
    branch: str,
    start_step: int,
) -> None:
    """Look every rank's device up (a collective: every rank calls it, after the inventories are
    gathered); refuse or warn together; then (rank 0) register the store and record the placement.

    Raises:
        DeviceConvictedError: on every rank, with rank 0's text, when a device is convicted (or the
            registry cannot be read or is tampered) and ``policy`` is ``"refuse"``.
    """
    devices = {r: device_of(inv) for r, inv in inventory.items()}
    verdict = _rank0_verdict(fleet, devices) if rank == 0 else ""
    text = all_gather_bytes(verdict.encode("utf-8"), group=group, wire_device=wire_device)[0].decode("utf-8")
    if text:
        message = f"fleet check at the start of run {run}, branch {branch}: {text}"
        if policy == "refuse":
            raise DeviceConvictedError(message + " (fleet_policy='refuse'; every rank refused)")
        warnings.warn(message + " (fleet_policy='warn': training anyway)", RuntimeWarning, stacklevel=3)
    if rank != 0:
        return
    try:
        if ledger is not None:
            fleet.register_store(ledger.store)
            ledger.record_placement(
                branch=branch,
                start_step=start_step,
                devices={r: d for r, d in devices.items() if d},
                hosts={r: host_of(inv) for r, inv in inventory.items()},
                run=run,
                fleet=fleet.url,
            )
    except (CertckptError, OSError) as e:
        # training goes on; the run's checkpoints then carry no placement (a later conviction cannot
        # reach them): say so where the operator looks
        print(f"certckpt: could not record this run's devices for fleet {fleet.url}: {e}", file=sys.stderr)
