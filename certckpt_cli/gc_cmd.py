"""``certckpt gc``: list, and with --apply remove, the temp files killed writers left in a store."""

from __future__ import annotations

import json

import click

from .common import echo_table, expected_errors, human_bytes


@click.command("gc")
@click.argument("store")
@click.option(
    "--older-than",
    "older_than",
    type=click.FloatRange(0),
    default=60.0,
    show_default=True,
    help="Minutes: younger temp files may belong to a write in progress.",
)
@click.option("--apply", is_flag=True, help="Remove them (without it: a dry run that only lists them).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def gc(store: str, older_than: float, apply: bool, as_json: bool) -> None:
    """Temp files of killed writers in STORE (never a checkpoint or a record): list, or remove with --apply."""
    from certckpt.format.tempfiles import find_temps, remove_temps

    temps = find_temps(store, older_than_s=older_than * 60)
    removed = remove_temps(temps) if apply else []
    if as_json:
        click.echo(
            json.dumps(
                {
                    "store": store,
                    "applied": apply,
                    "removed": removed,
                    "temps": [{"path": t.path, "bytes": t.nbytes, "age_s": round(t.age_s)} for t in temps],
                },
                indent=2,
            )
        )
        return
    if temps:
        echo_table(
            ("temp file", "size", "age"), [(t.path, human_bytes(t.nbytes), f"{t.age_s / 60:.0f} min") for t in temps]
        )
    total = human_bytes(sum(t.nbytes for t in temps))
    if not temps:
        click.echo(f"no temp file older than {older_than:g} min")
    elif apply:
        click.echo(f"removed {len(removed)} temp file(s), {total}")
    else:
        click.echo(f"dry run: pass --apply to remove {len(temps)} temp file(s), {total}")
