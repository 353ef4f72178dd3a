"""certckpt's log lines: silent in a library until asked, on in the CLI and the integrations' rank 0.

Every line goes to the ``certckpt`` logger (children: ``certckpt.audit``, ``certckpt.resume``), which
carries a ``NullHandler``: an application that configures nothing sees nothing. ``enable()`` (called
by the ``certckpt`` command and, on rank 0, by the Lightning and Hugging Face integrations) prints
INFO lines to stderr, unless the application has configured that logger itself. Raise or lower it
as any Python logger::

    logging.getLogger("certckpt").setLevel(logging.WARNING)   # audits pass silently
    logging.getLogger("certckpt").setLevel(logging.DEBUG)     # everything

What is logged: one INFO line per audit (its outcome, what it checked, what it cost) and one at
resume (the checkpoint, its verdict, the new branch). Failures are raised as exceptions, not logged.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOGGER", "enable"]

LOGGER = logging.getLogger("certckpt")
LOGGER.addHandler(logging.NullHandler())


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
