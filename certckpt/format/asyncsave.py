"""Asynchronous certified saves: training waits for a snapshot, a background thread does the rest.

``async_save`` blocks only for what must happen while the tensors still hold this step's values:

1. the checks and the plan of a synchronous save (``writer.prepare``): bad arguments and values that
   cannot be stored are refused here, before anything runs in the background;
2. on a GPU, every tensor's fingerprint, computed on its device before any byte moves, so that the
   certificate describes the state the device held at this step;
3. a snapshot of every tensor into staging memory that is kept and reused by the next save (pinned
   host memory for device tensors, copied on a side stream and synchronised once; a plain copy on
   the CPU, whose fingerprints are then computed from the snapshot in the background).

A background thread then does what ``certckpt.save`` does after that: data digests, signature,
write, fsync, the no-replace publish, and (``then``) the ledger commit. A crash at any moment
leaves the previous state or the complete new one, as the synchronous path does: the file appears
under its name only once it is durable, and its commit record only after that.

The background thread runs at a lower CPU priority (``nice`` +10 on Linux, for that thread and the
threads it starts): where training and the save compete for cores, the kernel gives them to
training first and the save takes what is left. A file, once durable, leaves the page cache
(``POSIX_FADV_DONTNEED``): the next save reuses those pages instead of growing the cache, which on
a virtual machine cost several times the CPU of the write itself.

One save is in flight by default: the next ``save`` first waits for the previous one (DCP's
``async_save`` asks the same of its callers) and reuses its staging memory. A background failure is
raised by the future's ``result()``; if nobody asked for it, by the saver's next ``save``, ``wait``
or ``close`` (``AsyncSaveError``), so it is never lost. The worker thread is not a daemon: a
process that exits with a save in flight finishes that save first.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from certckpt.errors import AsyncSaveError, ConfigurationError
from certckpt.storage import Target

from .fingerprinting import fingerprint_many
from .record import RecordFields
from .skeleton import StoredTensor
from .writer import SaveJob, SaveResult, TensorIdentity, fields_given, prepare, publish

__all__ = ["AsyncSaver", "SaveFuture", "StagingArea", "async_save", "default_saver"]


class SaveFuture(Future[SaveResult]):
    """The result of one asynchronous save (a ``concurrent.futures.Future``).

    ``result()`` waits for the file (and its commit, when there is one) and returns its
    ``SaveResult``, or raises what failed. ``location`` and ``blocking_seconds`` (how long the
    caller was held) are known at once.
    """

    def __init__(self, location: str, blocking_seconds: float = 0.0):
        super().__init__()
        self.location = location
        self.blocking_seconds = blocking_seconds
        self.observed = False  # whether the caller has looked at the outcome (then the saver won't raise it)

    def result(self, timeout: float | None = None) -> SaveResult:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        return super().exception(timeout)

    def failure(self) -> BaseException | None:
        """What failed, if it is done and failed, without counting as the caller's look."""
        return super().exception(0) if self.done() else None


class StagingArea:
    """Host memory one save's snapshot is copied into, kept for the next save.

    One contiguous buffer laid out exactly as the file's data region (each tensor at its offset),
    grown when a larger state comes and never shrunk; pinned when it receives device tensors, so
    that their copies are DMA and asynchronous.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The staging memory held now."""
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.is_pinned()

    def _ensure(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or (pin and not self._buffer.is_pinned()):
            self._buffer = None  # free the old buffer before the new one is allocated
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._buffer

    def stage(self, job: SaveJob) -> None:
        """Copy every tensor of ``job`` into this area and point the job at the copies.

        On the CPU a plain copy; device tensors are copied with ``non_blocking`` on a side stream of
        their device, synchronised once, before this returns (the snapshot is complete then).
        """
        on_device = [s.tensor.device for s in job.stored if s.tensor.device.type != "cpu"]
        buf = self._ensure(job.data_length, pin=bool(on_device) and torch.cuda.is_available())
        streams: dict[torch.device, Any] = {}
        for i, (s, e) in enumerate(zip(job.stored, job.entries)):
            t = s.tensor
            view = buf[e.begin : e.end].view(t.dtype).view(t.shape) if e.end > e.begin else _empty_like(t)
            if t.device.type == "cuda":
                stream = streams.get(t.device)
                if stream is None:
                    stream = streams[t.device] = torch.cuda.Stream(device=t.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
                    stream.wait_stream(torch.cuda.current_stream(t.device))  # the step's kernels first
                with torch.cuda.stream(stream):
                    view.copy_(t, non_blocking=True)
            else:
                view.copy_(t)
            job.stored[i] = StoredTensor(s.name, view)
        for stream in streams.values():
            stream.synchronize()


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


class AsyncSaver:
    """Saves in the background, ``max_in_flight`` at a time (default 1), with reusable staging memory.

    Example:
        >>> saver = AsyncSaver()
        >>> for step in range(steps):
        ...     train_step()
        ...     if step % 100 == 0:
        ...         saver.save(model.state_dict(), f"ckpt/step{step}.safetensors", step=step)
        >>> saver.close()   # waits for the last save; raises what failed
    """

    def __init__(self, *, max_in_flight: int = 1, background_nice: int = 10):
        """Args:
        max_in_flight: saves in the background at once; each holds its own staging memory.
        background_nice: how much lower the background thread's CPU priority is (Linux ``nice``
            increments, 0-19; 0 keeps the caller's).
        """
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise ConfigurationError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if type(background_nice) is not int or not 0 <= background_nice <= 19:
            raise ConfigurationError(f"background_nice must be an int from 0 to 19, got {background_nice!r}")
        self.max_in_flight = max_in_flight
        self.background_nice = background_nice
        self._free = [StagingArea() for _ in range(max_in_flight)]
        self._areas: list[StagingArea] = list(self._free)
        self._in_flight: list[SaveFuture] = []
        self._failed: list[SaveFuture] = []
        self._lock = threading.Condition()

    @property
    def staging_bytes(self) -> int:
        """The staging memory this saver holds (kept between saves)."""
        return sum(a.nbytes for a in self._areas)

    def save(
        self,
        obj: Any,
        f: Any,
        *,
        step: int | None = None,
        run: str | None = None,
        metadata: dict[str, str] | None = None,
        overwrite: bool = True,
        signing_key: Any = None,
        fields: RecordFields | None = None,
        known_fingerprints: dict[TensorIdentity, tuple[str, str]] | None = None,
        then: Callable[[SaveResult], None] | None = None,
    ) -> SaveFuture:
        """Snapshot ``obj`` and save it in the background (arguments as ``certckpt.save``).

        ``f`` may be a binary file object, as for ``certckpt.save``: it is written in the background,
        so keep it open until the future is done.

        Args:
            fields: the record's fields together (``RecordFields``: step, run and the audit fields
                ``save_certified`` takes), instead of ``step`` and ``run``.
            known_fingerprints: fingerprints the caller computed at this step (the auditor's
                consensus), as ``save_certified`` takes them: not computed again.
            then: called in the background with the ``SaveResult`` once the file is published (the
                ledger commit); the future resolves after it, and fails if it raises.

        Raises:
            AsyncSaveError: an earlier save of this saver failed and nobody has looked at its future.
            UnsupportedObjectError, ArgumentTypeError: as ``certckpt.save``, before anything runs.
        """
        t0 = time.perf_counter()
        area = self._take_area()
        try:
            job, target = prepare(
                obj,
                f,
                fields=fields_given(fields, {"step": step, "run": run}),
                metadata=metadata,
                overwrite=overwrite,
                known_fingerprints=known_fingerprints,
                signing_key=signing_key,
            )
            _fingerprint_on_device(job)
            area.stage(job)
        except BaseException:
            self._give_back(area)
            raise
        future = SaveFuture(target.display, time.perf_counter() - t0)
        with self._lock:
            self._in_flight.append(future)
        worker = threading.Thread(
            target=self._run,
            args=(job, target, overwrite, t0, then, area, future),
            name="certckpt-async-save",
            daemon=False,  # an exiting interpreter waits for it: a save in flight is finished
        )
        worker.start()
        return future

    def _run(
        self,
        job: SaveJob,
        target: Target,
        overwrite: bool,
        t0: float,
        then: Callable[[SaveResult], None] | None,
        area: StagingArea,
        future: SaveFuture,
    ) -> None:
        _lower_priority(self.background_nice)
        try:
            result = publish(job, target, overwrite=overwrite, started=t0, cap_threads=False, drop_cache=True)
            if then is not None:
                then(result)
        except BaseException as e:
            with self._lock:
                self._failed.append(future)
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            job.stored.clear()  # the staged views: the area is reused by the next save
            with self._lock:
                self._in_flight.remove(future)
                self._free.append(area)
                self._lock.notify_all()

    def _take_area(self) -> StagingArea:
        """A free staging area, waiting for a save in flight to end when there is none; raises an
        unobserved failure first."""
        with self._lock:
            self._raise_unobserved()
            while not self._free:
                self._lock.wait()
                self._raise_unobserved()
            return self._free.pop()

    def _give_back(self, area: StagingArea) -> None:
        with self._lock:
            self._free.append(area)
            self._lock.notify_all()

    def _raise_unobserved(self) -> None:
        failed = [f for f in self._failed if not f.observed]
        self._failed = []
        if failed:
            first = failed[0]
            error = first.failure()
            raise AsyncSaveError(
                f"{first.location}: the asynchronous save failed ({error}); nothing was published under "
                "that name and the previous checkpoint is untouched"
                + (f" ({len(failed) - 1} more failed)" if len(failed) > 1 else "")
            ) from error

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every save in flight; raise the first failure nobody has looked at."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{len(self._in_flight)} asynchronous save(s) still in flight")
                self._lock.wait(left)
            self._raise_unobserved()

    def close(self) -> None:
        """``wait()``, then free the staging memory."""
        try:
            self.wait()
        finally:  # the staging memory is given back even when a failure is raised
            with self._lock:
                self._areas = [StagingArea() for _ in range(self.max_in_flight)]
                self._free = list(self._areas)


def _lower_priority(by: int) -> None:
    """Lower the calling thread's CPU priority by ``by`` (Linux: ``setpriority`` on a thread id acts
    on that thread alone, and the threads it starts inherit it; elsewhere it would act on the whole
    process, so nothing is done)."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        pass  # a sandbox that forbids it: the save runs at the caller's priority


def _fingerprint_on_device(job: SaveJob) -> None:
    """Fingerprint device tensors where they are, before the snapshot moves them (CPU tensors are
    fingerprinted from the snapshot in the background: the same bytes)."""
    todo = [i for i, s in enumerate(job.stored) if s.tensor.device.type != "cpu" and i not in job.known]
    if todo:
        for i, fp in zip(todo, fingerprint_many([job.stored[i].tensor for i in todo])):
            job.known[i] = f"{fp:016x}"


_DEFAULT: AsyncSaver | None = None
_DEFAULT_LOCK = threading.Lock()


def default_saver() -> AsyncSaver:
    """The process's saver behind ``async_save`` (one save in flight)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = AsyncSaver()
        return _DEFAULT


def async_save(
    obj: Any,
    f: Any,
    *,
    step: int | None = None,
    run: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = True,
    signing_key: Any = None,
) -> SaveFuture:
    """``certckpt.save`` that returns once the state is snapshotted; the write runs in the background.

    Returns:
        A ``SaveFuture``: ``result()`` gives the ``SaveResult`` once the file is durable.
    """
    return default_saver().save(
        obj, f, step=step, run=run, metadata=metadata, overwrite=overwrite, signing_key=signing_key
    )
