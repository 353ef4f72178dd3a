"""``certckpt run -- LAUNCHER ...``: run a training launcher and let the scheduler see exit 86.

``torchrun`` (and other launchers) exit 1 when any worker fails, whatever the worker's own status, so
a scheduler cannot tell a detected hardware fault from a crash. This wrapper gives the ranks a
directory (``$CERTCKPT_DETECTION_DIR``) where ``stop_on_fault`` leaves a marker on a detection; when
the launcher fails and a marker is there, it exits 86 (``EXIT_FAULT_DETECTED``) and says which
incident and ranks; otherwise it exits with the launcher's own status.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import click

from .common import fail

_EXIT_FAULT_DETECTED = 86  # certckpt.trust.incident.EXIT_FAULT_DETECTED, without importing the library


def _markers(directory: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("detection-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(command: tuple[str, ...]) -> None:
    """Run COMMAND (a launcher: torchrun, srun, python ...); exit 86 when it failed on a detected fault.

    Exit codes: the command's own; 86 when it failed and a rank stopped on a detection (an incident is
    open: do not requeue on the suspect node); 127 when the command cannot be started.
    """
    own = os.environ.get("CERTCKPT_DETECTION_DIR")
    directory = own or tempfile.mkdtemp(prefix="certckpt-run-")
    env = dict(os.environ, CERTCKPT_DETECTION_DIR=directory)
    try:
        try:
            proc = subprocess.Popen(list(command), env=env)
        except OSError as e:
            fail(f"cannot start {command[0]!r}: {e.strerror or e}", 127)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:  # the launcher got the same SIGINT from the terminal: wait for it
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
        markers = _markers(directory) if rc != 0 else []
    finally:
        if own is None:
            shutil.rmtree(directory, ignore_errors=True)
    if markers:
        incidents = sorted({m.get("incident") or "contained" for m in markers})
        suspects = sorted({r for m in markers for r in m.get("suspect_ranks") or [] if isinstance(r, int)})
        nodes = sorted({n for m in markers for n in m.get("nodes") or [] if isinstance(n, str)})
        click.echo(
            f"certckpt: {command[0]} exited {rc}; {len(markers)} rank(s) stopped on a detected fault "
            f"(incident {', '.join(incidents)}; suspect rank(s) {suspects or 'not attributed'}"
            f"{'; node(s) ' + ', '.join(nodes) if nodes else ''}): exit {_EXIT_FAULT_DETECTED}, do not requeue "
            "on the suspect node",
            err=True,
        )
        sys.exit(_EXIT_FAULT_DETECTED)
    sys.exit(rc if rc >= 0 else 128 - rc)  # a launcher killed by a signal: the shell's convention
