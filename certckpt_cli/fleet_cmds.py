"""``certckpt fleet init|ls|show|appeal|clear|impact|rates``: thin wrappers over certckpt.trust.fleet."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from .common import EXIT_FAILED, EXIT_UNVERIFIABLE, echo_table, expected_errors, fail, trusted_keys_option

_FLEET_ENV = "CERTCKPT_FLEET"  # (certckpt.trust.fleet.FLEET_ENV; not imported: --help stays light)


def _fleet_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--fleet",
        "fleet_url",
        default=None,
        metavar="URL",
        help=f"The fleet registry (a path or fsspec URL; default ${_FLEET_ENV}).",
    )(fn)


def _url(fleet_url: str | None) -> str:
    url = fleet_url or os.environ.get(_FLEET_ENV, "")
    if not url:
        fail(f"name the fleet registry: --fleet URL or ${_FLEET_ENV}", EXIT_UNVERIFIABLE)
    return url


def _warn_view(view: Any) -> None:
    for b in view.breaks:
        click.echo(f"certckpt: tampered: {b}", err=True)
    for note in view.notes:
        click.echo(f"certckpt: note: {note}", err=True)
    if view.invalid:
        click.echo(f"certckpt: {len(view.invalid)} record(s) ignored (see --json 'invalid')", err=True)


@click.group()
def fleet() -> None:
    """The fleet registry: convicted devices, appeals, clearances, what a conviction changes, detection rates."""


@fleet.command("init")
@click.argument("url", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def fleet_init(url: str | None, as_json: bool) -> None:
    """Create the fleet registry at URL (default $CERTCKPT_FLEET) once; exit 0 (also when it exists).

    Runs never create a registry: one that disappears must read as missing, never as empty.
    """
    from certckpt.trust.fleet import Fleet

    fleet_obj = Fleet(_url(url))
    existed = fleet_obj.ledger.genesis_bytes() is not None
    store_id = fleet_obj.create()
    if as_json:
        click.echo(json.dumps({"fleet": fleet_obj.url, "store_id": store_id, "created": not existed}))
        return
    click.echo(f"{'exists' if existed else 'created'}: fleet registry {fleet_obj.url} (id {store_id})")


def _require(view: Any) -> None:
    """A registry that is not there, or cannot vouch for its records, answers nothing (exit 2)."""
    if not view.exists:
        fail(f"no fleet registry at {view.url}; create it with `certckpt fleet init {view.url}`", EXIT_UNVERIFIABLE)


@fleet.command("ls")
@_fleet_option
@click.option("--all", "show_all", is_flag=True, help="Also list cleared devices.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def fleet_ls(fleet_url: str | None, show_all: bool, as_json: bool) -> None:
    """The convicted devices (with --all, the cleared ones too); exit 0."""
    from certckpt.trust.fleet import Fleet

    view = Fleet(_url(fleet_url), signing_key=None).read()
    _require(view)
    if as_json:
        click.echo(json.dumps(view.to_dict(), indent=2))
        return
    _warn_view(view)
    rows = []
    for dev, st in sorted(view.devices.items()):
        if not st.convicted and not show_all:
            continue
        last = st.convictions[-1] if st.convictions else {}
        ev = last.get("evidence") or {}
        signed = "yes" if all(c.get("authenticated") for c in st.convictions) else "NO"
        rows.append(
            (
                dev,
                st.host or "-",
                st.status,
                str(len(st.open_convictions)),
                f"{ev.get('run')}@{ev.get('step')} {ev.get('check')}",
                signed,
                ",".join(a["appeal_id"] for a in st.pending_appeals()) or "-",
            )
        )
    if not rows and view.breaks:
        fail(f"{view.url} is tampered: it cannot show that no device is convicted (see above)", EXIT_UNVERIFIABLE)
    if not rows:
        click.echo(f"no convicted device in {view.url} ({len(view.stores)} store(s) report to it)")
        return
    echo_table(("device", "host", "status", "open", "last evidence", "authenticated", "pending appeal"), rows)


@fleet.command("show")
@click.argument("device")
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def fleet_show(device: str, fleet_url: str | None, as_json: bool) -> None:
    """Everything recorded about DEVICE: its convictions with their evidence, appeals, clearances."""
    from certckpt.errors import CheckpointNotFoundError
    from certckpt.trust.fleet import Fleet

    view = Fleet(_url(fleet_url), signing_key=None).read()
    _require(view)
    st = view.standing(device)
    if st is None:
        raise CheckpointNotFoundError(f"{view.url}: no record names device {device!r} (see `certckpt fleet ls --all`)")
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    _warn_view(view)
    click.echo(f"{device}  [{st.status}]  host {st.host or '?'}")
    for c in st.convictions:
        ev = c.get("evidence") or {}
        mark = "cleared" if c["conviction_id"] in st.cleared else "open"
        auth = "" if c.get("authenticated") else " (unauthenticated)"
        click.echo(
            f"  conviction  {c['conviction_id']} [{mark}]{auth}: {ev.get('check')} at step {ev.get('step')} "
            f"of run {ev.get('run')} branch {ev.get('branch')}, rank {ev.get('rank')}, "
            f"incident {ev.get('incident_id')}, store {ev.get('store')}"
        )
    for a in st.appeals:
        click.echo(f"  appeal      {a['appeal_id']} by {a['by']}: {a['reason']}")
    for cl in st.clearances:
        click.echo(f"  clearance   {cl['clearance_id']} by {cl['by']} approves {cl['approves']}: {cl['reason']}")
    for a in st.pending_appeals():
        click.echo(f"  awaiting clearance: {a['appeal_id']} (someone other than {a['by']}, with their own key)")


def _decided(action: Callable[[], dict[str, Any]], as_json: bool, line: Callable[[dict[str, Any]], str]) -> None:
    from certckpt.errors import FleetError

    try:
        doc = action()
    except FleetError as e:
        click.echo(f"certckpt: refused: {e}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(json.dumps(doc, indent=2) if as_json else line(doc))


@fleet.command("appeal")
@click.argument("device")
@_fleet_option
@click.option("--by", required=True, help="Who appeals.")
@click.option("--reason", required=True, help="Why the convictions should be set aside.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@expected_errors
def fleet_appeal(device: str, fleet_url: str | None, by: str, reason: str, as_json: bool) -> None:
    """Appeal DEVICE's open convictions (exit 1 when it has none). Nothing changes until someone
    else clears it with `certckpt fleet clear DEVICE --approves APPEAL_ID`."""
    from certckpt.trust.fleet import Fleet

    f = Fleet(_url(fleet_url))
    _decided(
        lambda: f.appeal(device, by=by, reason=reason),
        as_json,
        lambda d: f"recorded appeal {d['appeal_id']} of {len(d['convictions'])} conviction(s) of {device} by {by}",
    )


@fleet.command("clear")
@click.argument("device")
@_fleet_option
@click.option("--approves", required=True, help="The appeal id approved (filed by someone else).")
@click.option("--by", required=True, help="Who clears.")
@click.option("--reason", required=True, help="Why.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as JSON.")
@expected_errors
def fleet_clear(device: str, fleet_url: str | None, approves: str, by: str, reason: str, as_json: bool) -> None:
    """Clear DEVICE by approving an appeal (exit 1 when the rules refuse: the appellant's own name
    or key). With trusted keys, only a clearance signed by a trusted key counts."""
    from certckpt.trust.fleet import Fleet

    f = Fleet(_url(fleet_url))
    _decided(
        lambda: f.clear(device, approves=approves, by=by, reason=reason),
        as_json,
        lambda d: f"cleared {device}: {d['clearance_id']} by {by} approves {approves}",
    )


@fleet.command("impact")
@click.argument("device")
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@trusted_keys_option
@expected_errors
def fleet_impact(device: str, fleet_url: str | None, as_json: bool) -> None:
    """The checkpoints of every registered store that a conviction of DEVICE makes suspect
    (`device-convicted`), before the conviction is recorded and after; reads only, writes nothing.
    Exit 0; 2 when a registered store cannot be read (the list may be incomplete)."""
    from certckpt.trust.fleetscan import impact

    out = impact(_url(fleet_url), device)
    if as_json:
        click.echo(json.dumps(out.to_dict(), indent=2))
    else:
        _print_impact(out)
    if out.unreadable:
        fail(
            f"{len(out.unreadable)} registered store(s) could not be read: the checkpoints they hold are not "
            "in this answer",
            EXIT_UNVERIFIABLE,
        )


def _print_impact(out: Any) -> None:
    for u in out.unreadable:
        click.echo(f"certckpt: cannot read store {u['store']}: {u['why']}", err=True)
    device = out.device
    if out.already_convicted:
        state, verb = "convicted", "are suspect because of its conviction"
    else:
        state, verb = "not convicted now", "become suspect if it is convicted"
    if not out.changes:
        scope = "the readable registered stores" if out.unreadable else "the registered stores"
        click.echo(f"{device} ({state}): no checkpoint of {scope} ran on it in an unaudited interval")
        return
    rows = [
        (c["store"], c["ckpt_id"], c["verdict_without"], c["verdict"], "suspect: " + ", ".join(c["reasons_with"]))
        for c in out.changes
    ]
    click.echo(f"{device} ({state}): {len(rows)} checkpoint(s) {verb}")
    echo_table(("store", "checkpoint", "without it", "now", "with it"), rows)


@fleet.command("rates")
@_fleet_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also draw the rates (.svg or .png).")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@trusted_keys_option
@expected_errors
def fleet_rates_cmd(fleet_url: str | None, as_json: bool, out: str | None, force: bool) -> None:
    """Detections per million device-steps, per device and per host (steps from the registered
    stores' placements; each rank computes every step of its run)."""
    from certckpt.trust.fleetscan import fleet_rates

    if out is not None and os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    doc = fleet_rates(_url(fleet_url))
    for u in doc["unreadable"]:
        click.echo(f"certckpt: cannot read store {u['store']}: {u['why']}", err=True)
    if out is not None:
        from certckpt.ops.fleet_chart import render_rates

        render_rates(doc, out)
        click.echo(f"wrote {out}", err=True)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        _rates_complete(doc)
        return

    def rate(r: dict[str, Any]) -> str:
        return "-" if r["per_million"] is None else f"{r['per_million']:.1f}"

    def counts(r: dict[str, Any]) -> tuple[str, str, str]:
        return str(r["detections"]), str(r["device_steps"]), rate(r)

    device_rows: list[tuple[str, ...]] = [(str(r["device"]), str(r["host"] or "-"), *counts(r)) for r in doc["devices"]]
    host_rows: list[tuple[str, ...]] = [(str(r["host"] or "-"), *counts(r)) for r in doc["hosts"]]
    echo_table(("device", "host", "detections", "device-steps", "per million"), device_rows)
    click.echo("")
    echo_table(("host", "detections", "device-steps", "per million"), host_rows)
    _rates_complete(doc)


def _rates_complete(doc: dict[str, Any]) -> None:
    """Exit 2 when a registered store could not be read: its device-steps are missing from the rates."""
    if doc["unreadable"]:
        fail(
            f"{len(doc['unreadable'])} registered store(s) could not be read: their device-steps are missing",
            EXIT_UNVERIFIABLE,
        )
