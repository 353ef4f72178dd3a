"""``certckpt run -- LAUNCHER ...``: run a training launcher and let the scheduler see exit 86.

``torchrun`` (and other launchers) exit 1 when any worker fails, whatever the worker's own status, so
a scheduler cannot tell a detected hardware fault from a crash. This wrapper gives the ranks a fresh
directory (``$CERTCKPT_DETECTION_DIR``) where ``stop_on_fault`` leaves a marker on a detection, and a
fresh launch id (``$CERTCKPT_LAUNCH_ID``) the marker carries; when the launcher fails and a marker of
this launch is there, it exits 86 (``EXIT_FAULT_DETECTED``) and says which incident and ranks, or
87 (``EXIT_DEVICE_REFUSED``) when the ranks were refused at the start because a device is convicted
in the fleet registry (the refusal leaves its own marker); otherwise it exits with the launcher's
own status.

Markers are read as untrusted input, like ledger records: only regular files (``lstat`` first, then
opened without following links and without blocking, so a FIFO, a device, a socket or a link is never
read), at most ``MAX_MARKER_BYTES``, JSON nested too deep refused, every field type-checked. A marker
that fails is reported on one line and ignored; it never hides a well-formed one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Any

import click

from .common import EXIT_UNVERIFIABLE, fail

_EXIT_FAULT_DETECTED = 86  # certckpt.trust.incident.EXIT_FAULT_DETECTED, without importing the library
_EXIT_DEVICE_REFUSED = 87  # certckpt.trust.incident.EXIT_DEVICE_REFUSED: refused on a convicted device
DETECTION_DIR_ENV = "CERTCKPT_DETECTION_DIR"  # certckpt.detect.stop's names, without importing it
LAUNCH_ID_ENV = "CERTCKPT_LAUNCH_ID"
MAX_MARKER_BYTES = 1 << 20  # a marker is a few hundred bytes (a 10,000-rank job's suspects: ~60 KB)
_MAX_TEXT = 256  # an incident id, a node name
_SHOWN = 10  # ignored markers reported one line each; the rest are counted

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    what = next((w for test, w in _KINDS if test(mode)), "not a file")
    return f"not a regular file ({what}); never opened"


def _read(path: str) -> bytes | str:
    """The bytes of the marker at ``path``, or why it is not read. Never blocks, never follows a link."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot stat: {e.strerror or e}"
    why = _not_regular(st.st_mode)
    if why is not None:
        return why
    if st.st_size > MAX_MARKER_BYTES:
        return f"{st.st_size} bytes, more than any marker ({MAX_MARKER_BYTES})"
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)  # swapped for a FIFO or a link since lstat: O_NONBLOCK, O_NOFOLLOW
    except OSError as e:
        return f"cannot open: {e.strerror or e}"
    try:
        why = _not_regular(os.fstat(fd).st_mode)
        if why is not None:
            return why
        chunks, left = [], MAX_MARKER_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        return f"cannot read: {e.strerror or e}"
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_MARKER_BYTES:
        return f"more than {MAX_MARKER_BYTES} bytes, more than any marker"
    return data


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _MAX_TEXT and value.isprintable()


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field_problem(doc: dict[str, Any]) -> str | None:
    """Why a marker's fields cannot be used (None when they can)."""
    if not _int(doc.get("exit")):
        return f"'exit' is {type(doc.get('exit')).__name__}, not an integer"
    incident = doc.get("incident")
    if incident is not None and not _text(incident):
        return f"'incident' is {type(incident).__name__}, not a printable string of at most {_MAX_TEXT} characters"
    for key, ok, what in (
        ("suspect_ranks", lambda r: _int(r) and r >= 0, "rank numbers"),
        ("nodes", _text, f"printable strings of at most {_MAX_TEXT} characters"),
    ):
        value = doc.get(key)
        if not isinstance(value, list) or not all(ok(v) for v in value):
            return f"{key!r} is not a list of {what}"
    if doc.get("kind") is not None and not _text(doc.get("kind")):
        return f"'kind' is {type(doc.get('kind')).__name__}, not a printable string"
    devices = doc.get("devices")
    if devices is not None and (not isinstance(devices, list) or not all(_text(d) for d in devices)):
        return f"'devices' is not a list of printable strings of at most {_MAX_TEXT} characters"
    for key in ("rank", "message"):
        if doc.get(key) is not None and not isinstance(doc.get(key), str):
            return f"{key!r} is {type(doc.get(key)).__name__}, not a string"
    return None


def _marker(data: bytes, launch: str) -> dict[str, Any] | str:
    """The marker, or why it does not count."""
    try:
        doc = json.loads(data)
    except RecursionError:
        return "JSON nested too deep"
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict):
        return f"not a JSON object ({type(doc).__name__})"
    theirs = doc.get("launch")
    if theirs is None:
        return "no launch id (not written under this certckpt run, or by an older certckpt)"
    if not isinstance(theirs, str):
        return f"'launch' is {type(theirs).__name__}, not a string"
    if theirs != launch:
        return "from another launch (a stale marker)"
    return _field_problem(doc) or doc


def _markers(directory: str, launch: str) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The well-formed markers of this launch in ``directory``, and the ignored ones (name, why)."""
    good: list[dict[str, Any]] = []
    ignored: list[tuple[str, str]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        return good, [(directory, f"cannot list the detection directory: {e.strerror or e}")]
    for name in names:
        if not (name.startswith("detection-") and name.endswith(".json")):
            continue
        data = _read(os.path.join(directory, name))
        got = _marker(data, launch) if isinstance(data, bytes) else data
        if isinstance(got, dict):
            good.append(got)
        else:
            ignored.append((name, got))
    return good, ignored


def _report_ignored(ignored: list[tuple[str, str]]) -> None:
    for name, why in ignored[:_SHOWN]:
        click.echo(f"certckpt: ignored detection marker {name!r}: {why}", err=True)
    if len(ignored) > _SHOWN:
        click.echo(f"certckpt: {len(ignored) - _SHOWN} more detection marker(s) ignored", err=True)


def _refused(launcher: str, rc: int, refusals: list[dict[str, Any]]) -> None:
    """Exit 87 (a convicted device) or 2 (a registry that cannot vouch) for a launch refused at its start."""
    devices = sorted({d for m in refusals for d in m.get("devices") or []})
    nodes = sorted({n for m in refusals for n in m["nodes"]})
    if not devices:
        click.echo(
            f"certckpt: {launcher} exited {rc}; {len(refusals)} rank(s) refused to start: the fleet registry cannot "
            f"vouch for its convictions: exit {EXIT_UNVERIFIABLE}",
            err=True,
        )
        sys.exit(EXIT_UNVERIFIABLE)
    click.echo(
        f"certckpt: {launcher} exited {rc}; {len(refusals)} rank(s) refused to start on convicted device(s) "
        f"{', '.join(devices)}{' (node(s) ' + ', '.join(nodes) + ')' if nodes else ''}: exit {_EXIT_DEVICE_REFUSED}, "
        "requeue on other devices, not on these",
        err=True,
    )
    sys.exit(_EXIT_DEVICE_REFUSED)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(command: tuple[str, ...]) -> None:
    """Run COMMAND (a launcher: torchrun, srun, python ...); exit 86 when it failed on a detected fault,
    87 when its ranks were refused on a convicted device.

    COMMAND's processes get $CERTCKPT_DETECTION_DIR (a fresh directory for this launch, inside the one
    you set, if any) and $CERTCKPT_LAUNCH_ID; stop_on_fault leaves a marker there on a detection.

    Exit codes: the command's own; 86 when it failed and a rank of this launch stopped on a detection
    (an incident is open: do not requeue on the suspect node); 87 when it failed and its ranks were
    refused at the start because a device is convicted in the fleet registry (requeue, not on that
    device); 2 when the detection directory cannot be made, or the ranks were refused because the
    fleet registry cannot vouch for its convictions; 127 when the command cannot be started.
    """
    # A fresh directory for each launch, inside $CERTCKPT_DETECTION_DIR when it is set: a marker left
    # there by an earlier launch is never read; the launch id in each marker makes sure of it.
    parent = os.environ.get(DETECTION_DIR_ENV) or None
    try:
        directory = tempfile.mkdtemp(prefix="certckpt-run-", dir=parent)
    except OSError as e:
        fail(
            f"cannot make a detection directory in {parent or tempfile.gettempdir()!r}: {e.strerror or e}",
            EXIT_UNVERIFIABLE,
        )
    launch = secrets.token_hex(16)
    env = dict(os.environ, **{DETECTION_DIR_ENV: directory, LAUNCH_ID_ENV: launch})
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
        markers, ignored = _markers(directory, launch) if rc != 0 else ([], [])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _report_ignored(ignored)
    status = rc if rc >= 0 else 128 - rc  # a launcher killed by a signal: the shell's convention
    refusals = [m for m in markers if m.get("kind") == "device-refused"]
    markers = [m for m in markers if m.get("kind") != "device-refused"]
    if refusals and not markers:
        _refused(command[0], rc, refusals)
    if markers:
        incidents = sorted({m["incident"] or "contained" for m in markers})
        suspects = sorted({r for m in markers for r in m["suspect_ranks"]})
        nodes = sorted({n for m in markers for n in m["nodes"]})
        click.echo(
            f"certckpt: {command[0]} exited {rc}; {len(markers)} rank(s) stopped on a detected fault "
            f"(incident {', '.join(incidents)}; suspect rank(s) {suspects or 'not attributed'}"
            f"{'; node(s) ' + ', '.join(nodes) if nodes else ''}): exit {_EXIT_FAULT_DETECTED}, do not requeue "
            "on the suspect node",
            err=True,
        )
        sys.exit(_EXIT_FAULT_DETECTED)
    if ignored:
        click.echo(
            f"certckpt: {command[0]} exited {rc}; no marker of this launch says a rank stopped on a detected "
            f"fault ({len(ignored)} ignored): exit {status}, the launcher's own",
            err=True,
        )
    sys.exit(status)
