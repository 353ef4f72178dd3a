"""Across a fleet registry's run stores: what a conviction would change (``certckpt fleet impact``)
and each device's and host's detection rate (``certckpt fleet rates``). Reads only. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, FleetError

from .devices import device_steps, is_device_id, placements_of, rates
from .fleet import Fleet, FleetView
from .ledger import Ledger, LedgerSnapshot
from .runstore import certify_snapshot, convicted_ranges_for, read_remembering

__all__ = ["Impact", "impact", "fleet_rates"]


@dataclass(kw_only=True, slots=True)
class Impact:
    """What convicting ``device`` changes: per store, the checkpoints that would become suspect
    (``changes``: store, ckpt_id, verdict now, reasons after), and the stores that could not be read."""

    device: str
    fleet: str
    already_convicted: bool
    changes: list[dict[str, Any]] = field(default_factory=list)
    unreadable: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "fleet": self.fleet,
            "already_convicted": self.already_convicted,
            "changes": self.changes,
            "unreadable": self.unreadable,
        }


def impact(fleet: str, device: str) -> Impact:
    """Every registered store's checkpoints that convicting ``device`` makes suspect (its
    ``device-convicted`` ones that are not suspect for that reason now); nothing is written."""
    if not is_device_id(device):
        raise FleetError(f"device {device!r} is not a device id (letters, digits and ._:@/+-)")
    view = Fleet(fleet, signing_key=None).read()
    st = view.standing(device)
    out = Impact(device=device, fleet=view.url, already_convicted=bool(st and st.convicted))
    views: dict[str, FleetView] = {view.url: view}
    for store in view.stores:
        try:
            snap = read_remembering(Ledger(store, signing_key=None))
        except (CertckptError, OSError) as e:
            out.unreadable.append({"store": store, "why": str(e).splitlines()[0][:300]})
            continue
        now = certify_snapshot(snap, convicted=convicted_ranges_for(snap, views=views))
        then = certify_snapshot(snap, convicted=convicted_ranges_for(snap, extra=[device], views=views))
        for cid, after in sorted(then.verdicts.items()):
            before = now.verdicts[cid]
            if "device-convicted" in after.reasons and "device-convicted" not in before.reasons:
                out.changes.append(
                    {
                        "store": store,
                        "ckpt_id": cid,
                        "verdict": before.label,
                        "verdict_after": after.label,
                        "reasons_after": list(after.reasons),
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


def fleet_rates(fleet: str) -> dict[str, Any]:
    """Detections per million device-steps, per device and per host: convictions from the registry,
    device-steps from the placements of its stores (each rank computes every step of its run)."""
    view = Fleet(fleet, signing_key=None).read()
    steps: dict[str, int] = {}
    hosts: dict[str, str] = {}
    unreadable = []
    for store in view.stores:
        try:
            snap = read_remembering(Ledger(store, signing_key=None))
        except (CertckptError, OSError) as e:
            unreadable.append({"store": store, "why": str(e).splitlines()[0][:300]})
            continue
        s, h = device_steps(placements_of(snap.placements), _last_steps(snap))
        for dev, n in s.items():
            steps[dev] = steps.get(dev, 0) + n
        for dev, host in h.items():
            hosts.setdefault(dev, host)
    detections = {d: len(st.convictions) for d, st in view.devices.items()}
    for d, st in view.devices.items():
        hosts.setdefault(d, st.host)
        if st.host and not hosts[d]:
            hosts[d] = st.host
    out = rates(detections, steps, hosts)
    return {"fleet": view.url, **out, "unreadable": unreadable, "breaks": view.breaks}
