"""``certckpt latest-good``, ``status`` and ``revoke``: a run store's verdicts (no torch import)."""

from __future__ import annotations

import json
import sys

import click

from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import StoreStatus, certify_store, find_latest_good

from .common import EXIT_FAILED, expected_errors, table_lines, trusted_keys_option


@click.command("latest-good")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON answer.")
@click.option("--no-verify", is_flag=True, help="Do not re-verify the chosen checkpoint's bytes.")
@click.option(
    "--dir",
    "as_dir",
    is_flag=True,
    help="Print the checkpoint's directory (what from_pretrained and ckpt_path= take) for one kept as a directory.",
)
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict taken: verified also answers a run without the auditor (a trusted one still wins).",
)
@trusted_keys_option
@expected_errors
def latest_good(store: str, as_json: bool, no_verify: bool, accept: str, as_dir: bool = False) -> None:
    """Print the newest trusted checkpoint of STORE that precedes every open suspect interval.

    Exit 0 with its URL; 1 when no checkpoint is trusted (or verified, with --accept verified),
    with the reason; 2 when the store cannot be read.
    """
    status, chosen = find_latest_good(store, verify_bytes=not no_verify, accept=accept)
    for cid, problem in status.fallbacks:
        click.echo(f"certckpt: skipping {cid}: {problem}", err=True)
    for b in status.snapshot.breaks:
        click.echo(f"certckpt: tampered ledger: {b.describe()}", err=True)
    intervals = status.suspect_intervals()
    if chosen is None:
        n = len(status.snapshot.checkpoints)
        if n == 0:
            reason = "no committed checkpoint in this store" + (
                f" ({len(status.uncommitted)} uncommitted file(s) ignored)" if status.uncommitted else ""
            )
        else:
            counts: dict[str, int] = {}
            for v in status.certification.verdicts.values():
                for r in v.reasons:
                    counts[r] = counts.get(r, 0) + 1
            wanted = "trusted" if accept == "trusted" else "trusted or verified"
            reason = (
                f"none of {n} committed checkpoints is {wanted} ("
                + ", ".join(f"{k}: {c}" for k, c in sorted(counts.items()))
                + ")"
            )
            verified = [c for c in status.certification.verified_order if status.snapshot.available(c)]
            if accept == "trusted" and verified:
                reason += (
                    f"; {len(verified)} verified without audit evidence (newest {verified[0]}):"
                    " `--accept verified` takes it"
                )
        if as_json:
            click.echo(
                json.dumps({"url": None, "ckpt_id": None, "reason": reason, "suspect_intervals": intervals}, indent=2)
            )
        else:
            click.echo(f"certckpt: {reason}", err=True)
        sys.exit(EXIT_FAILED)
    entry = status.entry(chosen)
    if as_json:
        rec = status.snapshot.records[chosen]
        click.echo(
            json.dumps(
                {
                    "url": entry.url,
                    "ckpt_id": chosen,
                    "run": rec.get("run"),
                    "branch": entry.branch,
                    "step": entry.step,
                    "verdict": status.certification.verdicts[chosen].label,
                    "verified": not no_verify,
                    "suspect_intervals": intervals,
                    "directory": checkpoint_directory(entry.url),
                },
                indent=2,
            )
        )
    else:
        click.echo(checkpoint_directory(entry.url) if as_dir else entry.url)


def checkpoint_directory(url: str) -> str:
    """The directory a checkpoint is kept in: a sharded checkpoint's own, or the one holding a
    certified file and its companions (a Trainer ``checkpoint-N/``); a lone file's parent."""
    if url.endswith(".safetensors"):
        return url.rsplit("/", 1)[0] if "/" in url else "."
    return url.rstrip("/")


@click.command()
@click.argument("store")
@click.option("--verify-bytes", is_flag=True, help="Verify every checkpoint's bytes (slower).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (with --coverage: every checkpoint's coverage).")
@click.option(
    "--coverage",
    "show_coverage",
    is_flag=True,
    help="Also print each checkpoint's audit coverage since its parent, and the detection bound.",
)
@click.option(
    "--forget-memory",
    "forget_memory",
    is_flag=True,
    help="First forget what this reader verified of STORE (its identity and chain heads): accept a store "
    "re-created at the same URL on purpose. Never needed otherwise: a rollback check is lost with it.",
)
@trusted_keys_option
@expected_errors
def status(
    store: str, verify_bytes: bool, as_json: bool, show_coverage: bool = False, forget_memory: bool = False
) -> None:
    """Every checkpoint of STORE with its verdict and reasons, the detections, uncommitted files.

    STORE may also be one checkpoint's directory inside a store (a Trainer ``checkpoint-N/``): the
    store around it is shown, that checkpoint named first."""
    inside = enclosing_store(store)
    if inside is not None:
        store, directory = inside, store
    if forget_memory:
        from certckpt.trust.memory import forget

        forgotten = forget(store)
        click.echo(f"forgot what this reader verified of {store} ({len(forgotten)} file(s))", err=True)
    st = certify_store(store, verify_bytes=verify_bytes)
    focus = _checkpoint_in(st, directory) if inside is not None else None
    cert = st.certification
    rows = sorted(st.snapshot.checkpoints, key=lambda c: (c.branch, c.step))
    # coverage reads every audit event again (a big ledger's are folded while reading, not kept): asked for
    cov = st.coverage() if show_coverage else {}
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": store,
                    "latest_good": st.latest_good,
                    "checkpoints": [
                        {
                            "ckpt_id": c.ckpt_id,
                            "branch": c.branch,
                            "step": c.step,
                            "url": c.url,
                            "parent": c.parent,
                            "verdict": cert.verdicts[c.ckpt_id].label,
                            "reasons": list(cert.verdicts[c.ckpt_id].reasons),
                            "held": st.snapshot.available(c.ckpt_id),
                            **({"coverage": cov[c.ckpt_id].to_json()} if show_coverage else {}),
                        }
                        for c in rows
                    ],
                    "detections": [
                        {
                            "branch": d.branch,
                            "step": d.step,
                            "kind": d.kind,
                            "suspect_ranks": list(d.suspect_ranks),
                            "contained": d.contained,
                            "last_clean": d.last_clean,
                            "suspect_interval": list(d.interval) if d.interval else None,
                            "rollback_window": d.rollback_window,
                        }
                        for d in cert.detections
                    ],
                    "uncommitted": st.uncommitted,
                    "problems": st.problems,
                    "ledger": ledger_dict(st),
                    **({"checkpoint": focus} if inside is not None else {}),
                },
                indent=2,
            )
        )
        return
    if inside is not None:
        if focus is None:
            click.echo(f"{directory}: not a checkpoint committed to the store {store}")
        else:
            v = st.certification.verdicts[focus]
            reasons = f" ({', '.join(v.reasons)})" if v.reasons else ""
            click.echo(f"{directory}: {focus} in the store {store}: {v.label}{reasons}")
    for line in status_lines(st):
        click.echo(line)
    if show_coverage:
        for line in coverage_lines(st, cov):
            click.echo(line)


def coverage_lines(st: StoreStatus, cov: dict) -> list[str]:
    """The coverage table of ``certckpt status --coverage``: per checkpoint, over the steps since its
    parent, what the checks recomputed and the detection bound that follows."""
    rows = sorted(st.snapshot.checkpoints, key=lambda c: (c.branch != "main", c.branch, c.step))
    head = ("checkpoint", "steps", "replayed", "consensus", "non-finite", "persistent", "one-time", "lineage")
    table = []
    for c in rows:
        x = cov[c.ckpt_id]
        w = x.window
        sampled = f" ({len(w.sampled_steps)} sampled)" if w.sampled_steps else ""
        sampled += f" (+{len(w.triggered_steps)} triggered)" if w.triggered_steps else ""
        persistent = "unbounded" if x.persistent_within is None else f"<= {x.persistent_within} steps"
        if x.persistent_within is not None:
            persistent += ", rank named" if x.rank_named else ", rank unnamed"
        table.append(
            (
                c.ckpt_id,
                f"{w.start + 1}-{w.end}" if w.steps else "-",
                f"{len(w.replay_steps)}/{w.steps}{sampled}",
                f"{len(w.consensus_steps)}/{w.steps}",
                f"{w.nonfinite_steps}/{w.steps}",
                persistent,
                f"{x.one_time_replayed} ({float(x.one_time_replayed):.0%})",
                f"{x.lineage_replayed} over {x.lineage_steps} steps",
            )
        )
    if not table:
        return []
    return [
        "",
        "coverage since each checkpoint's parent (from the signed events): steps replayed, weights compared,",
        "non-finite checks; a persistent fault caught within; the chance a one-time fault was replayed",
        *table_lines(head, table),
    ]


def enclosing_store(location: str) -> str | None:
    """The run store around a local checkpoint directory that is not a store itself (a Trainer
    ``checkpoint-N/``, or one of a resumed branch's ``OUTPUT_DIR/main-r1/checkpoint-N/``): the
    nearest parent directory holding a ledger; None for anything else."""
    import os

    from certckpt.storage import LEDGER_DIR

    if "://" in location or not os.path.isdir(location) or os.path.isdir(os.path.join(location, LEDGER_DIR)):
        return None
    # only for a directory that is not a store: a store given as itself never loads the file format
    from certckpt.format.companions import companion_marker
    from certckpt.format.sharded.layout import MANIFEST_NAME

    if companion_marker(location) is None and not os.path.isfile(os.path.join(location, MANIFEST_NAME)):
        return None  # not a checkpoint's directory: a store, as given
    here = os.path.abspath(location)
    for _ in range(3):  # checkpoint-N/, a branch's directory, the store
        here = os.path.dirname(here)
        if os.path.isdir(os.path.join(here, LEDGER_DIR)):
            return os.path.relpath(here) if not os.path.isabs(location) else here
    return None


def _checkpoint_in(st: StoreStatus, directory: str) -> str | None:
    """The id of the committed checkpoint kept in ``directory`` (None when none is)."""
    import os

    want = os.path.abspath(directory)
    for c in st.snapshot.checkpoints:
        if "://" not in c.url and os.path.abspath(checkpoint_directory(c.url)) == want:
            return c.ckpt_id
    return None


def status_lines(st: StoreStatus) -> list[str]:
    """The verdict table and detections of a certified store, as ``certckpt status`` prints them."""
    cert = st.certification
    rows = sorted(st.snapshot.checkpoints, key=lambda c: (c.branch != "main", c.branch, c.step))
    out: list[str] = []
    head = ("checkpoint", "branch", "step", "verdict", "reasons")
    gone = "pruned" if not st.snapshot.is_vault else "not held here"
    table = [
        (
            c.ckpt_id + (" *" if c.ckpt_id == st.latest_good else ""),
            c.branch,
            str(c.step),
            cert.verdicts[c.ckpt_id].label
            + (
                ""
                if st.snapshot.available(c.ckpt_id)
                else f" ({'pruned' if c.ckpt_id in st.snapshot.retired else gone})"
            ),
            ", ".join(cert.verdicts[c.ckpt_id].reasons) or "-",
        )
        for c in rows
    ]
    if table:
        out.extend(table_lines(head, table))
        verified = [c for c in cert.verified_order if st.snapshot.available(c) and c not in st.problems]
        if st.latest_good:
            out.append(f"* latest-good: {st.latest_good}")
        elif verified:
            out.append(
                f"no trusted checkpoint; newest verified (no audit evidence): {verified[0]}"
                " (`certckpt latest-good --accept verified` takes it)"
            )
        else:
            out.append("no trusted checkpoint")
    else:
        out.append("no committed checkpoints")
    for d in cert.detections:
        where = f"step {d.step} on {d.branch}: {d.kind} failed, suspect rank(s) {list(d.suspect_ranks) or 'unknown'}"
        if d.interval:
            out.append(
                f"detection: {where}; suspect interval ({d.interval[0]}, {d.interval[1]}], "
                f"rollback window {d.rollback_window} updates"
            )
        else:
            out.append(f"detection: {where}; contained (the update never reached the weights)")
    out.extend(f"uncommitted (ignored): {u}" for u in st.uncommitted)
    out.extend(f"corrupt: {cid}: {p}" for cid, p in st.problems.items())
    snap = st.snapshot
    out.extend(f"tampered: {b.describe()}" for b in snap.breaks)
    out.extend(f"invalid (ignored for trust): {what}: {why}" for what, why in snap.invalid[:_MAX_INVALID_SHOWN])
    if len(snap.invalid) > _MAX_INVALID_SHOWN:
        out.append(f"... and {len(snap.invalid) - _MAX_INVALID_SHOWN} more invalid records (`--json` lists them all)")
    out.extend(f"note: {n}" for n in snap.notes)
    return out


_MAX_INVALID_SHOWN = 20


def ledger_dict(st: StoreStatus) -> dict:
    """How the ledger was read, for ``--json``: chained or not, its breaks, invalid records, notes."""
    snap = st.snapshot
    return {
        "chained": snap.chained,
        "store_id": snap.store_id,
        "breaks": [{"writer": b.writer, "seq": b.seq, "scope": b.scope, "why": b.why} for b in snap.breaks],
        "tampered": snap.tampered,
        "invalid": [{"record": what, "why": why} for what, why in snap.invalid],
        "notes": snap.notes,
    }


@click.command()
@click.argument("store")
@click.argument("ckpt")
@click.option("--reason", required=True, help="Why this checkpoint must not be trusted.")
@click.option("--by", default="", help="Who revokes it.")
@expected_errors
def revoke(store: str, ckpt: str, reason: str, by: str) -> None:
    """Revoke checkpoint CKPT (an id like main@120) of STORE; it and its descendants become suspect."""
    Ledger(store).revoke(ckpt, reason=reason, by=by)
    click.echo(f"revoked {ckpt}: {reason}")
