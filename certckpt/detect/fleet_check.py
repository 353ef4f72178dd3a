"""The fleet registry at a run's start: every rank's device looked up before the first step.

Rank 0 reads the registry once and decides; every rank receives the same text in one all-gather,
then all refuse together (``DeviceConvictedError``, the same message on every rank) or all warn,
by the ``fleet_policy`` option. A registry that cannot be read refuses too (a run that cannot look
its devices up is not allowed to skip the look-up). A run that starts registers its store with the
registry and records where each rank runs (a placement) in its own ledger, so a later conviction
of one of its devices re-judges its checkpoints.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from certckpt.errors import CertckptError, DeviceConvictedError
from certckpt.trust.devices import device_of, host_of
from certckpt.trust.fleet import Fleet, FleetView, absolute_url

from .agreement import all_gather_bytes
from .stop import leave_refusal_marker

__all__ = ["fleet_for", "check_fleet_at_start"]


def fleet_for(value: Any, *, signing_key: Any) -> Fleet | None:
    """A session's ``fleet`` option: a ``Fleet``, its URL, or None."""
    if value is None or isinstance(value, Fleet):
        return value
    return Fleet(str(value), signing_key=signing_key)


def _known_problem(view: FleetView, ledger: Any) -> str | None:
    """What the run store itself knows of this registry and the registry no longer shows: a placement
    that pinned another registry identity (re-created), or this store missing from its list (emptied)."""
    if ledger is None:
        return None
    pinned: set[str] = set()
    try:
        names = ledger.list_raw("placements")
        for data in ledger.read_raw("placements", names).values():
            try:
                doc = json.loads(data)
            except (ValueError, RecursionError):
                continue
            if isinstance(doc, dict) and doc.get("fleet") == view.url and isinstance(doc.get("fleet_id"), str):
                pinned.add(doc["fleet_id"])
    except (CertckptError, OSError) as e:
        return f"this run's placements cannot be read ({str(e).splitlines()[0][:200]})"
    if pinned - {view.store_id}:
        return (
            f"fleet registry {view.url} is not the one this run was placed under before (re-created: its id is "
            f"{view.store_id}, the run's placements name {', '.join(sorted(pinned))}); restore the registry"
        )
    if pinned and absolute_url(ledger.store) not in view.stores:
        return f"fleet registry {view.url} no longer lists this run's store (emptied?); restore the registry"
    return None


def _convicted(view: FleetView, devices: dict[str, str]) -> list[list[str]]:
    """``[rank, device, host]`` of every rank whose device stands convicted in ``view``."""
    out = []
    for rank, dev in sorted(devices.items(), key=lambda kv: int(kv[0])):
        st = view.devices.get(dev)
        if st is not None and st.convicted:
            out.append([rank, dev, st.host])
    return out


def _rank0_verdict(
    fleet: Fleet, devices: dict[str, str], *, policy: str, ledger: Any, record: Any, found: list[list[str]]
) -> tuple[str, bool]:
    """Rank 0's look-up: (what is wrong, whether it refuses whatever the policy). A registry that is
    missing, tampered, re-created or emptied behind the run's back refuses whatever the policy
    (doubt never lets a run start). A run that goes on registers its store and records its placement
    here, before any rank trains: a run whose placement cannot be recorded does not start (a later
    conviction could not reach its checkpoints)."""
    try:
        view = fleet.read()
        doubt = view.doubt() or _known_problem(view, ledger)
        problem = "" if doubt else view.start_problem(devices) or ""
    except (CertckptError, OSError) as e:
        why = str(e).splitlines()[0][:300]
        return f"fleet registry {fleet.url} cannot be read ({why}); no run starts unchecked", True
    if doubt:
        return doubt, True
    found.extend(_convicted(view, devices) if problem else [])
    if problem and policy == "refuse":
        return problem, False
    try:
        record(view)
    except (CertckptError, OSError) as e:
        why = str(e).splitlines()[0][:300]
        return (problem + "; " if problem else "") + (
            f"this run's devices cannot be recorded for fleet {fleet.url} ({why}): without them a later"
            " conviction could not re-judge its checkpoints, so it does not start"
        ), True
    return problem, False


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
    gathered); rank 0 registers the store and records the placement of a run that goes on; every
    rank then refuses or warns together.

    Raises:
        DeviceConvictedError: on every rank, with rank 0's text, when a device is convicted and
            ``policy`` is ``"refuse"``, or whatever the policy when the registry cannot be read or
            is tampered, or the placement cannot be recorded.
    """
    devices = {r: device_of(inv) for r, inv in inventory.items()}

    def record(view: FleetView) -> None:
        if ledger is None:
            return
        fleet.register_store(ledger.store, store_id=ledger.store_id)
        ledger.record_placement(
            branch=branch,
            start_step=start_step,
            devices={r: d for r, d in devices.items() if d},
            hosts={r: host_of(inv) for r, inv in inventory.items()},
            run=run,
            fleet=fleet.url,
            fleet_id=view.store_id,
        )

    found: list[list[str]] = []
    mine = ("", False)
    if rank == 0:
        mine = _rank0_verdict(fleet, devices, policy=policy, ledger=ledger, record=record, found=found)
    wire = json.dumps([*mine, found]).encode("utf-8")
    text, fatal, bad = json.loads(all_gather_bytes(wire, group=group, wire_device=wire_device)[0].decode("utf-8"))
    if not text:
        return
    message = f"fleet check at the start of run {run}, branch {branch}: {text}"
    if policy == "refuse" or fatal:
        # a convicted device refuses with its own exit status (``certckpt run`` reads the marker even
        # when the script lets the error escape); a registry that cannot vouch is not the device's fault
        refused = [(str(r), str(d), str(h)) for r, d, h in bad] if not fatal else []
        error = DeviceConvictedError(message + f" (fleet_policy={policy!r}; every rank refused)", devices=refused)
        leave_refusal_marker(error)
        raise error
    warnings.warn(message + " (fleet_policy='warn': training anyway)", RuntimeWarning, stacklevel=3)
