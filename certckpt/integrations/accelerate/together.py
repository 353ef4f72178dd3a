"""Run a step on every process and fail on all of them together when it fails on any.

A checkpoint save or load under ``accelerate launch`` runs on every process; one process failing alone
(a damaged file it read, a disk error in its own write) would leave the others waiting in the next
collective. ``together`` runs the step, then exchanges one flag (and, on failure, the message), so that
every process raises: the failing one its own error, the others a ``CertckptError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from certckpt.detect.agreement import refuse_together, wire_device_for
from certckpt.errors import CertckptError

__all__ = ["together", "distributed"]

T = TypeVar("T")


def distributed() -> bool:
    """Whether several processes run under an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def together(fn: Callable[[], T], *, what: str, device: torch.device) -> T | None:
    """``fn()`` on this process; when it raised on any process, every process raises.

    Args:
        what: the step, for the message (``"checkpoint save"``...).
        device: the processes' device (the flags travel on the process group's device for it).

    Returns:
        What ``fn`` returned (None when it raised elsewhere: then this raises too).
    """
    if not distributed():
        return fn()
    error: BaseException | None = None
    result: T | None = None
    try:
        result = fn()
    except Exception as e:  # any failure, certckpt's or the file system's: the others must learn of it
        error = e
    wire = wire_device_for(dist.group.WORLD, device)
    try:
        refuse_together(None if error is None else str(error), group=dist.group.WORLD, wire_device=wire, what=what)
    except CertckptError as both:
        if error is not None:
            raise error from None
        raise CertckptError(str(both)) from None
    return result
