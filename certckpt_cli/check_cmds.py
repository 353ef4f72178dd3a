"""``certckpt verify`` and ``certckpt inspect``: one checkpoint file, its bytes and its record, or a
sharded checkpoint directory (``certckpt.dcp``: its manifest and every shard file).

Importing this module, ``verify`` (without ``--deep``) and ``inspect`` never import torch; the
sharded-checkpoint checker is imported only when LOCATION is a directory.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

import click

from certckpt.format.companions import CompanionCheck, check_companions, companion_listing
from certckpt.format.header import printable
from certckpt.format.record import check_header
from certckpt.format.signing import TrustedKeys, trusted_keys_from_env
from certckpt.format.verify import ProblemKind
from certckpt.format.verify import inspect as run_inspect
from certckpt.format.verify import verify as run_verify

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Progress,
    echo_table,
    expected_errors,
    fail,
    human_bytes,
    no_mmap_option,
    trusted_keys_option,
)


def _is_directory(location: str) -> bool:
    """A sharded checkpoint is a directory (or, on an object store, a prefix holding a manifest).

    A ``.safetensors`` name is a file without asking the store; a store that cannot be asked (no
    credentials, no endpoint) answers "not a directory", and reading the file then says why in one line.
    """
    if location.endswith(".safetensors"):
        return False
    if "://" not in location or location.startswith("file://"):
        return os.path.isdir(location.removeprefix("file://"))
    from certckpt.format.sharded.layout import is_directory  # fsspec: only for URLs

    try:
        return is_directory(location)
    except Exception:  # botocore's own types for missing credentials or an unreachable endpoint
        return False


def _listing_of(location: str) -> tuple[str, dict] | None:
    """The certified file of a local directory-shaped checkpoint (a Trainer checkpoint-N/) and what it
    lists, or None. A sharded checkpoint's manifest may list companion files too (Megatron's common
    state beside the shards): that directory is checked as a sharded one, shards and companions."""
    if "://" in location:
        return None
    from certckpt.format.sharded.layout import MANIFEST_MARK
    from certckpt.format.verify import inspect as inspect_file

    listing = companion_listing(location.removeprefix("file://"))
    # a Trainer's listing file is named manifest.safetensors too: the sharded manifest is told by its mark
    if listing is None or inspect_file(listing[0]).record.user.get(MANIFEST_MARK) is not None:
        return None
    return listing


def _verify_sharded(location: str, deep: bool, as_json: bool, progress: Progress, keys: TrustedKeys | None) -> NoReturn:
    from certckpt.format.sharded.check import verify_checkpoint  # only for directories: keeps the file path light

    report = verify_checkpoint(location, deep=deep, progress=progress, trusted_keys=keys)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    elif report.ok:
        rec, manifest = report.record, report.manifest
        assert rec is not None and manifest is not None  # a sharded checkpoint that verifies has both
        what = ", ".join(
            x for x in (f"run {rec.run}" if rec.run else "", f"step {rec.step}" if rec.step is not None else "") if x
        )
        click.echo(
            f"OK  {location}  sharded: {report.files} files, {report.tensors} tensors in {report.chunks} chunks,"
            f" {human_bytes(report.nbytes)}{', ' + what if what else ''}, state fp {manifest.state_fp}"
            f"{', fingerprints recomputed' if deep else ''} ({report.seconds:.2f} s)"
        )
    else:
        click.echo(f"FAILED  {location}")
        for p in report.problems:
            click.echo(f"  {p.message}")
    sys.exit(EXIT_OK if report.ok else EXIT_FAILED)


@click.command()
@click.argument("location")
@click.option("--deep", is_flag=True, help="Also recompute every tensor's device fingerprint (imports torch).")
@click.option(
    "--ledger",
    "ledger_url",
    default=None,
    help="Run store whose ledger certifies it: adds the verdict (exit 1 when suspect).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@no_mmap_option
@trusted_keys_option
@expected_errors
def verify(location: str, deep: bool, ledger_url: str | None, as_json: bool) -> None:
    """Check every byte of the checkpoint at LOCATION (path or fsspec URL)."""
    # --deep reads at fingerprint speed (a few GB/s, not tens): show progress from 256 MB on
    threshold = 256 << 20 if deep else 1 << 30
    keys = trusted_keys_from_env()  # --trusted-keys stands for the variable (common.trusted_keys_option)
    if _is_directory(location):
        # a directory-shaped checkpoint (a Trainer checkpoint-N/): its certified file and every companion
        listing = _listing_of(location)
        marker = listing[0] if listing is not None else None
        if marker is None:
            if ledger_url:
                fail("verify --ledger takes a checkpoint file; for a sharded checkpoint use certckpt status", 2)
            _verify_sharded(location, deep, as_json, Progress(f"verifying {location}", threshold=threshold), keys)
        location = marker
    report = run_verify(
        location,
        deep=deep,
        progress=Progress(f"verifying {location}", threshold=threshold),
        trusted_keys=keys,
    )
    companions = CompanionCheck()
    if report.info is not None and not report.problems:
        # a file whose record lists companion files (a Trainer manifest): they are part of what it certifies
        companions = check_companions(location, report.info.record, trusted_keys=keys)
        for problem in companions.problems:
            report.fail(ProblemKind.COMPANION, problem)
    verdict = _ledger_verdict(location, ledger_url, report) if ledger_url else None
    if verdict is not None and report.ok and verdict["verdict"] == "suspect":
        report.ok = False
    if as_json:
        doc = {**report.to_dict(), **_companions_json(report, companions)}
        if verdict is not None:
            doc["verdict"] = verdict
        click.echo(json.dumps(doc, indent=2))
    elif report.ok:
        assert report.info is not None  # a file that verifies has a header and a record
        rec = report.info.record
        what = ", ".join(
            x for x in (f"run {rec.run}" if rec.run else "", f"step {rec.step}" if rec.step is not None else "") if x
        )
        click.echo(
            f"OK  {location}  {_checked_summary(location, report, companions)}"
            f"{', ' + what if what else ''}, state fp {rec.state_fp}"
            f"{', fingerprints recomputed' if deep else ''} ({report.seconds:.2f} s)"
        )
        if verdict is not None:
            click.echo(f"    verdict: {verdict['verdict']} ({verdict['ckpt_id']})")
        whole = _member_of(location)
        if whole is not None:
            click.echo(
                f"    this file only: it is part of the checkpoint {whole}; `certckpt verify {whole}` checks all of it"
            )
    elif verdict is not None and not report.problems:
        click.echo(
            f"SUSPECT  {location}  bytes verify, but {verdict['ckpt_id'] or 'it'} is certified suspect: "
            f"{', '.join(verdict['reasons'])}"
        )
    else:
        click.echo(f"FAILED  {location}")
        for p in report.problems:
            click.echo(f"  {p.message}")
        if verdict is not None:
            reasons = ", ".join(verdict["reasons"]) or "-"
            click.echo(f"  verdict: {verdict['verdict']} ({verdict['ckpt_id']}): {reasons}")
    sys.exit(EXIT_OK if report.ok else EXIT_FAILED)


def _companions_json(report, companions: CompanionCheck) -> dict:
    """``--json``'s account of a checkpoint directory: every companion file verified, and the totals."""
    if not companions.verified and not companions.problems:
        return {}
    return {
        "companions": [c.to_dict() for c in companions.verified],
        "total": {
            "files": 1 + len(companions.verified),
            "tensors": report.tensors + sum(c.tensors for c in companions.verified),
            "bytes": report.nbytes + sum(c.nbytes for c in companions.verified),
        },
    }


def _checked_summary(location: str, report, companions: CompanionCheck) -> str:
    """What was verified, in words: the file's tensors and bytes, and for a checkpoint directory
    every file its record lists too (each certified one whole, each plain one by its digests)."""
    if not companions.verified:
        return f"{report.tensors} tensors, {human_bytes(report.nbytes)}"
    certified = [c for c in companions.verified if c.certified]
    plain = [c for c in companions.verified if not c.certified]
    tensors = report.tensors + sum(c.tensors for c in certified)
    nbytes = report.nbytes + sum(c.nbytes for c in companions.verified)
    parts = [f"{os.path.basename(location)} ({report.tensors} tensors)"]
    if certified:
        parts.append(f"{', '.join(c.name for c in certified)} ({sum(c.tensors for c in certified)} tensors)")
    if plain:
        parts.append(f"{', '.join(c.name for c in plain)} (digests)")
    return (
        f"{1 + len(companions.verified)} files, {tensors} tensors, {human_bytes(nbytes)} verified: {'; '.join(parts)}"
    )


def _member_of(location: str) -> str | None:
    """The directory-shaped checkpoint a local file is a companion of (its certified file lists it),
    or None."""
    if "://" in location:
        return None
    listing = companion_listing(os.path.dirname(os.path.abspath(location)))
    if listing is None or os.path.abspath(listing[0]) == os.path.abspath(location):
        return None
    return (os.path.dirname(location) or ".") if os.path.basename(location) in listing[1] else None


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
            return {
                "ckpt_id": cid,
                "trusted": v.trusted and report.ok,
                "verdict": v.label if report.ok else "suspect",  # trusted, verified (no audit evidence), suspect
                "reasons": reasons,
            }
    return {"ckpt_id": None, "trusted": False, "verdict": "suspect", "reasons": ["uncommitted"]}


def _ledger_coverage(location: str, ledger_url: str) -> dict:
    """The verdict and coverage the store's ledger gives the checkpoint at ``location`` (by its URL)."""
    from certckpt.trust.runstore import certify_store

    status = certify_store(ledger_url, write_certificates=False)
    want = os.path.abspath(location) if "://" not in location else location
    for entry in status.snapshot.checkpoints:
        have = os.path.abspath(entry.url) if "://" not in entry.url else entry.url
        if have == want:
            v = status.certification.verdicts[entry.ckpt_id]
            cov = status.coverage()[entry.ckpt_id]
            return {
                "ckpt_id": entry.ckpt_id,
                "verdict": v.label,
                "reasons": list(v.reasons),
                "coverage": cov.to_json(),
                "coverage_text": cov.summary(),
            }
    return {"ckpt_id": None, "verdict": "suspect", "reasons": ["uncommitted"], "coverage": None}


@click.command()
@click.argument("location")
@click.option("--json", "as_json", is_flag=True, help="Print the header as JSON.")
@click.option(
    "--ledger",
    "ledger_url",
    default=None,
    help="The run store that committed LOCATION: also show its verdict and audit coverage.",
)
@expected_errors
def inspect(location: str, as_json: bool, ledger_url: str | None = None) -> None:
    """Show the tensor table and certckpt record of LOCATION without reading the data."""
    companions = None
    if _is_directory(location):
        # a directory-shaped checkpoint (a Trainer checkpoint-N/): its certified file, and what it lists
        listing = _listing_of(location)
        if listing is None:
            _inspect_sharded(location, as_json)
            return
        location, companions = listing
    info = run_inspect(location)
    rec = info.record
    # What verify would reject in the header is reported, and exits 1, here too: inspect shows a
    # damaged header but never passes it off as sound.
    problem = check_header(info.header, info.record)
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
            "problem": problem,
        }
        if ledger_url is not None:
            doc["ledger"] = _ledger_coverage(location, ledger_url)
        if companions is not None:
            doc["companions"] = [{"name": n, **e} for n, e in sorted(companions.items())]
        click.echo(json.dumps(doc, indent=2))
        sys.exit(EXIT_FAILED if problem else EXIT_OK)
    click.echo(
        f"{printable(info.source)}: certckpt schema {rec.schema}, {len(info.header.entries)} tensors,"
        f" {human_bytes(info.nbytes)}"
    )
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
            click.echo(f"  {label:<16} {printable(str(value))}")
    rows = [
        (
            printable(e.name),  # names come from the file: no newline or terminal escape reaches the screen
            e.dtype,
            "x".join(map(str, e.shape)) or "scalar",
            human_bytes(e.nbytes),
            rec.tensors[e.name]["fp"],
        )
        for e in info.header.entries
    ]
    if ledger_url is not None:
        found = _ledger_coverage(location, ledger_url)
        if found["ckpt_id"] is None:
            click.echo(f"  {'verdict':<16} not committed to {printable(ledger_url)}")
        else:
            reasons = f" ({', '.join(found['reasons'])})" if found["reasons"] else ""
            click.echo(f"  {'verdict':<16} {found['ckpt_id']}: {found['verdict']}{reasons}")
            click.echo(f"  {'coverage':<16} {printable(found['coverage_text'])}")
    echo_table(("tensor", "dtype", "shape", "size", "fingerprint"), rows, indent="  ")
    if companions:
        click.echo(f"  companion files (certified with it; `certckpt verify {os.path.dirname(location)}` checks them):")
        listed = [
            (printable(n), human_bytes(e["bytes"]), "certified" if "header_digest" in e else "bytes digested")
            for n, e in sorted(companions.items())
        ]
        echo_table(("file", "size", "bound by"), listed, indent="  ")
    if problem:
        fail(f"{info.source}: {problem}", EXIT_FAILED)


def _inspect_sharded(location: str, as_json: bool) -> None:
    from certckpt.format.sharded.check import inspect_checkpoint  # only for directories: keeps the file path light

    m, rec = inspect_checkpoint(location)
    if as_json:
        doc = {
            "source": location,
            "sharded": True,
            "run": rec.run,
            "step": rec.step,
            "state_fp": m.state_fp,
            "writer": rec.writer,
            "metadata": {k: v for k, v in rec.user.items() if not k.startswith("certckpt.")},
            "files": [
                {"name": f.name, "rank": f.rank, "bytes": f.nbytes, "header_digest": f.header_digest} for f in m.files
            ],
            "tensors": [
                {
                    "fqn": t.fqn,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "bytes": t.nbytes,
                    "chunks": len(t.chunks),
                    "fp": t.fp,
                }
                for t in m.tensors
            ],
            "values": [v.fqn for v in m.values],
        }
        click.echo(json.dumps(doc, indent=2))
        return
    total = sum(f.nbytes for f in m.files)
    click.echo(
        f"{location}: sharded certckpt checkpoint, {len(m.files)} shard files, {len(m.tensors)} tensors,"
        f" {len(m.values)} values, {human_bytes(total)}"
    )
    for label, value in (
        ("run", rec.run),
        ("step", rec.step),
        ("state fp", m.state_fp),
        ("written", f"{rec.writer.get('time')} on {rec.writer.get('host')} (torch {rec.writer.get('torch')})"),
    ):
        if value is not None:
            click.echo(f"  {label:<16} {value}")
    echo_table(("file", "rank", "size"), [(f.name, str(f.rank), human_bytes(f.nbytes)) for f in m.files], indent="  ")
    rows = [
        (t.fqn, t.dtype, "x".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes), str(len(t.chunks)), t.fp)
        for t in m.tensors
    ]
    echo_table(("tensor", "dtype", "shape", "size", "chunks", "fingerprint"), rows, indent="  ")
