"""Timers around the parts of a DDP audit, for benchmarks: off unless a ``record()`` block is open.

The checks mark their parts in place, with ``span(name)`` around a few lines or ``@timed(name)`` on
a method. With no ``record()`` block open in the process, each mark costs one global read. Inside
one, every mark adds its wall time (``time.perf_counter``, this process's clock) and one call to its
part, and, when it ran inside another mark on the same thread, to ``"outer/part"`` as well (the
ring shift of a sharded replay audit is ``"replay_audit/ring_shift"``)::

    from certckpt.detect import timing

    with timing.record() as t:
        auditor.train_step(batch)
    t.seconds["replay"], t.calls["replay"], t.seconds.get("replay_audit/replay")

``benchmarks/bench_detect.py`` takes its breakdown of an audit step from here rather than by
replacing module attributes: the marks move with the code they time, and a part that is no longer
marked shows up as a part with no calls (the benchmark refuses to print a breakdown then).

The parts (``PARTS``; timers around collectives include waiting for the other ranks):

``train_signature``
    the signatures of this rank's own gradients, taken in training: in the DDP communication hook
    (audit steps), or, for an audit that replays a sample of the micro-batches, of the sample's
    accumulated gradients (``Auditor``); under FSDP the digest at each reduce-scatter;
``nonfinite_flags``
    the finiteness sums of the gradients: the DDP hook's of each bucket, before (eager, or lazily
    after a non-finite reduced bucket) and after its all-reduce; under FSDP of each reduce-scatter's input;
``nonfinite_check``
    ``NonFiniteCheck.due`` (``ShardedNonFiniteCheck.check``): reading the flags before the update (and
    exchanging them where needed);
``ring_shift``
    ``RingShift``: posting the sizes, posting the payload and waiting for the neighbour's at the end
    (what is not hidden behind the step);
``replay``
    ``RingReplay.recompute`` (``ShardedReplayAudit._replay``): the replay's forward and backward, its
    signatures included;
``replay_signature``
    the replay's gradient signatures (inside ``replay``);
``replay_audit``
    ``RingReplay.audit`` (``ShardedReplayAudit.audit``): the whole replay audit (``replay``, the
    all-gather and comparison of the signatures, the event; under FSDP the ring shift too);
``update_audit``
    ``ShardedReplayAudit.audit_update``: the optimizer-step replay of a mesh without replicas (copy,
    ring shift, recompute, compare);
``sentinels``
    the sentinels' sums of squares of each bucket's local gradient in the DDP hook (under FSDP of
    each reduce-scatter's input), and packing the row the non-finite check exchanges
    (``trigger.SentinelCheck``, ``sharded_trigger.ShardedSentinels``);
``consensus``
    ``WeightConsensus.check`` (``ShardedAuditSession.weight_consensus``): the weight consensus, its
    all-gather included.

One recording at a time per process; the communication hook's callbacks may run on another thread,
so the sums are taken under a lock (and a mark's enclosing mark is looked for on its own thread).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

__all__ = ["PARTS", "Recording", "record", "span", "timed"]

PARTS = (
    "train_signature",
    "nonfinite_flags",
    "nonfinite_check",
    "ring_shift",
    "replay",
    "replay_signature",
    "replay_audit",
    "update_audit",
    "consensus",
    "sentinels",
)

P = ParamSpec("P")
R = TypeVar("R")


class Recording:
    """Seconds and calls per part (and per ``"outer/part"``), summed over the marks run while it was open."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._open = threading.local()  # this thread's marks still running, innermost last

    def enter(self, name: str) -> None:
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append(name)

    def leave(self, name: str, seconds: float) -> None:
        stack = self._open.stack
        stack.pop()
        keys = (name, f"{stack[-1]}/{name}") if stack else (name,)
        with self._lock:
            for key in keys:
                self.seconds[key] = self.seconds.get(key, 0.0) + seconds
                self.calls[key] = self.calls.get(key, 0) + 1

    def clear(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.calls.clear()


_active: Recording | None = None


@contextlib.contextmanager
def record() -> Iterator[Recording]:
    """Turn the marks on in this process for the block; yields the ``Recording`` they add to."""
    global _active
    if _active is not None:
        raise RuntimeError("a timing.record() block is already open in this process")
    rec = _active = Recording()
    try:
        yield rec
    finally:
        _active = None


class _Span:
    __slots__ = ("name", "rec", "t0")

    def __init__(self, name: str, rec: Recording) -> None:
        self.name, self.rec = name, rec
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.rec.enter(self.name)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.rec.leave(self.name, time.perf_counter() - self.t0)


_OFF = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager[None]:
    """A context manager timing its block as part ``name`` while a recording is open."""
    rec = _active
    return _OFF if rec is None else _Span(name, rec)


def timed(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator timing every call of the function as part ``name`` while a recording is open."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            rec = _active
            if rec is None:
                return fn(*args, **kwargs)
            rec.enter(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                rec.leave(name, time.perf_counter() - t0)

        return inner

    return wrap
