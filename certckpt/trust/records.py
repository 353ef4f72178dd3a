"""Ledger records as types: every kind a store holds, checked like user input and parsed once.

``parse_record`` is the one edge between a store's JSON and the trust layer: a record that passes
becomes a typed, frozen record (``CommitRecord``, ``HoldingRecord``, ``ConvictionRecord``...) whose
attributes are the fields a rule reads; one that fails becomes the reason it cannot be used, and the
reader reports it (``LedgerSnapshot.invalid``), exactly as a malformed record always was. Event
kinds and outcomes are ``StrEnum`` members (on Python 3.10, a ``str`` enum that behaves the same), so
they compare equal to the strings already stored (and to those ``detect`` still writes). No I/O, no
torch.

Why frozen dataclasses with slots, not msgspec Structs: the rules here refuse hostile input with
messages the operator and the tests read (``names main@5 but is stored as x.json``), checks that no
schema library expresses (an id that matches its file name, a holding's name derived from its id);
the record must keep the JSON object as stored, because a signature covers it and a vault copies it;
and certckpt takes no dependency the trust layer would then need everywhere. The fields a rule
reads are parsed once, here; what no rule reads stays in ``raw``.

A record also reads as a ``Mapping`` of its stored fields (``rec["url"]``, ``rec.get("run")``): a
transition for the callers outside ``certckpt.trust`` that still index records. Code in
``certckpt.trust`` uses the attributes.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # certckpt supports 3.10, which has no StrEnum: the same behaviour (str() and format() give the value)
    from enum import Enum

    class StrEnum(str, Enum):
        __str__ = str.__str__


__all__ = [
    "FLEET_KINDS",
    "KINDS",
    "AppealRecord",
    "BranchRecord",
    "CertificateRecord",
    "CommitRecord",
    "ConvictionRecord",
    "ClearanceRecord",
    "DrillRecord",
    "EventKind",
    "HoldingRecord",
    "IncidentRecord",
    "KeptRecord",
    "Outcome",
    "PlacementRecord",
    "Record",
    "RetiredRecord",
    "RevocationRecord",
    "StoreRecord",
    "check_family",
    "is_ckpt_id",
    "is_device_id",
    "is_plain_name",
    "parse_record",
    "why_invalid",
]


class EventKind(StrEnum):
    """What an audit event checked (``detect`` writes these; a store may hold any other string)."""

    NONFINITE = "nonfinite"  # an audit's summary of the per-step non-finite checks since the last one
    NONFINITE_PRE = "nonfinite-pre"  # a local gradient was not finite (before the all-reduce)
    NONFINITE_POST = "nonfinite-post"  # the all-reduced gradient was not finite
    REPLAY = "replay"
    CONSENSUS = "consensus"
    OVERFLOW = "overflow"  # a gradient scaler's overflow, confirmed: no audit, changes no verdict
    # a clean replay the sentinels triggered between audits: it proves its own step's computation
    # only (not the weights it started from, nor the steps since the last audit), so no audit
    TRIGGERED_REPLAY = "triggered-replay"


class Outcome(StrEnum):
    """An audit event's outcome."""

    PASS = "pass"
    FAIL = "fail"


_FAMILY: dict[str, str] = {EventKind.NONFINITE_PRE: EventKind.NONFINITE, EventKind.NONFINITE_POST: EventKind.NONFINITE}


def check_family(kind: str) -> str:
    """The check an event's kind belongs to: ``nonfinite-pre`` and ``nonfinite-post`` are failures of
    the non-finite check (``nonfinite``); every other kind is its own. The one place they fold
    (``facts`` builds its per-kind bits from it, ``coverage`` reads events through it)."""
    return _FAMILY.get(kind, kind)


# A fleet registry's records (``certckpt.trust.fleet``): a Ledger at its own URL holds these.
FLEET_KINDS = ("convictions", "appeals", "clearances", "stores")
KINDS = (
    "checkpoints",
    "branches",
    "events",
    "revocations",
    "certificates",
    "holdings",
    "retired",
    "kept",
    "drills",
    "incidents",
    "placements",
    *FLEET_KINDS,
)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_HELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,240}\.safetensors$")  # a plain file name
_HELD_NAME_ANY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._@=-]{0,240}$")  # a plain file name, any suffix
_CKPT_ID = re.compile(r"^([A-Za-z0-9._-]{1,100})@([0-9]{1,18})$")
_STORE_ID = re.compile(r"[0-9a-f]{32}")
_DEVICE = re.compile(r"^[A-Za-z0-9._:@/+-]{1,200}$")


def is_plain_name(name: str) -> bool:
    return bool(_NAME.match(name)) and name not in (".", "..")


def is_ckpt_id(value: object) -> bool:
    """Whether ``value`` is a checkpoint id (``branch@step``) safe to use in a name or a path."""
    m = _CKPT_ID.match(value) if isinstance(value, str) else None
    return m is not None and m.group(1) not in (".", "..")


def is_device_id(value: object) -> bool:
    """Whether ``value`` can name a device (it is stored, printed and compared, never a path)."""
    return isinstance(value, str) and bool(_DEVICE.match(value)) and ".." not in value


# --- the records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Record(Mapping[str, Any]):
    """A record that passed its checks.

    Attributes:
        raw: the JSON object as stored (what a signature covers, what a vault copies, and the
            fields no rule reads). Also read through the ``Mapping`` view.
    """

    raw: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def sealing_branch(self) -> str | None:
        """The branch whose chain must seal this record, as it names it (None: the store's chain)."""
        branch = self.raw.get("branch")
        return branch if isinstance(branch, str) else None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CommitRecord(Record):
    """``checkpoints/<ckpt_id>.json``: the commit record that makes a published checkpoint exist."""

    ckpt_id: str
    branch: str  # as its id spells it (the id is ``f"{branch}@{step}"``)
    step: int
    url: str  # relative to the store (or a vault's source run), or absolute
    parent: str | None
    consensus_fp: str | None
    state_fp: str | None
    header_digest: str | None
    run: str | None
    committed_at: float


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HoldingRecord(Record):
    """``holdings/<ckpt_id>.json`` (vaults): the copy a vault holds, under its plain name."""

    ckpt_id: str
    url: str
    branch: str
    step: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RetiredRecord(Record):
    """``retired/<ckpt_id>.json``: a retention policy deleted this checkpoint's file."""

    ckpt_id: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class KeptRecord(Record):
    """``kept/<ckpt_id>.json``: a rotation moved this checkpoint's file to ``url`` (a plain name)."""

    ckpt_id: str
    url: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BranchRecord(Record):
    """``branches/<branch>.json``: a branch resumed from checkpoint ``parent`` (a rollback)."""

    branch: str
    parent: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RevocationRecord(Record):
    """``revocations/<ckpt_id>--<ns>.json``: an operator revoked a checkpoint."""

    ckpt_id: str
    reason: str
    by: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CertificateRecord(Record):
    """``certificates/<ckpt_id>--<ns>.json``: a verdict the certifier reached (a cache, not evidence)."""

    ckpt_id: str
    verdict: str
    reasons: tuple[object, ...]
    at: float


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DrillRecord(Record):
    """``drills/<name>.json``: a restore drill (``drill_id``: its file's name, without ``.json``)."""

    drill_id: str
    ckpt_id: str
    step: int | None
    outcome: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class IncidentRecord(Record):
    """``incidents/<incident_id>--<ns>-<what>.json``: an incident's opening, or a decision on it."""

    incident_id: str

    @property
    def is_opening(self) -> bool:
        return self.raw.get("record") == "opened"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PlacementRecord(Record):
    """``placements/<branch>--<ns>-<hex>.json``: per rank, the device a start of a branch ran on."""

    branch: str
    start_step: int
    devices: Mapping[str, str]  # rank (decimal) -> device id
    hosts: Mapping[str, str]  # rank -> host
    fleet: str | None  # the fleet registry it was placed under
    fleet_id: str | None  # that registry's store id


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class FleetRecord(Record):
    """A fleet registry's record; ``authenticated``: a trusted writer vouches for it (set by the
    reader, and in ``raw`` as ``"authenticated"``)."""

    authenticated: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ConvictionRecord(FleetRecord):
    """``convictions/<id>.json``: a detection that named a device."""

    conviction_id: str
    device: str
    at: float
    evidence: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class AppealRecord(FleetRecord):
    """``appeals/<id>.json``: a proposal to set a device's convictions aside."""

    appeal_id: str
    device: str
    at: float
    convictions: tuple[str, ...]
    by: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ClearanceRecord(FleetRecord):
    """``clearances/<id>.json``: the approval of an appeal, by someone else."""

    clearance_id: str
    device: str
    at: float
    approves: str
    by: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StoreRecord(FleetRecord):
    """``stores/<key>.json``: a run store that reports to the registry."""

    store: str
    store_id: str | None


# --- parsing: one check per kind, each returning the typed record or why it cannot be used -----------

_Raw = dict[str, Any]  # a JSON object as json.loads made it: every value untrusted until checked


def parse_record(kind: str, file: str, r: object) -> Record | str:
    """The typed record of one stored JSON value, or why it cannot be used. Checked like user input:
    a record that fails is evidence of nothing, and never reaches a path, a verdict or a traceback."""
    if not isinstance(r, dict):
        return f"not a JSON object ({type(r).__name__})"
    if kind in _NAMED_BY_ID:
        why = _id_problem(kind, file, r)
        if why is not None:
            return why
    if kind in FLEET_KINDS:
        return _FLEET_PARSERS[kind](r, file)
    parse = _PARSERS.get(kind)
    return parse(r, file) if parse is not None else Record(raw=r)


def why_invalid(kind: str, file: str, r: object) -> str | None:
    """Why a record read from the store cannot be used (None when it can): ``parse_record``'s verdict."""
    got = parse_record(kind, file, r)
    return got if isinstance(got, str) else None


# Records named by the checkpoint they are about; the first four are stored as `<ckpt_id>.json`.
_NAMED_BY_ID = ("checkpoints", "holdings", "retired", "kept", "revocations", "certificates")
_STORED_BY_ID = ("checkpoints", "holdings", "retired", "kept")


def _id_problem(kind: str, file: str, r: _Raw) -> str | None:
    cid = r.get("ckpt_id")
    if not is_ckpt_id(cid):
        return f"checkpoint id {str(cid)[:80]!r} is not branch@step"
    if kind in _STORED_BY_ID and file != f"{cid}.json":
        return f"names {cid} but is stored as {file}"
    return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _opt_str(r: _Raw, key: str) -> str | None:
    value = r.get(key)
    return value if isinstance(value, str) else None


def _kept(r: _Raw, file: str) -> KeptRecord | str:
    # where a rotation moved a checkpoint's file to keep it: a plain name in the store itself (the
    # file there must still match the committed header digest; a move can only lose it, not forge it)
    url = r.get("url")
    if not isinstance(url, str) or not _HELD_NAME_ANY.match(url):
        return f"keeps its file at {str(url)[:80]!r}, not a plain file name in the store"
    return KeptRecord(raw=r, ckpt_id=r["ckpt_id"], url=url)


def _checkpoint(r: _Raw, file: str) -> CommitRecord | str:
    cid: str = r["ckpt_id"]
    step = r.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or f"{r.get('branch')}@{step}" != cid:
        return f"branch and step ({r.get('branch')!r}, {step!r}) do not make its id {cid}"
    url = r.get("url")
    if not isinstance(url, str) or not url or "\0" in url:
        return "has no file location"
    if "://" not in url and not url.startswith("/") and ".." in url.split("/"):
        return f"names its file {url[:80]!r}, a path that climbs out of the store"
    for key in ("consensus_fp", "state_fp", "header_digest", "parent", "run"):
        if r.get(key) is not None and not isinstance(r[key], str):
            return f"its {key} is not a string"
    parent = _opt_str(r, "parent")
    if parent is not None and not is_ckpt_id(parent):
        return f"its parent {parent[:80]!r} is not branch@step"
    committed_at = r.get("committed_at", 0.0)
    if not _number(committed_at):
        return "its commit time is not a number"
    try:
        when = float(committed_at)
    except OverflowError:  # an integer no float holds (10**400): parsed here, so refused here, never a traceback
        return "its commit time is not a number"
    return CommitRecord(
        raw=r,
        ckpt_id=cid,
        branch=cid.rpartition("@")[0],
        step=step,
        url=url,
        parent=parent,
        consensus_fp=_opt_str(r, "consensus_fp"),
        state_fp=_opt_str(r, "state_fp"),
        header_digest=_opt_str(r, "header_digest"),
        run=_opt_str(r, "run"),
        committed_at=when,
    )


def _holding(r: _Raw, file: str) -> HoldingRecord | str:
    # A vault holds each copy under its plain name, in the vault itself: a file `<id>.safetensors`,
    # a sharded checkpoint's directory `<id>`, or a file with companions as `<id>/NAME.safetensors`
    # (its companions beside it): never a path that leaves `<id>/`.
    url, cid = r.get("url"), r["ckpt_id"]
    if not (
        url in (f"{cid}.safetensors", cid)
        or (isinstance(url, str) and url.startswith(f"{cid}/") and _HELD_NAME.match(url[len(cid) + 1 :]))
    ):
        return f"holds its copy at {str(url)[:80]!r}, not {cid}.safetensors, {cid} or {cid}/NAME.safetensors"
    step, branch = r.get("step"), r.get("branch")
    if not isinstance(step, int) or not isinstance(branch, str):
        return "has no branch and step"
    return HoldingRecord(raw=r, ckpt_id=cid, url=str(url), branch=branch, step=step)


def _branch(r: _Raw, file: str) -> BranchRecord | str:
    branch, parent = r.get("branch"), r.get("parent")
    if not isinstance(branch, str) or not _NAME.match(branch) or not is_ckpt_id(parent):
        return "branch or parent is not a valid name"
    return BranchRecord(raw=r, branch=branch, parent=str(parent))


def _incident(r: _Raw, file: str) -> IncidentRecord | str:
    iid = r.get("incident_id")
    if not isinstance(iid, str) or not _NAME.match(iid):
        return f"incident id {str(iid)[:80]!r} is not a plain name"
    return IncidentRecord(raw=r, incident_id=iid)


def _revocation(r: _Raw, file: str) -> RevocationRecord | str:
    reason, at = r.get("reason"), r.get("at")
    if not isinstance(reason, str):
        return "has no reason"
    return RevocationRecord(
        raw=r,
        ckpt_id=r["ckpt_id"],
        reason=reason,
        by=str(r.get("by", "")),
        at=at if isinstance(at, (int, float)) else 0.0,
    )


def _certificate(r: _Raw, file: str) -> CertificateRecord | str:
    at, verdict, reasons = r.get("at"), r.get("verdict"), r.get("reasons")
    if not isinstance(at, (int, float)) or not isinstance(verdict, str) or not isinstance(reasons, list):
        return "has no time, verdict or reasons"
    return CertificateRecord(raw=r, ckpt_id=r["ckpt_id"], verdict=verdict, reasons=tuple(reasons), at=at)


def _drill(r: _Raw, file: str) -> DrillRecord | str:
    # the timeline and the report place a drill by these: a hostile value must not reach them
    cid = r.get("ckpt_id")
    if not isinstance(cid, str) or not is_ckpt_id(cid):
        return f"checkpoint id {str(cid)[:80]!r} is not branch@step"
    step = r.get("step")
    if step is not None and (type(step) is not int or step < 0):
        return "step is not a non-negative int"
    outcome = r.get("outcome", "")
    if not isinstance(outcome, str):
        return "outcome is not text"
    drill_id = file.removesuffix(".json")
    return DrillRecord(raw=r, drill_id=drill_id, ckpt_id=cid, step=step, outcome=outcome)


def _location_problem(value: object, what: str) -> str | None:
    if not isinstance(value, str) or not value or len(value) > 1000 or "\0" in value:
        return f"its {what} is not a path or URL"
    return None


def _placement(r: _Raw, file: str) -> PlacementRecord | str:
    branch, start, devices, hosts = r.get("branch"), r.get("start_step"), r.get("devices"), r.get("hosts", {})
    if not isinstance(branch, str) or not _NAME.match(branch):
        return "branch is not a valid name"
    if type(start) is not int or start < 0:
        return "start_step is not a non-negative int"
    if not isinstance(devices, dict) or not devices or len(devices) > 1 << 20:
        return "names no devices"
    if not all(isinstance(k, str) and k.isdigit() and is_device_id(v) for k, v in devices.items()):
        return "a rank or a device id is not well formed"
    if not isinstance(hosts, dict) or not all(isinstance(v, str) and len(v) <= 200 for v in hosts.values()):
        return "hosts are not names"
    fid = r.get("fleet_id")
    if fid is not None and not (isinstance(fid, str) and _STORE_ID.fullmatch(fid)):
        return "fleet_id is not a store id"
    fleet = r.get("fleet")
    why = None if fleet is None else _location_problem(fleet, "fleet")
    if why is not None:
        return why
    return PlacementRecord(
        raw=r,
        branch=branch,
        start_step=start,
        devices=devices,
        hosts=hosts or {},
        fleet=_opt_str(r, "fleet"),
        fleet_id=_opt_str(r, "fleet_id"),
    )


def _fleet_id_problem(r: _Raw, key: str, file: str) -> str | None:
    rid = r.get(key)
    if not isinstance(rid, str) or not _NAME.match(rid) or file != f"{rid}.json":
        return f"{key} {str(rid)[:80]!r} is not a plain name matching its file {file}"
    if not is_device_id(r.get("device")):
        return f"device {str(r.get('device'))[:80]!r} is not a device id"
    if not _number(r.get("at", 0.0)):
        return "its time is not a number"
    return None


def _decision_problem(r: _Raw) -> str | None:
    if not isinstance(r.get("by"), str) or not isinstance(r.get("reason"), str):
        return "has no by or reason"
    return None


def _store(r: _Raw, file: str) -> StoreRecord | str:
    sid = r.get("store_id")
    if sid is not None and not (isinstance(sid, str) and _STORE_ID.fullmatch(sid)):
        return "store_id is not a store id"
    store = r.get("store")
    why = _location_problem(store, "store")
    return why if why is not None else StoreRecord(raw=r, store=str(store), store_id=_opt_str(r, "store_id"))


def _conviction(r: _Raw, file: str) -> ConvictionRecord | str:
    why = _fleet_id_problem(r, "conviction_id", file)
    evidence = r.get("evidence")
    if why is not None or not isinstance(evidence, dict):
        return why or "has no evidence"
    return ConvictionRecord(
        raw=r, conviction_id=r["conviction_id"], device=r["device"], at=r.get("at", 0.0), evidence=evidence
    )


def _appeal(r: _Raw, file: str) -> AppealRecord | str:
    why = _fleet_id_problem(r, "appeal_id", file)
    if why is not None:
        return why
    ids = r.get("convictions")
    if not isinstance(ids, list) or not all(isinstance(i, str) and _NAME.match(i) for i in ids):
        return "its convictions are not a list of conviction ids"
    why = _decision_problem(r)
    if why is not None:
        return why
    return AppealRecord(
        raw=r,
        appeal_id=r["appeal_id"],
        device=r["device"],
        at=r.get("at", 0.0),
        convictions=tuple(ids),
        by=r["by"],
        reason=r["reason"],
    )


def _clearance(r: _Raw, file: str) -> ClearanceRecord | str:
    why = _fleet_id_problem(r, "clearance_id", file)
    if why is not None:
        return why
    approves = r.get("approves")
    if not isinstance(approves, str) or not _NAME.match(approves):
        return "approves no appeal id"
    why = _decision_problem(r)
    if why is not None:
        return why
    return ClearanceRecord(
        raw=r,
        clearance_id=r["clearance_id"],
        device=r["device"],
        at=r.get("at", 0.0),
        approves=approves,
        by=r["by"],
        reason=r["reason"],
    )


def _retired(r: _Raw, file: str) -> RetiredRecord:
    return RetiredRecord(raw=r, ckpt_id=r["ckpt_id"])


# What each kind must hold beyond its id, and the record it makes.
_PARSERS: dict[str, Callable[[_Raw, str], Record | str]] = {
    "kept": _kept,
    "checkpoints": _checkpoint,
    "holdings": _holding,
    "retired": _retired,
    "branches": _branch,
    "incidents": _incident,
    "revocations": _revocation,
    "certificates": _certificate,
    "drills": _drill,
    "placements": _placement,
}
_FLEET_PARSERS: dict[str, Callable[[_Raw, str], Record | str]] = {
    "convictions": _conviction,
    "appeals": _appeal,
    "clearances": _clearance,
    "stores": _store,
}
