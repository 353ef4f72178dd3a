"""A fleet registry: convictions of devices that outlive the run, appeals and clearances, and the run
stores that report to it (``docs/operations.md``, "Convicted devices").

A fleet registry is a ledger at its own URL (any fsspec URL, like a run store), so it is append-only,
chained and signed exactly as a run's ledger is (``docs/signing.md``). Layout under ``<fleet>/_ledger/``::

    genesis.json, chains/<writer>/<seq>.json      the ledger's identity and its writers' chains
    convictions/<conviction_id>.json              {device, host, inventory, evidence: {store, run, branch,
                                                   step, check, incident_id, rank}, at}
    appeals/<appeal_id>.json                      {device, convictions: [ids], by, reason, at}
    clearances/<clearance_id>.json                {device, approves: appeal_id, by, reason, at}
    stores/<sha256(store)[:32]>.json              {store, store_id}: a run store that reports here (its
                                                   absolute URL and the identity of its ledger)

A registry is created once, on purpose (``Fleet.create``, ``certckpt fleet init``): a run or a
conviction never creates one, so a registry deleted or emptied behind a run's back reads as missing
(every start refuses) instead of coming back empty. Each run's placement records pin the registry's
identity (its store id), so a registry re-created at the same URL is visible to every reader of
those runs.

Convictions count signed or not (they only add doubt, as a failed check does); appeals and
clearances count only when a trusted writer's intact chain seals them, where keys are trusted. The
rules are pure (``certckpt.trust.devices``); this module reads and writes. No torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from certckpt.errors import CheckpointNotFoundError, FleetError
from certckpt.format.signing import SigningKey, TrustedKeys, signing_key_from_env, trusted_keys_from_env
from certckpt.format.trustconfig import TrustConfig

from .devices import DeviceStanding, check_appeal, check_clearance, device_of, fleet_standing, host_of, is_device_id
from .incident import incident_id_for
from .ledger import FROM_ENV, Ledger, key_option
from .memory import recall, recall_genesis, recall_view, remember_snapshot, remember_view
from .records import AppealRecord, ClearanceRecord, ConvictionRecord, FleetRecord, parse_record
from .snapshot import FleetRecords

__all__ = ["Fleet", "FleetView", "FLEET_ENV", "absolute_url"]

FLEET_ENV = "CERTCKPT_FLEET"  # a default fleet registry for the `certckpt fleet` commands


@dataclass(kw_only=True, slots=True)
class FleetView:
    """A fleet registry, read at one moment.

    Attributes:
        devices: every device its records name, with its standing.
        stores: the run stores that report here.
        breaks: broken links of its chains (a conviction may be missing: it cannot vouch for anyone).
        invalid: records used for nothing, with the reason (a forged clearance lands here).
        exists: False when there is no registry there (no genesis record: never created, or deleted
            before this reader ever read it).
        store_id: the registry's identity (its genesis record's id).
    """

    url: str
    store_id: str | None = None
    devices: dict[str, DeviceStanding] = field(default_factory=dict)
    stores: list[str] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    invalid: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exists: bool = True

    def convicted(self) -> set[str]:
        return {d for d, st in self.devices.items() if st.convicted}

    def standing(self, device: str) -> DeviceStanding | None:
        return self.devices.get(device)

    def doubt(self) -> str | None:
        """Why this registry cannot vouch for any device (missing, or its chains broken: a conviction
        may be missing); None when it can. Refuses every start, whatever the policy."""
        if not self.exists:
            return (
                f"no fleet registry at {self.url} (never created, or deleted): create it once with "
                f"`certckpt fleet init {self.url}`; a run never creates one"
            )
        if self.breaks:
            return (
                f"fleet registry {self.url} is tampered ({self.breaks[0]}): a conviction may be missing; "
                "restore it from a good copy before starting runs"
            )
        return None

    def start_problem(self, devices: Mapping[str, str]) -> str | None:
        """Why a run on these devices (per rank) must not start (None: it may)."""
        doubt = self.doubt()
        if doubt is not None:
            return doubt
        bad = []
        for rank, dev in sorted(devices.items(), key=lambda kv: int(kv[0])):
            st = self.devices.get(dev)
            if st is not None and st.convicted:
                first = st.open_convictions[0]
                ev = first.evidence
                bad.append(
                    f"rank {rank} runs on device {dev} (host {st.host or '?'}), convicted by "
                    f"{first.conviction_id} ({ev.get('check')} at step {ev.get('step')} of run {ev.get('run')}"
                    f"{', incident ' + str(ev['incident_id']) if ev.get('incident_id') else ''})"
                )
        if not bad:
            return None
        return (
            "; ".join(bad) + f"; see `certckpt fleet show DEVICE --fleet {self.url}`; a device returns only through "
            "`certckpt fleet appeal` and a `certckpt fleet clear` by someone else"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "fleet": self.url,
            "devices": [st.to_dict() for _, st in sorted(self.devices.items())],
            "stores": self.stores,
            "breaks": self.breaks,
            "invalid": [{"record": k, "why": w} for k, w in self.invalid],
            "notes": self.notes,
        }


_VIEW_VERSION = 1
_VIEW_KINDS = (("convictions", "conviction_id"), ("appeals", "appeal_id"), ("clearances", "clearance_id"))


def _view_to_json(view: FleetView, recs: FleetRecords) -> dict[str, object]:
    """What ``Fleet.read`` keeps of a verified read: the records that stood (each with whether a
    trusted writer vouched for it) and what the read said of the registry."""
    return {
        "store_id": view.store_id,
        "stores": view.stores,
        "breaks": view.breaks,
        "invalid": [list(x) for x in view.invalid],
        "notes": view.notes,
        **{kind: [dict(r.raw) for r in getattr(recs, kind)] for kind, _ in _VIEW_KINDS},
    }


def _view_from_json(url: str, doc: Mapping[str, object]) -> FleetView | None:
    """The view a kept read concluded, every record parsed again as a read parses it (None: not
    one this version kept; the registry is read again)."""
    try:
        parsed: dict[str, list[FleetRecord]] = {}
        for kind, id_key in _VIEW_KINDS:
            out = []
            raws = doc[kind]
            if not isinstance(raws, list):
                return None
            for raw in raws:
                if not isinstance(raw, dict):
                    return None
                rec = parse_record(kind, f"{raw[id_key]}.json", raw)
                if not isinstance(rec, FleetRecord):
                    return None
                out.append(replace(rec, authenticated=raw.get("authenticated") is True))
            parsed[kind] = out
        return FleetView(
            url=url,
            store_id=doc["store_id"] if isinstance(doc["store_id"], str) else None,
            devices=fleet_standing(
                [r for r in parsed["convictions"] if isinstance(r, ConvictionRecord)],
                [r for r in parsed["appeals"] if isinstance(r, AppealRecord)],
                [r for r in parsed["clearances"] if isinstance(r, ClearanceRecord)],
            ),
            stores=[str(x) for x in _listed(doc["stores"])],
            breaks=[str(x) for x in _listed(doc["breaks"])],
            invalid=[(str(a), str(b)) for a, b in _listed(doc["invalid"])],
            notes=[str(x) for x in _listed(doc["notes"])],
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _listed(value: object) -> list[Any]:
    """A kept view's list (anything else: the kept view is not one this version wrote)."""
    if not isinstance(value, list):
        raise TypeError("not a list")
    return value


def _store_key(store: str) -> str:
    return hashlib.sha256(store.encode("utf-8")).hexdigest()[:32]


def absolute_url(url: str) -> str:
    """A store's URL as a registry records it: a local path made absolute (a relative one would name
    another store from another directory)."""
    return url.rstrip("/") if "://" in url else os.path.abspath(url)


class Fleet:
    """A fleet registry at ``url`` (a directory or prefix of its own).

    Example:
        >>> fleet = Fleet("s3://ops/fleet")
        >>> fleet.read().convicted()
    """

    def __init__(
        self,
        url: str,
        *,
        signing_key: SigningKey | None | str = FROM_ENV,
        trusted_keys: TrustedKeys | None | str = FROM_ENV,
        trust: TrustConfig | None = None,
    ) -> None:
        """Args:
        url: the registry's path or URL.
        signing_key: signs every record written (default ``$CERTCKPT_SIGNING_KEY``).
        trusted_keys: appeals and clearances count only when one of these keys vouches for them
            (default ``$CERTCKPT_TRUSTED_KEYS``; none: every record counts, see docs/operations.md).
            A writer that signs and is given no trusted keys trusts its own key's public half: a
            training node with a signing key never takes an unsigned clearance at its start check.
        trust: the reader's configuration (its keys stand where ``trusted_keys`` is left at its
            default; its memory directory keeps what this reader verified of the registry).
        """
        key = key_option(signing_key, signing_key_from_env, "signing_key")
        if trusted_keys == FROM_ENV and trust is not None:
            trusted = trust.trusted_keys
        else:
            trusted = key_option(trusted_keys, trusted_keys_from_env, "trusted_keys")
        if trusted is None and key is not None:
            trusted = key.trusted()
        self.ledger = Ledger(absolute_url(url), signing_key=key, trusted_keys=trusted, trust=trust)
        self.url = self.ledger.store

    # --- reading -------------------------------------------------------------------------------

    def read(self) -> FleetView:
        """Every record, checked like a run's ledger (chains, signatures, the heads this reader saw
        before: a registry rolled back to before a conviction is a break).

        What a read proved is kept outside the registry (``memory.remember_view``) under a key of
        the registry's listing (every file's name and change detector), the chain heads this reader
        remembers and the keys it trusts: the next read that finds all three unchanged takes it
        instead of reading and verifying every record again (``certckpt status`` reads each
        registry its run's placements name). Any file added, removed or rewritten, another key, or
        other remembered heads: a full read."""
        base = self.ledger.trust.memory_dir
        listing = self.ledger.listing_stamp()
        if listing is not None:
            cached = recall_view(self.url, self._view_key(listing, base), base=base)
            view = _view_from_json(self.url, cached) if cached is not None else None
            if view is not None:
                return view
        try:
            snap = self.ledger.snapshot(
                remembered=recall(self.url, base=base), remembered_genesis=recall_genesis(self.url, base=base)
            )
        except CheckpointNotFoundError:
            return FleetView(url=self.url, exists=False, notes=["no fleet registry here"])
        remember_snapshot(self.url, snap, base=base)
        if not snap.chained:  # no genesis, no chains: not a registry (a run never makes one)
            return FleetView(url=self.url, exists=False, notes=["no fleet registry here (no genesis record)"])
        recs = snap.fleet
        view = FleetView(
            url=self.url,
            store_id=snap.store_id,
            devices=fleet_standing(recs.convictions, recs.appeals, recs.clearances),
            stores=sorted({r.store for r in recs.stores}),
            breaks=[f"writer {b.writer} entry {b.seq}: {b.why}" for b in snap.breaks],
            invalid=list(snap.invalid),
            notes=list(snap.notes),
        )
        if listing is not None:  # the listing taken before the read: a write since changes it
            remember_view(self.url, self._view_key(listing, base), _view_to_json(view, recs), base=base)
        return view

    def _view_key(self, listing: str, base: str) -> str:
        keys = sorted(self.ledger.trusted_keys.keys) if self.ledger.trusted_keys is not None else []
        doc = {
            "version": _VIEW_VERSION,
            "listing": listing,
            "heads": sorted(recall(self.url, base=base).items()),
            "genesis": recall_genesis(self.url, base=base),
            "keys": keys,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=list).encode()).hexdigest()

    # --- writing -------------------------------------------------------------------------------

    def create(self) -> str:
        """Create the registry (its genesis record) unless it exists; returns its store id.

        Raises:
            FleetError: trusted keys are configured but no signing key: readers with those keys would
                take the unsigned genesis for a re-created registry and refuse every start.
        """
        keyless = self.ledger.trusted_keys is not None and self.ledger.signing_key is None
        if keyless and self.ledger.genesis_bytes() is None:
            raise FleetError(
                f"{self.url}: not created: trusted keys are configured but no signing key; readers would take an "
                "unsigned registry for a re-created one. Set CERTCKPT_SIGNING_KEY and run it again"
            )
        self.ledger.create()
        store_id = self.ledger.store_id
        assert store_id is not None  # create() wrote or read a genesis record
        return store_id

    def _existing(self) -> Ledger:
        """The registry's ledger, refusing to write where there is no registry: writing would create
        an empty one, which would read as "no convictions"."""
        if self.ledger.genesis_bytes() is None:
            raise FleetError(
                f"no fleet registry at {self.url} (never created, or deleted); create it once with "
                f"`certckpt fleet init {self.url}`, or restore it from a good copy"
            )
        return self.ledger

    def register_store(self, store: str, *, store_id: str | None = None) -> bool:
        """Record that ``store`` (its absolute URL and, for a chained store, its ledger's identity)
        reports here (idempotent); returns whether it was new."""
        url = absolute_url(store)
        ledger = self._existing()
        name = f"{_store_key(url)}.json"
        if name in ledger.list_raw("stores"):
            return False
        doc: dict[str, object] = {"store": url}
        if store_id is not None:
            doc["store_id"] = store_id
        return ledger.write_record("stores", name, doc)

    def convict(self, *, device: str, inventory: Mapping[str, object], evidence: Mapping[str, object]) -> str:
        """Record a conviction of ``device``; returns its id."""
        if not is_device_id(device):
            raise FleetError(f"device {device!r} is not a device id (letters, digits and ._:@/+-)")
        cid = f"conv-{time.time_ns():020d}-{secrets.token_hex(3)}"
        doc = {
            "conviction_id": cid,
            "device": device,
            "host": host_of(inventory),
            "inventory": dict(inventory),
            "evidence": dict(evidence),
            "at": time.time(),
        }
        self._existing().write_record("convictions", f"{cid}.json", doc)
        return cid

    def report_detection(self, event: Mapping[str, Any], *, store: str | None) -> list[str]:
        """Convict the device of every rank an uncontained failed check blames (rank 0 of a run with
        a fleet calls it); returns the conviction ids. Ranks without a usable identity are skipped."""
        inventory = event.get("inventory") or {}
        out = []
        for rank in event.get("suspect_ranks") or []:
            inv = inventory.get(str(rank)) or {}
            device = device_of(inv)
            if not device:
                continue
            evidence = {
                "store": absolute_url(store) if store else store,  # read from any directory
                "run": event.get("run"),
                "branch": event.get("branch"),
                "step": event.get("step"),
                "check": event.get("kind"),
                "rank": rank,
                "incident_id": incident_id_for(event),
            }
            out.append(self.convict(device=device, inventory=inv, evidence=evidence))
        return out

    def appeal(self, device: str, *, by: str, reason: str) -> dict[str, object]:
        """File an appeal of ``device``'s open convictions; it takes effect when someone else clears it."""
        view = self.read()
        st = view.standing(device)
        doc: dict[str, object] = {"device": device, "by": by, "reason": reason}
        check_appeal(st, doc)
        assert st is not None  # check_appeal refuses a device without convictions
        doc["appeal_id"] = aid = f"appeal-{time.time_ns():020d}-{secrets.token_hex(3)}"
        doc["convictions"] = [c.conviction_id for c in st.open_convictions]
        doc["at"] = time.time()
        self._existing().write_record("appeals", f"{aid}.json", doc)
        return doc

    def clear(self, device: str, *, approves: str, by: str, reason: str) -> dict[str, object]:
        """Approve an appeal: the convictions it names are set aside (runs on the device start again,
        the checkpoints it made suspect are judged without them)."""
        view = self.read()
        doc: dict[str, object] = {"device": device, "approves": approves, "by": by, "reason": reason}
        signer = self.ledger.signing_key.key_id if self.ledger.signing_key is not None else None
        check_clearance(view.standing(device), doc, signer=signer)
        doc["clearance_id"] = cid = f"clear-{time.time_ns():020d}-{secrets.token_hex(3)}"
        doc["at"] = time.time()
        self._existing().write_record("clearances", f"{cid}.json", doc)
        return doc
