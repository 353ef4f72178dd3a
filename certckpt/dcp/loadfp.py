"""The contributions of loaded regions to their tensors' fingerprints, worked out beside the reads.

``CertifiedReader(check_fingerprints=True)`` fingerprints every region it loads. On the CPU that
pass (``shardfp.tensor_contribution``: int64 arithmetic over every word) costs about as much as the
reading itself, so host regions are fingerprinted by a worker thread, on one core
(``fingerprinting.one_thread``), while the reading thread goes on with the next chunk on another:
the file reads, xxh3 and torch's kernels all release the GIL. Once the reads are done the reading
thread takes queued regions too, so the two finish the queue together. A region on a GPU is
fingerprinted at once, on the reading thread (and its stream).

The reading thread hands a region over after committing it to the planner: DCP's planners
(Megatron's among them) expect ``commit_tensor`` right after ``resolve_tensor``, so a commit cannot
wait for the worker. What is fingerprinted is therefore what the planner holds once the region is
committed, the same bytes whatever the timing: before every later write into a destination the
reading thread calls ``guard``, which first finishes every queued region whose memory that
destination may touch (a planner that stages every region through one buffer, say).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from certckpt.format.fingerprinting import one_thread
from certckpt.format.sharded.shardfp import tensor_contribution

from .statecheck import Region

__all__ = ["RegionFingerprints", "QUEUE_BYTES", "SMALL_BYTES"]

# The reading thread runs at most this far ahead of the worker (bytes queued): past it, the reading
# thread fingerprints the oldest queued region itself. A longer queue would only hold more memory (a
# planner's temporary destinations stay alive until they are fingerprinted).
QUEUE_BYTES = 64 << 20
# A smaller region is fingerprinted at once, on the reading thread: handing it over would cost more
# than its sum (and keeps the queue, which ``guard`` scans, to at most QUEUE_BYTES / SMALL_BYTES).
SMALL_BYTES = 64 << 10


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The first and one-past-last byte address a (possibly strided) CPU tensor's elements occupy."""
    if t.numel() == 0:
        return 0, 0
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + t.element_size()


@dataclass(eq=False)
class _Job:
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dest: torch.Tensor | None
    span: tuple[int, int]
    raw: int | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        dest, self.dest = self.dest, None  # the tensor is released as soon as it is fingerprinted
        assert dest is not None
        try:
            with one_thread():
                self.raw = tensor_contribution(dest, offsets=self.offsets, global_shape=self.global_shape)
        except BaseException as e:  # raised by regions(), on the reading thread
            self.error = e
        finally:
            self.done.set()


class RegionFingerprints:
    """Loaded regions whose contributions a worker thread (and, at the end, the reading thread)
    computes.

    Use as a context manager (leaving it stops the worker; regions it has not started are dropped
    when an error is on its way out):

        with RegionFingerprints() as fps:
            fps.guard(dest)               # before writing into dest
            ...read into dest, check its digest...
            planner.commit_tensor(req, dest)
            fps.submit(fqn, offsets, dest, global_shape)
            regions = fps.regions()       # every region, in the order submitted
    """

    def __init__(self) -> None:
        self._jobs: list[_Job] = []
        self._open: list[_Job] = []  # handed to the worker, not seen done yet
        self._queue: deque[_Job] = deque()  # not yet started
        self._queued_bytes = 0
        self._lock = threading.Condition()
        self._closed = False
        self._worker: threading.Thread | None = None

    def __enter__(self) -> RegionFingerprints:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()
        if self._worker is not None:
            self._worker.join()

    # --- the two threads ----------------------------------------------------------------------

    def _take(self, job: _Job | None = None) -> _Job | None:
        """The oldest queued job (or ``job`` if still queued), taken off the queue; None if none."""
        with self._lock:
            if job is None:
                if not self._queue:
                    return None
                job = self._queue.popleft()
            elif job in self._queue:
                self._queue.remove(job)
            else:
                return None
            self._queued_bytes -= job.span[1] - job.span[0]
            return job

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
            job = self._take()
            if job is not None:
                job.run()

    # --- the reading thread -------------------------------------------------------------------

    def guard(self, dest: torch.Tensor) -> None:
        """Finish every region not yet fingerprinted whose memory ``dest``'s may overlap."""
        lo, hi = _span(dest)
        self._open = [job for job in self._open if not job.done.is_set()]
        for job in self._open:
            if job.span[0] < hi and lo < job.span[1]:
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        if self._take(job) is not None:
            job.run()  # still queued: fingerprinted here, now
        job.done.wait()

    def submit(self, fqn: str, offsets: Sequence[int], dest: torch.Tensor, global_shape: Sequence[int]) -> None:
        """Queue ``dest``, the loaded region at ``offsets`` of the global tensor ``fqn``."""
        job = _Job(fqn, tuple(offsets), tuple(dest.shape), tuple(global_shape), dest.detach(), _span(dest))
        self._jobs.append(job)
        if dest.device.type != "cpu" or job.span[1] - job.span[0] < SMALL_BYTES:
            job.run()  # a GPU region on the reading thread's stream, after its copy; a small one at once
            return
        self._open.append(job)
        with self._lock:
            self._queue.append(job)
            self._queued_bytes += job.span[1] - job.span[0]
            too_far = self._queued_bytes > QUEUE_BYTES
            self._lock.notify()
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="certckpt-dcp-loadfp", daemon=True)
            self._worker.start()
        if too_far:
            oldest = self._take()
            if oldest is not None:
                oldest.run()

    def regions(self) -> list[Region]:
        """Every region with its contribution, once all are computed (the first error is raised).
        The reading thread fingerprints queued regions beside the worker until none is left."""
        while (job := self._take()) is not None:
            job.run()
        out = []
        for job in self._jobs:
            job.done.wait()
            if job.error is not None:
                raise job.error
            assert job.raw is not None
            out.append(Region(job.fqn, job.offsets, job.sizes, f"{job.raw:016x}"))
        return out
