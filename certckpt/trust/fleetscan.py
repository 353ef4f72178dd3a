"""Across a fleet registry's run stores: what a conviction would change (``certckpt fleet impact``)
and each device's and host's detection rate (``certckpt fleet rates``). Reads only. No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, FleetError

from .devices import device_host_steps, host_at, is_device_id, placements_of, rates
from .fleet import Fleet, FleetView, absolute_url
from .ledger import Ledger, LedgerSnapshot
from .runstore import certify_snapshot, convicted_ranges_for, read_remembering

__all__ = ["Impact", "impact", "fleet_rates"]


@dataclass(kw_only=True, slots=True)
class Impact:
    """What a conviction of ``device`` makes suspect: per store, the checkpoints that are suspect
    with it and would not be without it (``changes``: store, ckpt_id, ``verdict`` now,
    ``verdict_without`` and ``verdict_with`` its convictions, ``reasons_with``), the same list
    before the conviction is recorded and after; and the stores that could not be read (then the
    answer is incomplete: ``complete`` is False)."""

    device: str
    fleet: str
    already_convicted: bool
    changes: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.unreadable

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "fleet": self.fleet,
            "already_convicted": self.already_convicted,
            "complete": self.complete,
            "changes": self.changes,
            "unreadable": self.unreadable,
        }


def _relative(store: str) -> str | None:
    """Why a registered store's URL cannot be read as recorded (None: it can). A relative path names
    another store from every other directory: it is never resolved against this one."""
    if "://" in store or os.path.isabs(store):
        return None
    return (
        f"recorded by the relative path {store!r}: which store it names depends on the directory "
        "(registries now record absolute URLs); run the store's next start, or register it again by its absolute path"
    )


def _snapshots(view: FleetView, unreadable: list[dict[str, str]]) -> list[tuple[str, LedgerSnapshot]]:
    """Every registered store's ledger, read; the ones that cannot be read are listed with why."""
    out = []
    for store in view.stores:
        why = _relative(store)
        if why is None:
            try:
                out.append((store, read_remembering(Ledger(store, signing_key=None))))
                continue
            except (CertckptError, OSError) as e:
                why = str(e).splitlines()[0][:300]
        unreadable.append({"store": store, "why": why})
    return out


def impact(fleet: str, device: str) -> Impact:
    """Every registered store's checkpoints that a conviction of ``device`` makes suspect: those
    ``device-convicted`` with it counted convicted and not without it. The same answer before the
    conviction is recorded (what it would change) and after (what it changed). Nothing is written.

    Example:
        >>> [c["ckpt_id"] for c in impact("s3://ops/fleet", "GPU-5c1e").changes]
    """
    if not is_device_id(device):
        raise FleetError(f"device {device!r} is not a device id (letters, digits and ._:@/+-)")
    view = Fleet(fleet, signing_key=None).read()
    st = view.standing(device)
    out = Impact(device=device, fleet=view.url, already_convicted=bool(st and st.convicted))
    views: dict[str, FleetView] = {view.url: view}
    for store, snap in _snapshots(view, out.unreadable):
        now = certify_snapshot(snap, convicted=convicted_ranges_for(snap, views=views))
        without = certify_snapshot(snap, convicted=convicted_ranges_for(snap, exclude=[device], views=views))
        with_it = certify_snapshot(snap, convicted=convicted_ranges_for(snap, extra=[device], views=views))
        for cid, after in sorted(with_it.verdicts.items()):
            before = without.verdicts[cid]
            if "device-convicted" in after.reasons and "device-convicted" not in before.reasons:
                out.changes.append(
                    {
                        "store": store,
                        "ckpt_id": cid,
                        "verdict": now.verdicts[cid].label,
                        "verdict_without": before.label,
                        "verdict_with": after.label,
                        "reasons_with": list(after.reasons),
                    }
                )
    return out


def _last_steps(snap: LedgerSnapshot) -> dict[str, int]:
    """Per branch, the last step its ledger shows (audit facts and checkpoints)."""
    last: dict[str, int] = {}
    for name, bf in snap.facts.branches.items():
        if bf.mask:
            last[name] = max(bf.mask)
    for c in snap.checkpoints:
        last[c.branch] = max(last.get(c.branch, 0), c.step)
    return last


def _detection_hosts(view: FleetView, snaps: dict[str, LedgerSnapshot]) -> list[tuple[str, str]]:
    """``(device, host)`` of every conviction: the host the placement of the step its evidence names
    records for the blamed rank (a device id seen under two hosts is put where the detection ran),
    else the host the conviction itself records."""
    placements = {store: placements_of(snap.placements) for store, snap in snaps.items()}
    out = []
    for dev, st in view.devices.items():
        for c in st.convictions:
            ev = c.evidence
            store, branch, step, rank = ev.get("store"), ev.get("branch"), ev.get("step"), ev.get("rank")
            host = None
            where = placements.get(absolute_url(store)) if isinstance(store, str) and store else None
            if where and isinstance(branch, str) and type(step) is int and rank is not None:
                host = host_at(where, branch=branch, step=step, rank=str(rank), device=dev)
            out.append((dev, host if host is not None else str(c.raw.get("host") or st.host or "")))
    return out


def fleet_rates(fleet: str) -> dict[str, Any]:
    """Detections per million device-steps, per device and per host: convictions from the registry,
    device-steps from the placements of its stores (each rank computes every step of its run). A
    detection counts on the host where the placement of its step put the device."""
    view = Fleet(fleet, signing_key=None).read()
    unreadable: list[dict[str, str]] = []
    snaps = dict(_snapshots(view, unreadable))
    pairs: dict[tuple[str, str], list[int]] = {}  # (device, host) -> [detections, device-steps]
    for snap in snaps.values():
        for key, n in device_host_steps(placements_of(snap.placements), _last_steps(snap)).items():
            pairs.setdefault(key, [0, 0])[1] += n
    for key in _detection_hosts(view, snaps):
        pairs.setdefault(key, [0, 0])[0] += 1
    detections: dict[str, int] = {}
    steps: dict[str, int] = {}
    hosts: dict[str, list[str]] = {}
    by_host: dict[str, tuple[int, int]] = {}
    for (dev, host), (n, k) in sorted(pairs.items()):
        detections[dev] = detections.get(dev, 0) + n
        steps[dev] = steps.get(dev, 0) + k
        if host and host not in hosts.setdefault(dev, []):
            hosts[dev].append(host)
        h = by_host.get(host, (0, 0))
        by_host[host] = (h[0] + n, h[1] + k)
    out = rates(detections, steps, {d: ", ".join(h) for d, h in hosts.items()}, by_host=by_host)
    return {"fleet": view.url, **out, "unreadable": unreadable, "breaks": view.breaks}
