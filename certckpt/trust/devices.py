"""Devices in a fleet registry: who they are, whether they stand convicted, and which steps they computed.

The pure part of the fleet (``certckpt.trust.fleet`` reads and writes the records). A **conviction**
is a detection that named a device (the suspect rank's inventory); an **appeal** is a proposal to
set a device's convictions aside; a **clearance** approves an appeal, by someone else with another
key (the incidents' two-key rule). A device stands convicted while any conviction of it is not
covered by an approved appeal.

A run configured with a fleet records a **placement** in its own ledger at every start: per rank,
the device it ran on, and the step it started from. A placement covers the steps ``(start, end]``
of its branch, ``end`` the next authenticated placement's start on that branch (none: open-ended):
those are the steps its devices computed. No I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import FleetError

from .records import AppealRecord, ClearanceRecord, ConvictionRecord, PlacementRecord, is_device_id

__all__ = [
    "DeviceStanding",
    "Placement",
    "check_appeal",
    "check_clearance",
    "conviction_spans",
    "convicted_ranges",
    "device_host_steps",
    "device_of",
    "device_steps",
    "host_at",
    "fleet_standing",
    "host_of",
    "is_device_id",
    "placements_of",
    "rates",
    "unaudited_overlap",
]

Range = tuple[int, int | None]  # (lo, hi]: hi None is open-ended


def device_of(inv: Mapping[str, object]) -> str:
    """A rank's device identity from its inventory: an explicit ``device_id`` (set through the
    inventory override, ``CERTCKPT_INVENTORY``), the CUDA device's UUID, else ``host/device``
    (``node-3/cpu``). ``""`` when the inventory names none usable."""
    for candidate in (inv.get("device_id"), inv.get("device_uuid")):
        if is_device_id(candidate):
            return str(candidate)
    host, dev = inv.get("host"), inv.get("device")
    joined = f"{host}/{dev}" if host and dev else ""
    return joined if is_device_id(joined) else ""


def host_of(inv: Mapping[str, object]) -> str:
    """The host a rank ran on (scheduler node names first, as incidents name nodes)."""
    found = inv.get("env")
    env: Mapping[str, object] = found if isinstance(found, Mapping) else {}
    for value in (inv.get("node"), env.get("SLURMD_NODENAME"), env.get("KUBERNETES_NODE_NAME"), inv.get("host")):
        if isinstance(value, str) and value:
            return value[:200]
    return ""


@dataclass(kw_only=True, slots=True)
class DeviceStanding:
    """One device as a fleet registry's records describe it now.

    Attributes:
        convictions: every conviction of it, oldest first (``authenticated`` says whether a trusted
            writer vouches for it; an unauthenticated one still convicts, as a failed check demotes).
        appeals: its appeals, oldest first; clearances: the clearances that took effect.
        cleared: the conviction ids an approved appeal set aside.
    """

    device: str
    host: str = ""
    convictions: list[ConvictionRecord] = field(default_factory=list)
    appeals: list[AppealRecord] = field(default_factory=list)
    clearances: list[ClearanceRecord] = field(default_factory=list)
    cleared: set[str] = field(default_factory=set)

    @property
    def open_convictions(self) -> list[ConvictionRecord]:
        return [c for c in self.convictions if c.conviction_id not in self.cleared]

    @property
    def convicted(self) -> bool:
        return bool(self.open_convictions)

    @property
    def status(self) -> str:
        return "convicted" if self.convicted else "cleared" if self.convictions else "clean"

    def pending_appeals(self) -> list[AppealRecord]:
        done = {c.approves for c in self.clearances}
        return [a for a in self.appeals if a.appeal_id not in done]

    def to_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "host": self.host,
            "status": self.status,
            "convictions": [dict(c.raw) for c in self.convictions],
            "open_convictions": [c.conviction_id for c in self.open_convictions],
            "appeals": [dict(a.raw) for a in self.appeals],
            "pending_appeals": [a.appeal_id for a in self.pending_appeals()],
            "clearances": [dict(c.raw) for c in self.clearances],
        }


def _signer(record: Mapping[str, object] | None) -> str | None:
    sig = record.get("sig") if record is not None else None
    key = sig.get("key") if isinstance(sig, Mapping) else None
    return key if isinstance(key, str) else None


def _two_people(clearance: ClearanceRecord, appeal: AppealRecord) -> bool:
    """A clearance counts only by another name and, when either is signed, another key."""
    if clearance.by.strip().lower() == appeal.by.strip().lower():
        return False
    key = _signer(clearance.raw)
    return key is None or key != _signer(appeal.raw)


def fleet_standing(
    convictions: Iterable[ConvictionRecord],
    appeals: Iterable[AppealRecord] = (),
    clearances: Iterable[ClearanceRecord] = (),
) -> dict[str, DeviceStanding]:
    """Every device the records name, with its standing. The records are the ones that count
    (the reader drops unauthenticated appeals and clearances where keys are trusted); a clearance
    takes effect only when it approves an appeal of the same device by another person and key."""
    out: dict[str, DeviceStanding] = {}

    def of(device: str) -> DeviceStanding:
        if device not in out:
            out[device] = DeviceStanding(device=device)
        return out[device]

    for c in sorted(convictions, key=lambda r: r.at):
        st = of(c.device)
        st.convictions.append(c)
        st.host = st.host or str(c.raw.get("host") or "")  # printed only
    by_id: dict[str, AppealRecord] = {}
    for a in sorted(appeals, key=lambda r: r.at):
        of(a.device).appeals.append(a)
        by_id.setdefault(a.appeal_id, a)
    for cl in sorted(clearances, key=lambda r: r.at):
        appeal = by_id.get(cl.approves)
        if appeal is None or appeal.device != cl.device or not _two_people(cl, appeal):
            continue
        st = of(cl.device)
        if any(done.approves == appeal.appeal_id for done in st.clearances):
            continue
        st.clearances.append(cl)
        st.cleared.update(appeal.convictions)
    return out


def check_appeal(standing: DeviceStanding | None, doc: Mapping[str, object]) -> None:
    """An appeal names a convicted device's open convictions and says who and why."""
    if not str(doc.get("by", "")).strip() or not str(doc.get("reason", "")).strip():
        raise FleetError("an appeal needs --by NAME and --reason TEXT")
    if standing is None or not standing.convicted:
        raise FleetError(f"device {doc.get('device')!r} has no open conviction to appeal (see `certckpt fleet ls`)")


def check_clearance(standing: DeviceStanding | None, doc: Mapping[str, object], *, signer: str | None) -> None:
    """A clearance approves a pending appeal of this device, by someone other than the appellant,
    with another key (``signer``: the key that will sign the clearance, if any)."""
    if not str(doc.get("by", "")).strip() or not str(doc.get("reason", "")).strip():
        raise FleetError("a clearance needs --by NAME and --reason TEXT")
    pending = standing.pending_appeals() if standing is not None else []
    appeal = next((a for a in pending if a.appeal_id == doc.get("approves")), None)
    if appeal is None:
        names = ", ".join(a.appeal_id for a in pending) or "none; record one with `certckpt fleet appeal`"
        raise FleetError(f"--approves must name a pending appeal of device {doc.get('device')!r} (pending: {names})")
    if appeal.by.strip().lower() == str(doc["by"]).strip().lower():
        raise FleetError(f"{appeal.appeal_id} was filed by {appeal.by}; someone else must clear the device")
    if signer is not None and signer == _signer(appeal.raw):
        raise FleetError(
            f"{appeal.appeal_id} was signed by key {signer}, the key signing this clearance; "
            "someone else, with their own key, must clear the device"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where one start of a branch ran: per rank, its device and host; ``counts`` when an intact,
    authenticated chain of the run store seals it (only those end another placement's range)."""

    branch: str
    start: int
    devices: Mapping[str, str]
    hosts: Mapping[str, str]
    at: float = 0.0
    counts: bool = True


def placements_of(records: Iterable[tuple[PlacementRecord, bool]]) -> list[Placement]:
    """Placements from a run store's placement records (validated already) and whether each counts."""
    return [
        Placement(
            branch=r.branch,
            start=r.start_step,
            devices=dict(r.devices),
            hosts=dict(r.hosts),
            at=float(r.raw.get("at", 0.0)),  # no rule reads it (its type unchecked, as it always was)
            counts=ok,
        )
        for r, ok in records
    ]


def _ranges(placements: Sequence[Placement]) -> list[tuple[Placement, Range]]:
    """Each placement with the steps it covers. Only a counted placement ends an earlier one: a
    record nobody vouches for can add doubt, never take it away."""
    out: list[tuple[Placement, Range]] = []
    by_branch: dict[str, list[Placement]] = {}
    for p in placements:
        by_branch.setdefault(p.branch, []).append(p)
    for group in by_branch.values():
        starts = sorted({p.start for p in group if p.counts})
        for p in group:
            nxt = next((s for s in starts if s > p.start), None) if p.counts else None
            out.append((p, (p.start, nxt)))
    return out


def convicted_ranges(placements: Sequence[Placement], convicted: Iterable[str]) -> dict[str, list[Range]]:
    """Per branch, the step ranges ``(lo, hi]`` a convicted device computed (hi None: open-ended)."""
    bad = set(convicted)
    out: dict[str, list[Range]] = {}
    for p, rng in _ranges(placements):
        if bad & set(p.devices.values()):
            out.setdefault(p.branch, []).append(rng)
    return out


def conviction_spans(
    placements: Sequence[Placement], convicted: Iterable[str]
) -> list[tuple[Placement, Range, str, str]]:
    """Every ``(placement, steps, rank, device)`` where a convicted device computed a branch's steps."""
    bad = set(convicted)
    return [
        (p, rng, rank, dev)
        for p, rng in _ranges(placements)
        for rank, dev in sorted(p.devices.items(), key=lambda kv: int(kv[0]))
        if dev in bad
    ]


def unaudited_overlap(ranges: Sequence[Range], *, last_clean: int, step: int) -> bool:
    """Whether a checkpoint at ``step``, whose unaudited interval is ``(last_clean, step]``, holds a
    step of one of ``ranges``."""
    return any(max(last_clean, lo) < (step if hi is None else min(step, hi)) for lo, hi in ranges)


def device_steps(
    placements: Sequence[Placement], last_step: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, str]]:
    """Steps each device computed (``last_step``: per branch, the last step its ledger shows), and
    each device's host."""
    steps: dict[str, int] = {}
    hosts: dict[str, str] = {}
    for p, (lo, hi) in _ranges(placements):
        end = last_step.get(p.branch, lo) if hi is None else min(hi, last_step.get(p.branch, hi))
        n = max(0, end - lo)
        for rank, dev in p.devices.items():
            steps[dev] = steps.get(dev, 0) + n
            hosts.setdefault(dev, p.hosts.get(rank, ""))
    return steps, hosts


def host_at(placements: Sequence[Placement], *, branch: str, step: int, rank: str, device: str) -> str | None:
    """The host the placement covering ``step`` of ``branch`` records for ``rank`` running ``device``
    (a detection's host: one device id may have moved between hosts). None when no placement of
    that device covers the step."""
    for p, (lo, hi) in _ranges(placements):
        if p.branch == branch and lo < step and (hi is None or step <= hi) and p.devices.get(rank) == device:
            return p.hosts.get(rank) or None
    return None


def device_host_steps(placements: Sequence[Placement], last_step: Mapping[str, int]) -> dict[tuple[str, str], int]:
    """Steps each (device, host) pair computed: a device id that appears under two hosts has its
    steps on each counted there (``device_steps`` sums them per device)."""
    out: dict[tuple[str, str], int] = {}
    for p, (lo, hi) in _ranges(placements):
        end = last_step.get(p.branch, lo) if hi is None else min(hi, last_step.get(p.branch, hi))
        n = max(0, end - lo)
        for rank, dev in p.devices.items():
            key = (dev, p.hosts.get(rank, ""))
            out[key] = out.get(key, 0) + n
    return out


def rates(
    detections: Mapping[str, int],
    steps: Mapping[str, int],
    hosts: Mapping[str, str],
    *,
    by_host: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Detections per million device-steps, per device and per host, highest rate first (a device
    with detections and no recorded steps has rate None: its runs reported to no registered store).

    Args:
        by_host: per host, ``(detections, device-steps)`` attributed where they happened (a device
            that moved between hosts counts on each for what it did there); default: each device's
            totals under the host ``hosts`` names for it.
    """

    def row(name: str, key: str, n: int, s: int) -> dict[str, Any]:
        return {key: name, "detections": n, "device_steps": s, "per_million": (n * 1e6 / s) if s else None}

    devices = sorted(set(detections) | set(steps))
    per_device = [row(d, "device", detections.get(d, 0), steps.get(d, 0)) for d in devices]
    for r in per_device:
        r["host"] = hosts.get(r["device"], "")
    if by_host is None:
        summed: dict[str, list[int]] = {}
        for r in per_device:
            agg = summed.setdefault(r["host"], [0, 0])
            agg[0] += r["detections"]
            agg[1] += r["device_steps"]
        by_host = {h: (n, s) for h, (n, s) in summed.items()}
    per_host = [row(h, "host", n, s) for h, (n, s) in sorted(by_host.items())]

    def order(r: dict[str, Any]) -> tuple[float, int]:
        # detections without recorded steps first (no rate, all of it unexplained); no steps and no
        # detections last
        rate = r["per_million"]
        known = rate if rate is not None else (float("inf") if r["detections"] else -1.0)
        return (-known, -r["detections"])

    return {"devices": sorted(per_device, key=order), "hosts": sorted(per_host, key=order)}
