"""Collectives whose tensors gloo's worker thread has let go of before the caller goes on.

gloo runs each collective on a worker thread of its process group, which drops its reference to
the work, and so to the work's tensors, a moment after ``wait()`` has returned. When Python lets go
of such a tensor first, the tensor's Python object is kept alive by that last reference, and the
worker, freeing it, takes the GIL. If the interpreter is finalizing by then (the collective was the
last one before the script ended: the checkpoint agreement of a final ``save``), CPython ends the
worker thread from inside a C++ destructor and the process aborts ("terminate called without an
active exception", SIGABRT, after everything succeeded). Once the worker has let go, Python's is
the last reference and the tensor dies on the thread that drops it, with the GIL.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import torch

__all__ = ["PATIENCE", "released", "gave_up"]

PATIENCE = 1.0
"""Seconds :func:`released` waits at most: the worker lets go microseconds after the wait returns."""

gave_up = 0
"""How many times :func:`released` waited out its patience in this process: never, when every
holder it waits for is the worker (the tests check it; a holder the caller keeps, such as the work
object of an asynchronous collective, would cost every call :data:`PATIENCE`)."""


@contextlib.contextmanager
def released(*tensors: torch.Tensor) -> Iterator[None]:
    """Around a collective on ``tensors``: on leaving, wait until every CPU tensor among them has
    no more holders than on entering (the worker has dropped the work).

    A CUDA tensor is not waited for (NCCL's watchdog keeps its work for a time of its own), nor
    anything when the block raised; nor longer than :data:`PATIENCE` seconds (a process group that
    keeps its work, a debug wrapper's, would otherwise hold the caller forever: then the release is
    left to chance, as without this).

    Example::

        with released(flag):
            dist.broadcast(flag, 0)
    """
    # private, not in torch's stubs; a torch without it leaves the release to chance, as before
    counts = [(c, c()) for t in tensors if t.device.type == "cpu" and (c := getattr(t, "_use_count", None))]
    yield
    global gave_up
    deadline = time.monotonic() + PATIENCE
    for use_count, before in counts:
        while use_count() > before:
            if time.monotonic() >= deadline:
                gave_up += 1
                return
            os.sched_yield()  # the worker finishes its last step of the work; it needs no GIL for that
