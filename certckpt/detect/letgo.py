"""Wait until a collective's worker thread has let go of the tensors it was given.

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

import os

import torch

__all__ = ["wait_released"]


def wait_released(*tensors: torch.Tensor) -> None:
    """Return once every CPU tensor of ``tensors`` is referenced by its Python object alone.

    For tensors a caller created for one collective (no views of them alive). A CUDA tensor is not
    waited for: NCCL's watchdog keeps its work for a time of its own choosing.
    """
    for t in tensors:
        # private, not in torch's stubs; a torch without it leaves the wait to chance, as before
        use_count = getattr(t, "_use_count", None)
        if t.device.type != "cpu" or use_count is None:
            continue
        while use_count() > 1:
            os.sched_yield()  # the worker finishes its last step of the work; it needs no GIL for that
