"""What every command shares: exit codes, the error-to-exit-code mapping, tables, sizes, progress.

Exit codes (documented in the README):
    0  verified / done
    1  verification failed: corrupt bytes, digest or fingerprint mismatch, truncated, malformed
       header; a suspect checkpoint where a trusted one is needed
    2  could not verify: bad usage, not found, not a certckpt checkpoint, store unreachable
   86  (training jobs, not this command) an uncontained fault was detected: do not requeue on that node
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click

from certckpt.errors import CertckptError, CorruptCheckpointError, UntrustedCheckpointError
from certckpt.format.signing import TRUSTED_KEYS_ENV, trusted_keys_from_spec

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_UNVERIFIABLE",
    "COPY_PROGRESS",
    "fail",
    "expected_errors",
    "human_bytes",
    "table_lines",
    "echo_table",
    "Progress",
    "OneLineUsage",
    "trusted_keys_option",
]

EXIT_OK, EXIT_FAILED, EXIT_UNVERIFIABLE = 0, 1, 2
COPY_PROGRESS = 256 << 20  # show progress for copies from this size on (when stderr is a terminal)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr, then exit with ``code``."""
    click.echo(f"certckpt: {message}", err=True)
    sys.exit(code)


def expected_errors(fn: F) -> F:
    """Turn certckpt's expected errors into one line on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # `certckpt inspect ... | head`: the reader left, not an error
            sys.stderr.close()
            sys.exit(EXIT_OK)
        except (CorruptCheckpointError, UntrustedCheckpointError) as e:
            fail(str(e), EXIT_FAILED)
        except (CertckptError, OSError, ValueError) as e:
            fail(str(e), EXIT_UNVERIFIABLE)

    return wrapper  # type: ignore[return-value]


def trusted_keys_option(fn: F) -> F:
    """``--trusted-keys PUB[,PUB...]``: require signatures by these public keys (docs/signing.md).

    The option stands for ``CERTCKPT_TRUSTED_KEYS`` for this command (and overrides it): every
    ledger the command opens reads its keys from there, so nothing is left unchecked. The keys are
    loaded first, so a wrong path is one line and exit 2 before any work.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, trusted_keys: str | None = None, **kwargs: Any) -> Any:
        if trusted_keys is not None:
            try:
                if trusted_keys_from_spec(trusted_keys) is None:  # "" would switch every check off
                    fail("--trusted-keys: names no public key file; give PUB[,PUB...]", EXIT_UNVERIFIABLE)
            except CertckptError as e:
                fail(f"--trusted-keys: {e}", EXIT_UNVERIFIABLE)
            os.environ[TRUSTED_KEYS_ENV] = trusted_keys
        return fn(*args, **kwargs)

    return click.option(
        "--trusted-keys",
        metavar="PUB[,PUB...]",
        help="Public key files whose signatures count; records and files they did not sign count for nothing "
        "(default: $CERTCKPT_TRUSTED_KEYS).",
    )(wrapper)  # type: ignore[return-value]


def no_mmap_option(fn: F) -> F:
    """``--no-mmap``: read files instead of mapping them for a keyed digest. Like ``--trusted-keys``,
    it stands for its variable (``CERTCKPT_NO_MMAP=1``) for this command, so it reaches every verify
    the command runs (a directory's companions and shards too)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, no_mmap: bool = False, **kwargs: Any) -> Any:
        if no_mmap:
            from certckpt.format.verify import NO_MMAP_ENV

            os.environ[NO_MMAP_ENV] = "1"
        return fn(*args, **kwargs)

    return click.option(
        "--no-mmap",
        is_flag=True,
        help="Read files instead of mapping them for the keyed digest, companions and shards included "
        "(slower; for mounts where an I/O error would end a mapped read with SIGBUS; default: $CERTCKPT_NO_MMAP).",
    )(wrapper)  # type: ignore[return-value]


def human_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, as disks and object stores count)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def table_lines(head: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "") -> list[str]:
    """A left-aligned text table: a header row, then one line per row, columns as wide as needed."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    return [indent + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in (tuple(head), *rows)]


def echo_table(head: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "") -> None:
    for line in table_lines(head, rows, indent=indent):
        click.echo(line)


class Progress:
    """A percentage on stderr for large files, only when a person is watching."""

    def __init__(self, label: str, *, threshold: int = 1 << 30) -> None:
        self.label = label
        self.threshold = threshold
        self.last = -1
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.threshold:
            return
        pct = done * 100 // max(total, 1)
        if pct != self.last:
            self.last = pct
            click.echo(f"\r{self.label}: {pct:3d}% of {human_bytes(total)}", err=True, nl=pct == 100)


class OneLineUsage(click.Command):
    """Usage errors as one line on stderr and exit 2, like every other expected error."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            fail(f"{info_name}: {e.format_message()}", EXIT_UNVERIFIABLE)
