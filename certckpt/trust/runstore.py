"""The trust layer's effects: read a run store's ledger, check its files, certify it, and write what
follows (certificates of verdict changes, incident records). Behind ``certckpt status``,
``latest-good`` and ``incident``. The decisions themselves are pure (``certify``, ``incident``).
No torch import.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from certckpt.errors import CertckptError, CheckpointExistsError, CheckpointNotFoundError, StorageError
from certckpt.format.signing import TrustedKeys
from certckpt.format.trustconfig import TrustConfig

from .certify import Certification, CheckpointEntry, Level, accept_level, certify
from .devices import DeviceStanding, Placement, convicted_ranges, conviction_spans, placements_of
from .facts import EventProblem, read_event
from .fleet import Fleet, FleetView
from .incident import (
    OPENED_SUFFIX,
    Incident,
    build_opening,
    check_decision,
    incident_id_for,
    incident_state,
)
from .ledger import Ledger, LedgerSnapshot, is_ckpt_id
from .memory import (
    recall,
    recall_chains,
    recall_facts,
    recall_genesis,
    remember_chains,
    remember_facts,
    remember_snapshot,
)
from .records import HoldingRecord, KeptRecord, Outcome

if TYPE_CHECKING:  # for annotations only (imported where they run: see check_file, StoreStatus.coverage)
    from certckpt.format.manifestdir import ManifestDirReport
    from certckpt.format.record import CheckpointRecord
    from certckpt.format.sharded.check import ShardedReport
    from certckpt.format.verify import VerifyReport

    from .coverage import Coverage

__all__ = [
    "StoreStatus",
    "certify_snapshot",
    "certify_store",
    "convicted_ranges_for",
    "find_latest_good",
    "latest_intact_directory",
    "committed_directory",
    "committed_into",
    "taken_problem",
    "snapshot_or_empty",
    "check_file",
    "open_incident",
    "open_missing_incidents",
    "list_incidents",
    "get_incident",
    "decide",
]


@dataclass(kw_only=True, slots=True)
class StoreStatus:
    """A run store, certified.

    Attributes:
        store: its URL or path.
        snapshot: the ledger's records.
        certification: verdicts, detections, latest-good order.
        problems: per checkpoint id, why its bytes did not verify (those checked).
        uncommitted: checkpoint files without a commit record.
        fallbacks: trusted checkpoints skipped by latest-good because their bytes failed now.
        unavailable: trusted checkpoints skipped by latest-good because this store no longer holds
            their file (pruned by retention; in a vault, known only as lineage).
    """

    store: str
    snapshot: LedgerSnapshot
    certification: Certification
    problems: dict[str, str] = field(default_factory=dict)
    uncommitted: list[str] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)

    @property
    def latest_good(self) -> str | None:
        """The newest trusted checkpoint this store still holds (bytes not re-verified)."""
        return next(
            (c for c in self.certification.order if self.snapshot.available(c) and c not in self.problems), None
        )

    def entry(self, ckpt_id: str) -> CheckpointEntry:
        return next(c for c in self.snapshot.checkpoints if c.ckpt_id == ckpt_id)

    def coverage(self) -> dict[str, Coverage]:
        """Every checkpoint's audit coverage, from the events that count (``trust.coverage``)."""
        from .coverage import coverage  # only `status --coverage` and the report ask: latest-good stays light

        snap = self.snapshot
        return coverage(snap.checkpoints, snap.events, branch_parents=snap.branch_parents)

    def suspect_intervals(self) -> list[dict[str, object]]:
        return [
            {
                "branch": d.branch,
                "from": d.interval[0],
                "to": d.interval[1],
                "detected_step": d.step,
                "kind": d.kind,
                "suspect_ranks": list(d.suspect_ranks),
                "rollback_window": d.rollback_window,
            }
            for d in self.certification.detections
            if d.interval is not None
        ]


def check_file(
    url: str,
    header_digest: str | None,
    *,
    progress: Callable[[int, int], None] | None = None,
    committed: Mapping[str, object] | None = None,
    trusted_keys: TrustedKeys | None = None,
) -> str | None:
    """Verify a committed checkpoint's bytes, and that it is the very file that was committed.

    Args:
        committed: the commit record; the file's own embedded record must agree with it (run,
            branch, step, state and consensus fingerprints): a record edited or added in the
            store to point at another file is caught here.
        trusted_keys: the file must also be signed by one of these keys (its header and its data
            digest: BLAKE3, or SHA-256 in older files): with keys configured, unkeyed digests are
            never the last word.

    Returns:
        None when it verifies, else one line saying what is wrong.
    """
    # The byte checks are imported where they run: `latest-good --no-verify`, `status` and every
    # certify that reads only the ledger never load the file format's verifier (bench_startup.py).
    from certckpt.format.companions import companion_problems
    from certckpt.format.sharded.check import ShardedReport, verify_checkpoint
    from certckpt.format.sharded.layout import is_directory
    from certckpt.format.verify import verify

    report: ShardedReport | VerifyReport
    record: CheckpointRecord | None
    try:
        # a sharded checkpoint (a directory): its manifest, every shard file, nothing extra
        if not url.endswith(".safetensors") and is_directory(url):
            report = verify_checkpoint(url, progress=progress, trusted_keys=trusted_keys)
            record = report.record
        else:
            report = verify(url, progress=progress, trusted_keys=trusted_keys)
            record = report.info.record if report.info is not None else None
    except CertckptError as e:
        return str(e)
    if not report.ok or record is None:
        return report.problems[0].message if report.problems else f"{url}: unreadable"
    if not isinstance(report, ShardedReport):  # one committed file may certify its whole directory
        companions = companion_problems(url, record, trusted_keys=trusted_keys)
        if companions:
            return companions[0]
    if header_digest and record.header_digest != header_digest:
        return (
            f"{url}: not the file that was committed (header digest {record.header_digest}, committed {header_digest})"
        )
    return _disagreement(url, record, committed) if committed is not None else None


def _disagreement(url: str, embedded: CheckpointRecord, committed: Mapping[str, object]) -> str | None:
    """Where the file's embedded record and its commit record disagree (None when they agree)."""
    for key in ("run", "branch", "step", "state_fp", "consensus_fp"):
        want, have = committed.get(key), getattr(embedded, key, None)
        if want is None:
            continue
        if have != want and (have is not None or key == "step"):
            return f"{url}: the file's own record says {key} {have!r}, its commit record {want!r}; not this checkpoint"
    return None


def _check(status_or_snap: StoreStatus | LedgerSnapshot, cid: str) -> str | None:
    snap = status_or_snap.snapshot if isinstance(status_or_snap, StoreStatus) else status_or_snap
    entry = next(c for c in snap.checkpoints if c.ckpt_id == cid)
    shared = _shared_files(snap).get(cid)
    if shared:
        return shared
    held: HoldingRecord | KeptRecord | None = snap.parsed.holdings.get(cid)
    held = held if held is not None else snap.parsed.kept.get(cid)
    rel = held.url if held is not None else snap.parsed.commits[cid].url
    leaves = _link_leaving_store(entry.url, rel)
    if leaves:
        return leaves
    commit = snap.parsed.commits[cid]
    return check_file(entry.url, commit.header_digest, committed=commit.raw, trusted_keys=snap.trusted_keys)


def _link_leaving_store(url: str, rel: str) -> str | None:
    """A checkpoint a record places inside the store (a relative name) whose path resolves outside it:
    a symbolic link an attacker planted to make the store vouch for a file it does not hold."""
    if "://" in url or rel.startswith("/") or "://" in rel or not url.endswith(rel):
        return None  # an object store has no links; an absolute location is where the record says
    base = url[: len(url) - len(rel)] or "."
    root, real = os.path.realpath(base), os.path.realpath(url)
    if os.path.commonpath([root, real]) != root:
        return f"{url}: a link that leaves the store (to {real}); refused unopened (damaged or hostile store)"
    return None


def _shared_files(snap: LedgerSnapshot) -> dict[str, str]:
    """Commit records that name a file another record names too: one file is one checkpoint, so
    neither can be trusted (one of them was written by someone other than the training job)."""
    by_url: dict[str, list[str]] = {}
    for c in snap.checkpoints:
        if snap.available(c.ckpt_id):
            by_url.setdefault(c.url, []).append(c.ckpt_id)
    return {
        cid: f"{url}: named by {len(ids)} commit records ({', '.join(sorted(ids))}); one file is one checkpoint"
        for url, ids in by_url.items()
        if len(ids) > 1
        for cid in ids
    }


def convicted_ranges_for(
    snap: LedgerSnapshot,
    *,
    extra: Iterable[str] = (),
    exclude: Iterable[str] = (),
    authenticated_only: bool = False,
    views: dict[str, FleetView] | None = None,
) -> dict[str, list[tuple[int, int | None]]]:
    """Per branch, the step ranges that devices convicted in the run's fleet registries computed.

    The registries are those the run's placement records name (with trusted keys, only placements a
    trusted writer vouches for name one: a forged record must not send the reader anywhere).

    Args:
        extra: devices to count as convicted too (``certckpt fleet impact``: before it happens).
        exclude: devices to leave out (``certckpt fleet impact`` of a device convicted already: what
            its convictions changed is the difference with and without them).
        authenticated_only: count only convictions a trusted writer vouches for (a prune).
        views: registries read already, by URL (read here otherwise, and kept there).
    """
    if not snap.placements:
        return {}
    convicted = set(extra)
    standing: dict[str, tuple[str, DeviceStanding]] = {}  # convicted device -> (its registry, its standing)
    views = {} if views is None else views
    for url in sorted({r.fleet for r, ok in snap.placements if ok and r.fleet is not None}):
        if url not in views:
            trust = snap.trust or TrustConfig(trusted_keys=snap.trusted_keys)
            views[url] = Fleet(url, signing_key=None, trust=replace(trust, trusted_keys=snap.trusted_keys)).read()
        view = views[url]
        # The run registered its store there before training: a registry that is gone, lists no
        # store, was re-created, or whose chains are broken may have lost a conviction, so nothing it
        # says clears a step.
        if not view.exists:
            _fleet_unproven(snap, url, "is missing")
            continue
        pinned = {r.fleet_id for r, ok in snap.placements if ok and r.fleet == url} - {None}
        if pinned - {view.store_id}:
            _fleet_unproven(snap, url, f"is not the registry this run was placed under (re-created: {view.store_id})")
            continue
        if view.breaks:
            _fleet_unproven(snap, url, f"is tampered ({view.breaks[0]}): a conviction may be missing")
        elif not view.stores:
            _fleet_unproven(snap, url, "holds no registered store (emptied?)")
            continue
        for dev, st in view.devices.items():
            if st.convicted and (not authenticated_only or any(c.authenticated for c in st.open_convictions)):
                convicted.add(dev)
                standing.setdefault(dev, (url, st))
    placements = placements_of(snap.placements)
    if not extra and not exclude and not authenticated_only:  # what the run's judgement rests on: its picture
        snap.device_convictions = _conviction_marks(placements, standing)
    return convicted_ranges(placements, convicted - set(exclude))


def _conviction_marks(
    placements: list[Placement], standing: Mapping[str, tuple[str, DeviceStanding]]
) -> list[dict[str, Any]]:
    """Per placement of a convicted device: the steps it computed and its first open conviction's evidence."""
    out = []
    for p, (lo, hi), rank, dev in conviction_spans(placements, standing):
        url, st = standing[dev]
        first = st.open_convictions[0]
        ev = first.evidence
        out.append(
            {
                "branch": p.branch,
                "from": lo,
                "to": hi,
                "rank": rank,
                "device": dev,
                "host": p.hosts.get(rank) or st.host,
                "fleet": url,
                "conviction_id": first.conviction_id,
                "convictions": len(st.open_convictions),
                "by_run": ev.get("run"),
                "by_branch": ev.get("branch"),
                "by_step": ev.get("step"),
                "by_check": ev.get("check"),
                "by_store": ev.get("store"),
                "incident_id": ev.get("incident_id"),
            }
        )
    return out


def _fleet_unproven(snap: LedgerSnapshot, url: str, why: str) -> None:
    """A fleet registry this run's placements name cannot vouch for its convictions (``why``): every
    step placed under it is unproven, its branches ``tampered`` from each placement's start (an
    attacker who deletes or empties a fleet must not clear the devices it convicted)."""
    note = f"fleet registry {url} named by this run's placements {why}: its convictions cannot be checked"
    if note not in snap.notes:
        snap.notes.append(note)
    for r, _ in snap.placements:
        if r.fleet == url:
            snap.unproven_after[r.branch] = min(snap.unproven_after.get(r.branch, r.start_step), r.start_step)


def certify_snapshot(
    snap: LedgerSnapshot,
    *,
    corrupt: Mapping[str, str] | None = None,
    authenticated_only: bool = False,
    convicted: Mapping[str, list[tuple[int, int | None]]] | None = None,
) -> Certification:
    """The certifier over one ledger snapshot: its audit facts, revocations, forks and broken chains,
    and the devices its fleet registries convict.

    Args:
        authenticated_only: leave out evidence against trust that no trusted writer vouches for
            (unsigned failures, revocations and convictions): what a destructive step (a prune) may act on.
        convicted: per branch, the step ranges computed on convicted devices (default: read from the
            fleet registries the run's placements name, ``convicted_ranges_for``).
    """
    if convicted is None:
        convicted = convicted_ranges_for(snap, authenticated_only=authenticated_only)
    return certify(
        snap.checkpoints,
        snap.facts.trusted_only() if authenticated_only else snap.facts,
        [r for r in snap.revocations if r.authenticated] if authenticated_only else snap.revocations,
        corrupt=corrupt or {},
        branch_parents=snap.branch_parents,
        tampered=snap.tampered,
        unproven_after=snap.unproven_after,
        convicted=convicted,
    )


def _record_changes(ledger: Ledger, status: StoreStatus) -> None:
    if ledger.trusted_keys is not None and ledger.signing_key is None:
        return  # an unsigned certificate counts for nothing where keys are trusted: writing it only grows the store
    changed = []
    for cid, v in status.certification.verdicts.items():
        if not status.snapshot.available(cid):
            continue  # a vault certifies what it holds; lineage-only and pruned ones keep their last word
        prev = status.snapshot.parsed.certificates.get(cid)
        if prev is None or prev.verdict != v.label or list(prev.reasons) != list(v.reasons):
            changed.append((cid, v.label, list(v.reasons), status.snapshot.parsed.commits[cid]))
    if changed:
        ledger.record_certificates(changed)


def certify_store(
    store: str, *, verify_bytes: bool = False, write_certificates: bool = True, trust: TrustConfig | None = None
) -> StoreStatus:
    """Certify every committed checkpoint of a run store.

    Args:
        store: the run store's path or URL.
        verify_bytes: verify every checkpoint's bytes (otherwise only latest-good's are checked), and
            every ledger event segment again (otherwise only those appended since this reader's last read).
        write_certificates: record each verdict change in the ledger.
        trust: the reader's keys and memory (default ``TrustConfig.from_env()``).
    """
    ledger = Ledger(store, trust=trust)
    snap = read_remembering(ledger, use_cache=not verify_bytes)  # --verify-bytes: every byte, again
    problems = dict(_shared_files(snap))
    if verify_bytes:
        for cid in snap.parsed.commits:
            if not snap.available(cid) or cid in problems:
                continue
            p = _check(snap, cid)
            if p:
                problems[cid] = p
    cert = certify_snapshot(snap, corrupt=problems)
    status = StoreStatus(
        store=store, snapshot=snap, certification=cert, problems=problems, uncommitted=ledger.uncommitted(snap)
    )
    wrote = write_certificates and _writable(lambda: _record_changes(ledger, status))
    # a vault mirrors its run's incidents; it never opens its own
    if wrote and not snap.is_vault and open_missing_incidents(ledger, status):
        status.snapshot = read_remembering(ledger)
    return status


def read_remembering(ledger: Ledger, *, use_cache: bool = True) -> LedgerSnapshot:
    """The ledger's snapshot, checked against the chain heads this reader verified before (a chain
    that shrank was rolled back), and the heads it proves now remembered for next time.

    Args:
        use_cache: start from the chain entries, records and event segments this reader verified
            before (only what was written since is read); False re-reads and re-hashes everything.
    """
    store, base = ledger.store, ledger.trust.memory_dir
    cache = recall_facts(store, base=base) if use_cache else None
    chains = recall_chains(store, base=base) if use_cache else None
    snap = ledger.snapshot(
        remembered=recall(store, base=base),
        remembered_genesis=recall_genesis(store, base=base),
        cache=cache,
        chains=chains,
    )
    remember_snapshot(store, snap, base=base)
    if snap.chained:
        remember_facts(store, snap.facts_cache, base=base)
        remember_chains(store, snap.chain_cache, base=base)
    return snap


def _writable(write: Callable[[], object]) -> bool:
    """Run a write that only caches what reading already derived (certificates, the incidents
    `status` opens); a read-only store still gets its answer. Returns whether the write went through."""
    try:
        write()
    except (PermissionError, StorageError):
        return False
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return False
        raise
    return True


def find_latest_good(
    store: str,
    *,
    verify_bytes: bool = True,
    write_certificates: bool = True,
    accept: str | Level = Level.TRUSTED,
    trust: TrustConfig | None = None,
) -> tuple[StoreStatus, str | None]:
    """The newest trusted checkpoint whose bytes verify now, falling back along the trusted order.

    Args:
        store: the run store's (or vault's) path or URL.
        verify_bytes: re-verify the chosen checkpoint's bytes and that it is the committed file
            (its embedded record against its commit record; one file named by two records fails).
        write_certificates: record verdict changes in the ledger.
        accept: ``"trusted"`` (default) or ``"verified"``: also take a verified checkpoint (a run
            without the auditor), but only when no trusted one qualifies.
        trust: the reader's keys and memory (default ``TrustConfig.from_env()``).

    Example:
        >>> status, cid = find_latest_good("runs/r1", accept="verified")
    """
    level = accept_level(accept)
    ledger = Ledger(store, trust=trust)
    status = certify_store(store, write_certificates=False, trust=ledger.trust)
    chosen = None
    for cid in status.certification.candidates(level):
        if not status.snapshot.available(cid):
            status.unavailable.append(cid)
            continue
        problem = _check(status, cid) if verify_bytes else None
        if problem is None:
            chosen = cid
            break
        status.fallbacks.append((cid, problem))
        status.problems[cid] = problem
    if status.fallbacks:
        snap = status.snapshot
        status.certification = certify_snapshot(snap, corrupt=status.problems)
    if write_certificates:
        _writable(lambda: _record_changes(ledger, status))
    return status, chosen


# --- incidents: the records the pure rules in `incident` read and write ---------------------------


def open_incident(ledger: Ledger, ev: Mapping[str, Any], *, status: StoreStatus | None = None) -> str:
    """Write the opening record for an uncontained failed check (idempotent); returns its id.

    Args:
        ev: the failed check's event record (``AuditEvent.to_dict()``).
        status: the store certified already (certified here when not given).
    """
    iid = incident_id_for(ev)
    st = status if status is not None else certify_store(ledger.store, write_certificates=False)
    cert = st.certification
    det = next((d for d in cert.detections if d.branch == ev["branch"] and d.step == ev["step"] and d.interval), None)
    interval = det.interval if det else None
    made = [
        c.ckpt_id for c in st.snapshot.checkpoints if c.branch == ev["branch"] and interval and c.step > interval[0]
    ]
    doc = build_opening(
        ev,
        latest_good=st.latest_good,
        made_suspect=sorted(made, key=lambda x: int(x.rpartition("@")[2])),
        interval=interval,
        now=time.time(),
    )
    try:
        ledger.write_record("incidents", f"{iid}--{OPENED_SUFFIX}.json", doc)
    except CheckpointExistsError:
        pass  # opened already (by the training job or an earlier `status`): the first record stands
    return iid


def open_missing_incidents(ledger: Ledger, status: StoreStatus) -> list[str]:
    """Open an incident for every uncontained detection that has none yet (called by ``status``)."""
    have = {r.incident_id for r in status.snapshot.parsed.incidents}
    out = []
    for ev in status.snapshot.failures:
        try:
            malformed = read_event(ev)[1] is not None
        except EventProblem:
            malformed = True
        if malformed:
            continue  # a malformed failure counts against trust; it is no incident's evidence
        if (
            ev.get("outcome") == Outcome.FAIL
            and not ev.get("contained")
            and not (ev.get("details") or {}).get("found_by")
        ):
            iid = incident_id_for(ev)
            if iid not in have:
                have.add(iid)
                out.append(open_incident(ledger, ev, status=status))
    return out


def list_incidents(store: str) -> list[Incident]:
    """Every incident of a run store (or vault), oldest first."""
    return list(incident_state(r.raw for r in Ledger(store).snapshot().parsed.incidents).values())


def get_incident(store: str, incident_id: str) -> Incident:
    for inc in list_incidents(store):
        if inc.incident_id == incident_id:
            return inc
    raise CheckpointNotFoundError(f"{store}: no incident {incident_id!r} (see `certckpt incident ls {store}`)")


def decide(
    store: str,
    incident_id: str,
    *,
    action: str,
    by: str,
    reason: str,
    ckpt: str | None = None,
    node: str | None = None,
    approves: str | None = None,
    drill: str | None = None,
    vault: str | None = None,
) -> dict[str, Any]:
    """Record a decision on an incident after checking it against the rules; returns the record.

    Args:
        ckpt: rollback: the checkpoint training restarts from.
        node: quarantine / replace / return-to-service: which node (default the suspect nodes).
        approves: approve: the decision id approved.
        drill: close: the restore drill's id (``latest``: the newest); ``vault`` is where it was
            recorded (default this store).
    """
    inc = get_incident(store, incident_id)
    status = certify_store(store, write_certificates=False)
    drills = []
    if action == "close":
        source = Ledger(vault) if vault else Ledger(store)
        names = source.list_raw("drills")
        drills = [
            dict(json.loads(v), drill_id=k.removesuffix(".json")) for k, v in source.read_raw("drills", names).items()
        ]
    now = time.time()
    decision_id = f"{incident_id}--{time.time_ns():020d}-{action}"
    doc = {
        "incident_id": incident_id,
        "record": "decision",
        "decision_id": decision_id,
        "action": action,
        "by": by,
        "reason": reason,
        "at": now,
    }
    if ckpt:
        doc["ckpt"] = ckpt
    if action in ("quarantine", "replace", "return-to-service"):
        doc["nodes"] = [node] if node else inc.opened.get("suspect_nodes", [])
    if approves:
        doc["approves"] = approves
    if drill:
        doc["drill"] = drill
        doc["drill_vault"] = vault or store
    if drill == "latest" and drills:
        doc["drill"] = max(drills, key=lambda d: d.get("at", 0))["drill_id"]
    ledger = Ledger(store)
    check_decision(
        inc,
        doc,
        trusted=[c for c in status.certification.order if status.snapshot.available(c)],
        drills=drills,
        signer=ledger.signing_key.key_id if ledger.signing_key is not None else None,
    )
    ledger.write_record("incidents", f"{decision_id}.json", doc)
    return doc


def snapshot_or_empty(ledger: Ledger) -> LedgerSnapshot:
    """The ledger's records; none yet when its local store does not exist (a first run)."""
    if "://" not in ledger.store and not os.path.isdir(ledger.store):
        return LedgerSnapshot()
    return ledger.snapshot()


def committed_into(ledger: Ledger, directory: str) -> str | None:
    """The id of a checkpoint ``ledger`` commits inside ``directory`` (by its committed file's
    location, whatever its branch or its manifest's state now), or None."""
    here = os.path.abspath(directory)
    for cid, record in snapshot_or_empty(ledger).records.items():
        if os.path.dirname(os.path.abspath(ledger.url_of(record))) == here:
            return cid
    return None


def taken_problem(ledger: Ledger, directory: str, leftover: Callable[[str], str | None]) -> str | None:
    """Why a save may not take ``directory`` by removing what is there (None: nothing is there, or
    ``leftover(directory)`` proves it is the caller's own uncommitted save): a checkpoint ``ledger``
    commits there, something that is not a directory, or whatever ``leftover`` finds."""
    if not os.path.lexists(directory):
        return None
    cid = committed_into(ledger, directory)
    if cid is not None:
        return f"{cid} is committed there"
    return leftover(directory) if os.path.isdir(directory) and not os.path.islink(directory) else "not a directory"


def latest_intact_directory(
    ledger: Ledger,
    check_directory: Callable[[str], ManifestDirReport],
    *,
    write_certificates: bool,
    log: logging.Logger,
    prefix: str = "",
) -> str | None:
    """The directory of the newest good checkpoint (trusted first, then verified) whose every file
    verifies now; None when the store has committed nothing yet (a first run starts from scratch).

    The committed file, the manifest, is re-verified (``check_file``); the other files of its
    directory by ``check_directory``; a checkpoint with a damaged one is skipped, with a warning on
    ``log`` (its lines start with ``prefix``).

    Raises:
        CheckpointNotFoundError: checkpoints are committed, but none verifies whole.
    """
    try:
        status = certify_store(ledger.store, write_certificates=write_certificates)
    except CheckpointNotFoundError:
        status = None  # no store yet
    if status is None or not status.snapshot.records:
        log.info(prefix + "nothing committed in %s yet: training from scratch", ledger.store)
        return None
    for cid in status.certification.candidates("verified"):
        if not status.snapshot.available(cid):
            continue
        record = status.snapshot.records[cid]
        manifest = ledger.url_of(record)
        problem = check_file(manifest, record.get("header_digest"), committed=record)
        if problem is None:
            try:
                report = check_directory(os.path.dirname(manifest))
                problem = None if report.ok else report.problems[0]
            except CertckptError as e:
                problem = str(e)
        if problem is None:
            return os.path.dirname(manifest)
        log.warning(prefix + "not resuming from %s: %s", cid, problem)
    raise CheckpointNotFoundError(
        f"{ledger.store}: no trusted or verified checkpoint to resume from whose files all verify "
        f"(see `certckpt status {ledger.store}`)"
    )


def committed_directory(value: Any, ledger_of: Callable[[], Ledger], manifest_name: str) -> str:
    """The checkpoint directory ``value`` names: a committed checkpoint's id (looked up in the
    ledger ``ledger_of`` gives, when no such path exists), its manifest file, or the directory itself.

    Raises:
        CheckpointNotFoundError: an id the ledger has not committed.
    """
    path: str = os.fspath(value)
    if is_ckpt_id(path) and not os.path.exists(path):
        ledger = ledger_of()
        rec = snapshot_or_empty(ledger).records.get(path)
        if rec is None:
            raise CheckpointNotFoundError(f"{ledger.store}: no committed checkpoint {path!r}")
        return os.path.dirname(ledger.url_of(rec))
    if os.path.isfile(path) and os.path.basename(path) == manifest_name:
        return os.path.dirname(os.path.abspath(path))
    return path
