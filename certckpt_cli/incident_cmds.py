"""``certckpt incident ls|show|decide``: thin wrappers over certckpt.trust.incident."""

from __future__ import annotations

import json
import sys

import click

from .common import EXIT_FAILED, echo_table, expected_errors


@click.group()
def incident() -> None:
    """Incidents opened by uncontained detections, and the decisions taken on them.

    Records are write-once: a decision is a new record, never an edit.
    """


@incident.command("ls")
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def incident_ls(store: str, as_json: bool) -> None:
    """Every incident of STORE with its status."""
    from certckpt.trust.runstore import list_incidents

    incs = list_incidents(store)
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in incs], indent=2))
        return
    if not incs:
        click.echo("no incidents")
        return
    rows = []
    for i in incs:
        o = i.opened
        rows.append(
            (
                i.incident_id,
                i.status,
                o["branch"],
                str(o["detected_step"]),
                o["signature"]["check"],
                ",".join(map(str, o["suspect_ranks"])) or "-",
                ",".join(o.get("suspect_nodes", [])) or "-",
                i.rollback_to or "-",
            )
        )
    echo_table(("incident", "status", "branch", "step", "check", "ranks", "nodes", "rollback to"), rows)


@incident.command("show")
@click.argument("store")
@click.argument("incident_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def incident_show(store: str, incident_id: str, as_json: bool) -> None:
    """Everything recorded about INCIDENT_ID: evidence, where the ranks ran, decisions; and the
    store's latest-good now beside the one recorded at the detection (a later conviction, revocation
    or incident may have changed it)."""
    from certckpt.trust.runstore import get_incident

    i = get_incident(store, incident_id)
    now = _latest_good_now(store, (i.opened.get("checkpoints") or {}).get("latest_good"))
    if as_json:
        click.echo(json.dumps({**i.to_dict(), "latest_good_now": now}, indent=2))
        return
    o = i.opened
    sig = o["signature"]
    click.echo(f"{i.incident_id}  [{i.status}]  run {o.get('run')}, branch {o['branch']}")
    click.echo(f"  detected        step {o['detected_step']} by the {sig['check']} check")
    if o.get("suspect_interval"):
        c, d = o["suspect_interval"]
        click.echo(f"  suspect steps   ({c}, {d}]: {d - c} updates")
    click.echo(f"  suspect ranks   {', '.join(map(str, o['suspect_ranks'])) or 'not attributed'} of {len(o['ranks'])}")
    if sig.get("tensors"):
        click.echo(f"  tensors         {', '.join(sig['tensors'][:8])}{' ...' if len(sig['tensors']) > 8 else ''}")
    for k, v in (sig.get("details") or {}).items():
        if v not in ({}, [], None, ""):
            click.echo(f"  {k:<15} {json.dumps(v, sort_keys=True)[:160]}")
    ck = o.get("checkpoints", {})
    click.echo(f"  latest-good     {ck.get('latest_good') or 'none'} (recorded at the detection)")
    click.echo(f"  latest-good now {_now_line(ck.get('latest_good'), now)}")
    click.echo(f"  made suspect    {', '.join(ck.get('made_suspect', [])) or 'none'}")
    for rank, inv in sorted((o.get("inventory") or {}).items(), key=lambda kv: int(kv[0])):
        mark = " (suspect)" if int(rank) in o["suspect_ranks"] else ""
        click.echo(f"  rank {rank:<10} " + ", ".join(f"{k}={v}" for k, v in sorted(inv.items())) + mark)
    if not i.decisions:
        click.echo("  decisions       none yet")
    for d in i.decisions:
        extra = " ".join(f"{k}={d[k]}" for k in ("ckpt", "approves", "drill") if d.get(k))
        nodes = f" nodes={','.join(d['nodes'])}" if d.get("nodes") else ""
        click.echo(
            f"  decision        {d['action']} by {d['by']}: {d['reason']}"
            f"{(' ' + extra) if extra else ''}{nodes}  [{d['decision_id']}]"
        )
    for d in i.pending_approvals():
        click.echo(f"  awaiting approval: {d['decision_id']}")


def _latest_good_now(store: str, recorded: str | None) -> dict[str, object]:
    """The store's latest-good as certified now, and what the recorded one is now (``why``: the
    certify failed, the answer is unknown)."""
    from certckpt.errors import CertckptError
    from certckpt.trust.runstore import certify_store

    try:
        status = certify_store(store, write_certificates=False)
    except (CertckptError, OSError) as e:
        return {"ckpt": None, "why": str(e).splitlines()[0][:300]}
    out: dict[str, object] = {"ckpt": status.latest_good}
    v = status.certification.verdicts.get(recorded) if recorded else None
    if v is not None:
        out["recorded_verdict"], out["recorded_reasons"] = v.label, list(v.reasons)
    return out


def _now_line(recorded: str | None, now: dict[str, object]) -> str:
    if "why" in now:
        return f"unknown: {now['why']}"
    ckpt = now["ckpt"] or "none"
    if now["ckpt"] == recorded:
        return f"{ckpt} (unchanged)"
    found = now.get("recorded_reasons")
    reasons = ", ".join(map(str, found)) if isinstance(found, list) else ""
    was = f"; {recorded} is {now.get('recorded_verdict')}{': ' + reasons if reasons else ''}" if recorded else ""
    return f"{ckpt} (changed since the detection{was})"


@incident.command("decide")
@click.argument("store")
@click.argument("incident_id")
@click.option(
    "--action",
    required=True,
    type=click.Choice(["quarantine", "rollback", "replace", "return-to-service", "approve", "resolve", "close"]),
)
@click.option("--by", required=True, help="Who decides.")
@click.option("--reason", required=True, help="Why.")
@click.option("--ckpt", default=None, help="rollback: the trusted checkpoint training restarts from.")
@click.option(
    "--node", default=None, help="quarantine/replace/return-to-service: the node (default: the suspect nodes)."
)
@click.option("--approves", default=None, help="approve: the decision id approved (someone other than its proposer).")
@click.option(
    "--drill",
    default=None,
    help="close: the passing restore drill's id (printed by `certckpt drill restore`), or 'latest'.",
)
@click.option("--vault", default=None, help="close: the vault where the drill was recorded.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@expected_errors
def incident_decide(store, incident_id, action, by, reason, ckpt, node, approves, drill, vault, as_json) -> None:
    """Record a decision on INCIDENT_ID (exit 1 when the rules refuse it, saying what is missing).

    resolve needs a rollback decision naming the checkpoint to restart from and every replace /
    return-to-service approved; close needs a passing restore drill run after the incident opened.
    """
    from certckpt.errors import IncidentError
    from certckpt.trust.runstore import decide

    try:
        doc = decide(
            store,
            incident_id,
            action=action,
            by=by,
            reason=reason,
            ckpt=ckpt,
            node=node,
            approves=approves,
            drill=drill,
            vault=vault,
        )
    except IncidentError as e:
        click.echo(f"certckpt: refused: {e}", err=True)
        sys.exit(EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(f"recorded {action} on {incident_id} by {by}  [{doc['decision_id']}]")
