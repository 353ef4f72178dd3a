"""The ``certckpt`` command line: parse, call one library function, print, map errors to exit codes.

Exit codes (documented in the README):
    0  verified / done
    1  verification failed: corrupt bytes, digest or fingerprint mismatch, truncated, malformed header
    2  could not verify: bad usage, not found, not a certckpt checkpoint, store unreachable

Importing this module, ``--help``, ``verify`` (without ``--deep``) and ``inspect`` never import torch.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import click

from certckpt.errors import CertckptError, CorruptCheckpointError, UntrustedCheckpointError

EXIT_OK, EXIT_FAILED, EXIT_UNVERIFIABLE = 0, 1, 2


def _fail(message: str, code: int) -> None:
    click.echo(f"certckpt: {message}", err=True)
    sys.exit(code)


def expected_errors(fn):
    """Turn certckpt's expected errors into one line on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # `certckpt inspect ... | head`: the reader left, not an error
            sys.stderr.close()
            sys.exit(EXIT_OK)
        except (CorruptCheckpointError, UntrustedCheckpointError) as e:
            _fail(str(e), EXIT_FAILED)
        except (CertckptError, OSError, ValueError) as e:
            _fail(str(e), EXIT_UNVERIFIABLE)

    return wrapper


def _human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


class _Progress:
    """A percentage on stderr for large files, only when a person is watching."""

    THRESHOLD = 1 << 30

    def __init__(self, label: str, threshold: int | None = None) -> None:
        self.label = label
        if threshold is not None:
            self.THRESHOLD = threshold
        self.last = -1
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.THRESHOLD:
            return
        pct = done * 100 // max(total, 1)
        if pct != self.last:
            self.last = pct
            click.echo(f"\r{self.label}: {pct:3d}% of {_human_bytes(total)}", err=True, nl=pct == 100)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="certckpt", prog_name="certckpt")
def main() -> None:
    """Certified, pickle-free PyTorch checkpoints.

    Exit codes: 0 verified; 1 verification failed (corrupt, truncated, tampered);
    2 could not verify (usage, not found, not a certckpt checkpoint, store unreachable).
    """


@main.command()
@click.argument("location")
@click.option("--deep", is_flag=True, help="Also recompute every tensor's device fingerprint (imports torch).")
@click.option("--ledger", "ledger_url", default=None, help="Run store whose ledger certifies it: adds the verdict (exit 1 when suspect).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@expected_errors
def verify(location: str, deep: bool, ledger_url: str | None, as_json: bool) -> None:
    """Check every byte of the checkpoint at LOCATION (path or fsspec URL)."""
    from certckpt.format.verify import verify as run_verify

    report = run_verify(location, deep=deep, progress=_Progress(f"verifying {location}"))
    verdict = _ledger_verdict(location, ledger_url, report) if ledger_url else None
    if verdict is not None and report.ok and not verdict["trusted"]:
        report.ok = False
    if as_json:
        doc = report.to_dict()
        if verdict is not None:
            doc["verdict"] = verdict
        click.echo(json.dumps(doc, indent=2))
    elif report.ok:
        rec = report.info.record
        what = ", ".join(
            x for x in (f"run {rec.run}" if rec.run else "", f"step {rec.step}" if rec.step is not None else "") if x
        )
        click.echo(
            f"OK  {location}  {report.tensors} tensors, {_human_bytes(report.nbytes)}"
            f"{', ' + what if what else ''}, state fp {rec.state_fp}"
            f"{', fingerprints recomputed' if deep else ''} ({report.seconds:.2f} s)"
        )
        if verdict is not None:
            click.echo(f"    verdict: {verdict['verdict']} ({verdict['ckpt_id']})")
    elif verdict is not None and not report.problems:
        click.echo(f"SUSPECT  {location}  bytes verify, but {verdict['ckpt_id'] or 'it'} is certified suspect: {', '.join(verdict['reasons'])}")
    else:
        click.echo(f"FAILED  {location}")
        for p in report.problems:
            click.echo(f"  {p.message}")
        if verdict is not None:
            reasons = ", ".join(verdict["reasons"]) or "-"
            click.echo(f"  verdict: {verdict['verdict']} ({verdict['ckpt_id']}): {reasons}")
    sys.exit(EXIT_OK if report.ok else EXIT_FAILED)


def _ledger_verdict(location: str, ledger_url: str, report) -> dict:
    import os

    from certckpt.trust.runstore import certify_store

    status = certify_store(ledger_url, write_certificates=False)
    want = os.path.abspath(location) if "://" not in location else location
    for entry in status.snapshot.checkpoints:
        cid, url = entry.ckpt_id, entry.url
        have = os.path.abspath(url) if "://" not in url else url
        if have == want:
            v = status.certification.verdicts[cid]
            reasons = list(v.reasons)
            if not report.ok and "corrupt" not in reasons:
                reasons.insert(0, "corrupt")
            return {"ckpt_id": cid, "trusted": v.trusted and report.ok, "verdict": "trusted" if v.trusted and report.ok else "suspect", "reasons": reasons}
    return {"ckpt_id": None, "trusted": False, "verdict": "suspect", "reasons": ["uncommitted"]}


@main.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="Print the header as JSON.")
@expected_errors
def inspect(location: str, as_json: bool) -> None:
    """Show the tensor table and certckpt record of LOCATION without reading the data."""
    from certckpt.format.verify import inspect as run_inspect

    info = run_inspect(location)
    rec = info.record
    if as_json:
        doc = {
            "source": info.source,
            "bytes": info.nbytes,
            "schema": rec.schema,
            "run": rec.run,
            "branch": rec.branch,
            "step": rec.step,
            "step_range": rec.step_range,
            "parent": rec.parent,
            "state_fp": rec.state_fp,
            "consensus_fp": rec.consensus_fp,
            "lineage": rec.lineage,
            "writer": rec.writer,
            "metadata": rec.user,
            "tensors": [
                {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.nbytes, **rec.tensors[e.name]}
                for e in info.header.entries
            ],
        }
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"{info.source}: certckpt schema {rec.schema}, {len(info.header.entries)} tensors, {_human_bytes(info.nbytes)}")
    for label, value in (
        ("run", rec.run),
        ("branch", rec.branch),
        ("step", rec.step),
        ("steps", f"{rec.step_range[0]}..{rec.step_range[1]}" if rec.step_range else None),
        ("parent", rec.parent),
        ("last clean audit", (rec.lineage or {}).get("last_clean_audit")),
        ("state fp", rec.state_fp),
        ("consensus fp", rec.consensus_fp),
        ("written", f"{rec.writer.get('time')} on {rec.writer.get('host')} (torch {rec.writer.get('torch')})"),
    ):
        if value is not None:
            click.echo(f"  {label:<16} {value}")
    rows = [(e.name, e.dtype, "x".join(map(str, e.shape)) or "scalar", _human_bytes(e.nbytes), rec.tensors[e.name]["fp"]) for e in info.header.entries]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(("tensor", "dtype", "shape", "size", "fingerprint"))]
    click.echo("  " + "  ".join(h.ljust(w) for h, w in zip(("tensor", "dtype", "shape", "size", "fingerprint"), widths)))
    for r in rows:
        click.echo("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


@main.command("latest-good")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON answer.")
@click.option("--no-verify", is_flag=True, help="Do not re-verify the chosen checkpoint's bytes.")
@expected_errors
def latest_good(store: str, as_json: bool, no_verify: bool) -> None:
    """Print the newest trusted checkpoint of STORE that precedes every open suspect interval.

    Exit 0 with its URL; 1 when no checkpoint is trusted (with the reason); 2 when the store
    cannot be read.
    """
    from certckpt.trust.runstore import find_latest_good

    status, chosen = find_latest_good(store, verify_bytes=not no_verify)
    for cid, problem in status.fallbacks:
        click.echo(f"certckpt: skipping {cid}: {problem}", err=True)
    intervals = status.suspect_intervals()
    if chosen is None:
        n = len(status.snapshot.checkpoints)
        if n == 0:
            reason = "no committed checkpoint in this store" + (f" ({len(status.uncommitted)} uncommitted file(s) ignored)" if status.uncommitted else "")
        else:
            counts: dict[str, int] = {}
            for v in status.certification.verdicts.values():
                for r in v.reasons:
                    counts[r] = counts.get(r, 0) + 1
            reason = f"none of {n} committed checkpoints is trusted (" + ", ".join(f"{k}: {c}" for k, c in sorted(counts.items())) + ")"
        if as_json:
            click.echo(json.dumps({"url": None, "ckpt_id": None, "reason": reason, "suspect_intervals": intervals}, indent=2))
        else:
            click.echo(f"certckpt: {reason}", err=True)
        sys.exit(EXIT_FAILED)
    entry = status.entry(chosen)
    if as_json:
        rec = status.snapshot.records[chosen]
        click.echo(json.dumps({
            "url": entry.url, "ckpt_id": chosen, "run": rec.get("run"), "branch": entry.branch, "step": entry.step,
            "verdict": "trusted", "verified": not no_verify, "suspect_intervals": intervals,
        }, indent=2))
    else:
        click.echo(entry.url)


@main.command()
@click.argument("store")
@click.option("--verify-bytes", is_flag=True, help="Verify every checkpoint's bytes (slower).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def status(store: str, verify_bytes: bool, as_json: bool) -> None:
    """Every checkpoint of STORE with its verdict and reasons, the detections, uncommitted files."""
    from certckpt.trust.runstore import certify_store

    st = certify_store(store, verify_bytes=verify_bytes)
    cert = st.certification
    rows = sorted(st.snapshot.checkpoints, key=lambda c: (c.branch, c.step))
    if as_json:
        click.echo(json.dumps({
            "store": store,
            "latest_good": st.latest_good,
            "checkpoints": [{"ckpt_id": c.ckpt_id, "branch": c.branch, "step": c.step, "url": c.url, "parent": c.parent,
                             "verdict": cert.verdicts[c.ckpt_id].label, "reasons": list(cert.verdicts[c.ckpt_id].reasons),
                            "held": st.snapshot.available(c.ckpt_id)} for c in rows],
            "detections": [{"branch": d.branch, "step": d.step, "kind": d.kind, "suspect_ranks": list(d.suspect_ranks),
                            "contained": d.contained, "last_clean": d.last_clean,
                            "suspect_interval": list(d.interval) if d.interval else None, "rollback_window": d.rollback_window}
                           for d in cert.detections],
            "uncommitted": st.uncommitted,
            "problems": st.problems,
        }, indent=2))
        return
    for line in status_lines(st):
        click.echo(line)


def status_lines(st) -> list[str]:
    """The verdict table and detections of a certified store, as ``certckpt status`` prints them."""
    cert = st.certification
    rows = sorted(st.snapshot.checkpoints, key=lambda c: (c.branch != "main", c.branch, c.step))
    out: list[str] = []
    head = ("checkpoint", "branch", "step", "verdict", "reasons")
    gone = "pruned" if not st.snapshot.is_vault else "not held here"
    table = [(c.ckpt_id + (" *" if c.ckpt_id == st.latest_good else ""), c.branch, str(c.step),
              cert.verdicts[c.ckpt_id].label + ("" if st.snapshot.available(c.ckpt_id) else f" ({'pruned' if c.ckpt_id in st.snapshot.retired else gone})"),
              ", ".join(cert.verdicts[c.ckpt_id].reasons) or "-") for c in rows]
    if table:
        widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
        out.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
        out.extend("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table)
        out.append(f"* latest-good: {st.latest_good}" if st.latest_good else "no trusted checkpoint")
    else:
        out.append("no committed checkpoints")
    for d in cert.detections:
        where = f"step {d.step} on {d.branch}: {d.kind} failed, suspect rank(s) {list(d.suspect_ranks) or 'unknown'}"
        if d.interval:
            out.append(f"detection: {where}; suspect interval ({d.interval[0]}, {d.interval[1]}], rollback window {d.rollback_window} updates")
        else:
            out.append(f"detection: {where}; contained (the update never reached the weights)")
    out.extend(f"uncommitted (ignored): {u}" for u in st.uncommitted)
    out.extend(f"corrupt: {cid}: {p}" for cid, p in st.problems.items())
    return out


@main.command()
@click.argument("store")
@click.argument("ckpt")
@click.option("--reason", required=True, help="Why this checkpoint must not be trusted.")
@click.option("--by", default="", help="Who revokes it.")
@expected_errors
def revoke(store: str, ckpt: str, reason: str, by: str) -> None:
    """Revoke checkpoint CKPT (an id like main@120) of STORE; it and its descendants become suspect."""
    from certckpt.trust.ledger import Ledger

    Ledger(store).revoke(ckpt, reason=reason, by=by)
    click.echo(f"revoked {ckpt}: {reason}")


@main.group()
def drill() -> None:
    """Drills: inject faults and check the checks; restore latest-good from a vault and prove it."""


@drill.command("faults")
@click.option("--ranks", default=3, show_default=True, type=click.IntRange(1, 8), help="gloo ranks on this machine (CPU).")
@click.option("--audit-every", default=10, show_default=True, type=click.IntRange(2, 1000), help="K: replay-audit interval.")
@click.option("--ckpt-every", default=5, show_default=True, type=click.IntRange(1, 1000), help="checkpoint interval (a consensus step).")
@click.option("--dir", "directory", default=None, type=click.Path(file_okay=False), help="Keep each case's run store (checkpoints and events) here.")
@click.option("--json", "as_json", is_flag=True, help="Print the matrix as JSON.")
@expected_errors
def drill_faults(ranks: int, audit_every: int, ckpt_every: int, directory: str | None, as_json: bool) -> None:
    """Run the fault-injection matrix on a small model and print which check caught what.

    Exit 0 when every case behaved as designed (escapes included), 1 otherwise.
    """
    from certckpt.detect.drill import run_matrix

    if not as_json:
        click.echo(f"running 12 fault cases on {ranks} gloo ranks (audit every {audit_every}, checkpoint every {ckpt_every})...", err=True)
    matrix = run_matrix(ranks=ranks, audit_every=audit_every, ckpt_every=ckpt_every, directory=directory)
    as_designed = all(
        (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
        and (c["caught_by"] is None or ranks < 3 or c["suspect_ranks"] == [c["rank"]])
        for c in matrix["cases"]
    )
    if as_json:
        click.echo(json.dumps(matrix, indent=2))
    else:
        head = ("fault", "timing", "rank", "injected", "caught by", "at step", "named", "updates", "as designed")
        rows = []
        for c in matrix["cases"]:
            ok = (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
            rows.append((
                c["fault"], c["timing"], str(c["rank"]), str(c["injected_step"]),
                c["caught_by"] or "ESCAPED", "-" if c["detected_step"] is None else str(c["detected_step"]),
                ",".join(map(str, c["suspect_ranks"])) or "-",
                "-" if c["updates_before_detection"] is None else str(c["updates_before_detection"]),
                "yes" if ok else "NO",
            ))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for r in rows:
            click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        escapes = [c for c in matrix["cases"] if c["caught_by"] is None]
        if escapes:
            click.echo(f"{len(escapes)} escape(s): a one-time finite fault between audits is averaged into every replica; no later check can see it.")
        notes = {n for c in matrix["cases"] for n in c["notes"]}
        for n in sorted(notes):
            click.echo(f"note: {n}")
        if directory:
            click.echo(f"run stores (checkpoints, events.jsonl) kept under {directory}/<fault>-<timing>/")
    sys.exit(EXIT_OK if as_designed else EXIT_FAILED)


@main.command()
@click.option("--dir", "directory", default="certckpt-demo", show_default=True, type=click.Path(file_okay=False), help="Where to leave every artefact (must be new or empty).")
@expected_errors
def demo(directory: str) -> None:
    """The whole story in under 3 minutes on CPU: 3 gloo ranks, a planted fault caught, verdicts,
    an incident, rollback to latest-good, a vault, a restore drill, the timeline picture."""
    from .demo import run_demo

    run_demo(directory, echo=click.echo)


# Command groups living in their own modules register themselves on `main` (they import this module).
from . import envelope_cmd, incident_cmds, plan_cmd, report_cmd, vault_cmds  # noqa: E402,F401

if __name__ == "__main__":  # pragma: no cover
    main()
