"""certckpt's log lines: silent in a library until asked, on in the CLI and the integrations' rank 0.

Every line goes to the ``certckpt`` logger (children: ``certckpt.audit``, ``certckpt.resume``), which
carries a ``NullHandler``: an application that configures nothing sees nothing. ``enable()`` (called
by the ``certckpt`` command and, on rank 0, by the Lightning and Hugging Face integrations) prints
INFO lines to stderr, unless the application has configured that logger itself. Raise or lower it
as any Python logger::

    logging.getLogger("certckpt").setLevel(logging.WARNING)   # audits pass silently
    logging.getLogger("certckpt").setLevel(logging.DEBUG)     # everything

What is logged: one INFO line per audit (its outcome, what it checked, what it cost), one at
resume (the checkpoint resumed from, the new branch), one per committed checkpoint (whatever wrote
it: the commit record is the moment it exists) and, in a training session's rank 0, one when a
checkpoint becomes trusted (a clean audit covered its unaudited steps), naming the run's latest-good.
Failures are raised as exceptions, not logged.

``CERTCKPT_LOG`` (``info``, ``debug``, ``warning``, ``off``) sets the level in every process that
imports certckpt, training ranks started by a launcher included: the ``certckpt`` command sets it to
``info`` for the processes it starts, unless it is set already.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOGGER", "AUDIT", "RESUME", "COMMIT", "TRUST", "ENV", "enable", "say"]

ENV = "CERTCKPT_LOG"
LOGGER = logging.getLogger("certckpt")
LOGGER.addHandler(logging.NullHandler())
AUDIT = LOGGER.getChild("audit")  # one line per passed audit
RESUME = LOGGER.getChild("resume")  # one line per resume (a branch recorded)
COMMIT = LOGGER.getChild("commit")  # one line per checkpoint committed (its commit record written)
TRUST = LOGGER.getChild("trust")  # one line when a session sees a checkpoint become trusted
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "off": logging.CRITICAL + 1}


def enable(level: int = logging.INFO) -> None:
    """Show certckpt's lines at ``level`` on stderr, once, unless the application configured the
    ``certckpt`` logger already (a level of its own, or a handler): its choice wins."""
    if LOGGER.level != logging.NOTSET or any(not isinstance(h, logging.NullHandler) for h in LOGGER.handlers):
        return
    LOGGER.setLevel(level)
    if logging.getLogger().handlers:
        return  # the root logger prints what propagates to it, in the application's format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("certckpt: %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.propagate = False


def say(line: str) -> None:
    """Print one line to stderr in one write.

    Training ranks share one stderr. ``print`` writes the text and its newline separately, and under
    ``PYTHONUNBUFFERED`` (set by many launchers and CI runners) those are two system calls, between
    which another rank's line can land: two exit lines glued into one, and a scheduler reading
    ``certckpt: refused: ...`` lines miscounts. One write of under ``PIPE_BUF`` bytes is atomic.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _from_env() -> None:
    level = _LEVELS.get(os.environ.get(ENV, "").strip().lower())
    if level is not None:
        enable(level)


_from_env()
