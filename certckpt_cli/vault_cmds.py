"""``certckpt vault ...``: thin wrappers over certckpt.vault (print, map errors to exit codes)."""

from __future__ import annotations

import json
import sys

import click

from .common import (
    COPY_PROGRESS,
    EXIT_FAILED,
    EXIT_OK,
    Progress,
    echo_table,
    expected_errors,
    human_bytes,
    trusted_keys_option,
)


@click.group()
def vault() -> None:
    """The off-node vault: promote trusted checkpoints, list, prune, restore.

    A vault is any fsspec URL (a mounted share, s3://bucket/prefix) holding one run's known-good
    checkpoints, write-once, with the evidence that certifies them.
    """


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:.1f} MB/s" if seconds > 0 else "-"


@vault.command("promote")
@click.argument("run_url")
@click.argument("vault_url")
@click.option(
    "--ckpt",
    "ckpts",
    multiple=True,
    help="Promote this checkpoint id (repeatable); default every trusted one the vault lacks.",
)
@click.option(
    "--lock-mode",
    type=click.Choice(["auto", "none", "GOVERNANCE", "COMPLIANCE"]),
    default="auto",
    show_default=True,
    help="S3 Object Lock retention per object (auto: GOVERNANCE when the bucket has Object Lock).",
)
@click.option(
    "--retain-days",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Object Lock retention from now.",
)
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict promoted: verified also takes checkpoints of a run without the auditor.",
)
@click.option(
    "--repair",
    is_flag=True,
    help="Also re-read every copy the vault holds and replace damaged or missing ones from RUN_URL.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def vault_promote(
    run_url: str,
    vault_url: str,
    ckpts: tuple[str, ...],
    lock_mode: str,
    retain_days: float,
    accept: str,
    repair: bool,
    as_json: bool,
) -> None:
    """Copy trusted checkpoints of RUN_URL into VAULT_URL, read them back and verify them.

    Exit 0 when done (also when there was nothing new); 1 when a requested checkpoint is suspect
    (or only verified, without --accept verified); 2, before anything is copied, when trusted keys are
    configured and CERTCKPT_SIGNING_KEY is unset or not one of them (the vault's records would certify
    nothing).
    """
    from certckpt.vault import promote

    done = promote(
        run_url,
        vault_url,
        ckpts=list(ckpts) or None,
        lock_mode=lock_mode,
        retain_days=retain_days,
        progress=Progress(f"promoting to {vault_url}", threshold=COPY_PROGRESS),
        accept=accept,
        repair=repair,
    )
    if as_json:
        click.echo(json.dumps({"run": run_url, "vault": vault_url, "promoted": [p.to_dict() for p in done]}, indent=2))
        return
    if not done:
        from certckpt.trust.runstore import certify_store

        wanted = "trusted" if accept == "trusted" else "trusted or verified"
        if not certify_store(run_url, write_certificates=False).certification.candidates(accept):
            click.echo(
                f"nothing to promote: no checkpoint of {run_url} is {wanted} yet (see `certckpt status {run_url}`)"
            )
        else:
            click.echo(f"nothing to promote: every {wanted} checkpoint of {run_url} is already in {vault_url}")
        return
    rows = []
    for p in done:
        lock = p.lock or {}
        lock_text = (
            f"{lock['mode']} until {lock['retain_until'][:19]}"
            if lock.get("retain_until")
            else lock.get("mode", "none")
        )
        rows.append(
            (
                p.ckpt_id,
                human_bytes(p.nbytes),
                "repaired (was: damaged)" if p.repaired else "copied, verified" if p.written else "already there",
                _rate(p.nbytes, p.seconds),
                lock_text,
            )
        )
    echo_table(("checkpoint", "size", "result", "speed", "protection"), rows)


@vault.command("ls")
@click.argument("vault_url")
@click.option(
    "--verify",
    is_flag=True,
    help="Re-read every held copy and count its S3 versions and delete markers; exit 1 when one is wrong.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def vault_ls(vault_url: str, verify: bool, as_json: bool) -> None:
    """What VAULT_URL holds, with each checkpoint's verdict now (* marks latest-good)."""
    from certckpt.vault import holdings

    status, rows = holdings(vault_url, verify=verify)
    wrong = [r for r in rows if verify and _copy_problem(r)]
    if as_json:
        click.echo(json.dumps({"vault": vault_url, "latest_good": status.latest_good, "checkpoints": rows}, indent=2))
        sys.exit(EXIT_FAILED if wrong else EXIT_OK)
    if not rows:
        click.echo(f"{vault_url}: empty (promote with `certckpt vault promote RUN_URL {vault_url}`)")
        return
    table: list[tuple[str, ...]] = []  # one row per checkpoint; a copy column with --verify
    for r in rows:
        lock = r["lock"] or {}
        table.append(
            (
                r["ckpt_id"] + (" *" if r["ckpt_id"] == status.latest_good else ""),
                str(r["step"]),
                "pruned" if r["pruned"] else r["verdict"],
                ", ".join(r["reasons"]) or "-",
                human_bytes(r["bytes"] or 0),
                (lock.get("mode", "-") + (f" until {lock['retain_until'][:10]}" if lock.get("retain_until") else "")),
            )
        )
        if verify:
            table[-1] += (_copy_text(r),)
    head = ("checkpoint", "step", "verdict", "reasons", "size", "protection")
    echo_table(head + (("copy",) if verify else ()), table)
    click.echo(f"* latest-good: {status.latest_good}" if status.latest_good else "no trusted checkpoint held")
    if wrong:
        click.echo(
            f"{len(wrong)} held cop{'y is' if len(wrong) == 1 else 'ies are'} not as promoted; repair with "
            f"`certckpt vault promote RUN_STORE {vault_url} --repair`",
            err=True,
        )
        sys.exit(EXIT_FAILED)


def _copy_problem(row: dict) -> str | None:
    """What is wrong with a held copy after ``--verify`` (None when its current bytes verify)."""
    if row.get("pruned") or "copy" not in row:
        return None
    v = row.get("versions") or {}
    if v.get("deleted"):
        return f"deleted: a delete marker hides it ({v['versions']} older version(s) kept)"
    return f"damaged: {row['copy']}" if row["copy"] != "ok" else None


def _copy_text(row: dict) -> str:
    v = row.get("versions") or {}
    extra = []
    if v.get("versions", 1) > 1:
        extra.append(f"{v['versions']} versions")
    if v.get("delete_markers") and not v.get("deleted"):
        extra.append(f"{v['delete_markers']} delete marker(s)")
    return (_copy_problem(row) or "ok") + (f" ({', '.join(extra)})" if extra else "")


def _policy(keep_last: int | None, keep_every: int | None, keep_days: float | None, keep_best: tuple[str, ...]):
    from certckpt.vault import AnyOf, KeepBest, KeepEvery, KeepFor, KeepLatest, RetentionPolicy

    parts: list[RetentionPolicy] = []
    if keep_last is not None:
        parts.append(KeepLatest(keep_last))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if keep_days is not None:
        parts.append(KeepFor(keep_days))
    for spec in keep_best:
        metric, _, direction = spec.partition(":")
        if direction not in ("", "min", "max") or not metric:
            raise click.BadParameter(f"{spec!r}: use METRIC, METRIC:min or METRIC:max", param_hint="--keep-best")
        parts.append(KeepBest(metric, higher_is_better=direction == "max"))
    if not parts:
        raise click.UsageError(
            "say what to keep: --keep-last N, --keep-every STEPS, --keep-days D and/or --keep-best METRIC"
        )
    return AnyOf(*parts)


@vault.command("prune")
@click.argument("vault_url")
@click.option("--keep-last", type=click.IntRange(0), default=None, help="Keep the newest N trusted checkpoints.")
@click.option(
    "--keep-every",
    type=click.IntRange(1),
    default=None,
    help="Keep the newest trusted checkpoint in every window of STEPS steps.",
)
@click.option("--keep-days", type=click.FloatRange(0), default=None, help="Keep everything younger than D days.")
@click.option(
    "--keep-best",
    multiple=True,
    help="Keep the best trusted checkpoint by METRIC (saved metadata), METRIC:min (default) or METRIC:max.",
)
@click.option("--apply", is_flag=True, help="Delete (without it: a dry run that only prints the plan).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def vault_prune(vault_url: str, keep_last, keep_every, keep_days, keep_best, apply: bool, as_json: bool) -> None:
    """Delete what no retention policy keeps: a dry run unless --apply.

    Policies combine: a checkpoint stays when any of them keeps it. Latest-good, the rollback target
    before an open suspect interval, and everything while an incident is open are always kept.
    Every copy kept is read back first; a damaged one is reported (exit 1) and --apply deletes nothing.
    """
    from certckpt.vault import prune

    result = prune(vault_url, _policy(keep_last, keep_every, keep_days, keep_best), apply=apply)
    if as_json:
        click.echo(json.dumps({"vault": vault_url, **result.to_dict()}, indent=2))
        sys.exit(EXIT_FAILED if result.refused or result.damaged else EXIT_OK)
    plan = result.plan
    rows = [(cid, "keep", why) for cid, why in plan.keep.items()]
    for cid in plan.delete:
        if not apply:
            rows.append((cid, "would delete", "no policy keeps it"))
        elif cid in result.refused:
            rows.append((cid, "KEPT", f"the store refused: {result.refused[cid]}"))
        else:
            rows.append((cid, "deleted", "no policy keeps it"))

    def order(row):
        branch, _, step = row[0].rpartition("@")
        return (branch, int(step) if step.isdigit() else 0)

    if rows:
        echo_table(("checkpoint", "action", "why"), sorted(rows, key=order))
    click.echo(f"policy: {result.policy}")
    if plan.blocked_by:
        click.echo(f"incident(s) open ({', '.join(plan.blocked_by)}): nothing is deleted until they close")
    for cid, why in result.damaged.items():
        click.echo(f"DAMAGED copy {cid}: {why}; --apply refuses until it is replaced with a good copy")
    if not apply and plan.delete:
        click.echo(f"dry run: pass --apply to delete {len(plan.delete)} checkpoint(s)")
    elif not plan.delete:
        click.echo("nothing to delete")
    sys.exit(EXIT_FAILED if result.refused or result.damaged else EXIT_OK)


@vault.command("restore")
@click.argument("vault_url")
@click.argument("ckpt")
@click.argument("dest")
@click.option("--allow-suspect", is_flag=True, help="Restore a checkpoint that is suspect now (for investigation).")
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict restored: verified also takes checkpoints of a run without the auditor.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def vault_restore(vault_url: str, ckpt: str, dest: str, allow_suspect: bool, accept: str, as_json: bool) -> None:
    """Copy checkpoint CKPT (an id, or latest-good) from VAULT_URL to DEST and verify it.

    DEST is a file path or URL, or a directory (ending in / or existing) to put it in; an existing
    file is never overwritten. A sharded (DCP) checkpoint or a file with companions is a directory:
    DEST is that directory (created), or an existing one to put CKPT/ in; every file is copied and
    verified, the manifest or listing file last, then the whole is checked.
    """
    from certckpt.vault import restore

    r = restore(
        vault_url,
        ckpt,
        dest,
        allow_suspect=allow_suspect,
        progress=Progress(f"restoring {ckpt}", threshold=COPY_PROGRESS),
        accept=accept,
    )
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2))
        return
    what = "restored and verified" if r.written else "already there, verified"
    click.echo(
        f"{r.ckpt_id} -> {r.dest}: {what}, {human_bytes(r.nbytes)} in {r.seconds:.2f} s ({_rate(r.nbytes, r.seconds)})"
    )
