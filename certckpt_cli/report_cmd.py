"""``certckpt report``: a thin wrapper over certckpt.ops.report (the run timeline as a picture or a page)."""

from __future__ import annotations

import os

import click

from .common import expected_errors


@click.command("report", short_help="Draw the timeline of STORE: branches, verdicts, audits, detections, latest-good.")
@click.argument("store")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Where to write the report: .svg, .png (the same picture), or .html (the picture plus tables of verdicts "
    "and detections).",
)
@click.option("--json", "as_json", is_flag=True, help="Also print the timeline as JSON on stdout.")
@click.option("--force", is_flag=True, help="Overwrite --out if it exists.")
@expected_errors
def report(store: str, out: str, as_json: bool, force: bool) -> None:
    """Draw the timeline of the run store STORE: per branch, its checkpoints with their verdicts,
    the audits, the detections with the ranks they name, the suspect intervals, the forks, and
    latest-good. A .png is the same picture as the .svg, painted with matplotlib (pip install
    'certckpt[report]'); .svg and .html need nothing more. Reads the store, writes nothing there.

    Exit 0 when written; 2 when the store cannot be read or the file cannot be written.
    """
    from certckpt.errors import CheckpointNotFoundError, ConfigurationError
    from certckpt.ops.report import check_format, render, timeline
    from certckpt.trust.runstore import certify_store

    check_format(out)
    if os.path.exists(out) and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigurationError(f"--out {out}: no such directory {parent}")
    status = certify_store(store, write_certificates=False)
    snap = status.snapshot
    if not snap.checkpoints and not snap.events:
        raise CheckpointNotFoundError(f"{store}: no ledger records to report (no committed checkpoint, no audit event)")
    tl = timeline(status)
    render(tl, out)
    line = f"wrote {out}: timeline of {tl.run or store}: {tl.summary()}"
    if as_json:
        click.echo(tl.to_json())
        click.echo(line, err=True)
    else:
        click.echo(line)
