"""The DDP communication hook behind the non-finite checks, and its per-step state.

The hook performs each bucket's all-reduce itself: before it, the local gradients' non-finite flag
(eagerly, or lazily from ``.grad`` once the reduced bucket comes back non-finite), with the
sentinels the bucket's sum of squares (and, once per bucket buffer, its layout: ``buckets.py``) and,
on audit steps, their signatures; after it, the reduced bucket's flag and, where DDP would copy the reduced
bucket into ``.grad``, the hand-over of ``.grad`` to its view of the bucket. The sums stay on the
device; the auditor tests them once per step (``Auditor._read_flags``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .buckets import BucketLayout, layout_of, sum_of_squares
from .inject import Injector
from .signature import Probes, signature
from .timing import span

__all__ = [
    "HookState",
    "comm_hook",
    "any_nonfinite",
    "finiteness_sum",
    "sum_of_squares",
    "nonfinite_flag",
    "local_grads_sum",
    "lazy_pre_possible",
    "hand_over_possible",
    "average_over_ranks",
]


class HookState:
    """State shared with the communication hook: per-bucket device sums (``finiteness_sum``), the bucket views, the
    local gradients kept alive for the step and, on audit steps, their signatures."""

    def __init__(
        self,
        *,
        names: list[str],
        index: dict[int, int],
        mode: str,
        probes: Probes | None,
        injector: Injector | None,
        group: Any,
        eager_pre: bool,
        hand_over: bool,
        sentinels: bool = False,
    ):
        # What the hook needs from the auditor: the trained parameters' names and their index by
        # id(), the signature mode and probes, a drill's injector, the process group.
        self.names, self.index, self.mode, self.probes = names, index, mode, probes
        self.injector, self.group = injector, group
        # Eager: flag every bucket's local gradients before the all-reduce (device-side, no sync).
        # Lazy: flag them only when the reduced bucket is non-finite, from ``.grad``, which still
        # holds the local gradients when the callback runs (see ``lazy_pre_possible``).
        self.eager_pre = eager_pre
        # Hand-over: the callback points ``.grad`` at the reduced bucket (see ``hand_over_possible``).
        self.hand_over = hand_over
        self.pre: list[torch.Tensor] = []
        self.post: list[torch.Tensor] = []
        self.local_sig: dict[int, torch.Tensor] = {}
        self.audit = False
        self.views: dict[int, tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]]] = {}
        # ``(parameter, its local gradient)`` for each gradient handed over: the local gradients
        # stay alive until the next step, so a triggered replay can still sign them
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Sentinels (``trigger.SentinelCheck``): each bucket's local sum of squares, by bucket index,
        # and each bucket's layout, by which a triggered replay without hand-over recomputes them.
        self.sentinels = sentinels
        self.sumsq: list[tuple[int, torch.Tensor]] = []
        self.layouts: dict[int, BucketLayout] = {}
        # Micro-batch steps: the factor (1 / world) the hook applies to each bucket before its
        # all-reduce, as DDP's own hook does; None when the loss already carries the averaging.
        self.average: float | None = None

    def reset(self, *, audit: bool, average: float | None = None) -> None:
        # Dropping the kept local gradients here, right after zero_grad, frees them when plain DDP
        # frees its .grad tensors: freed any earlier, the allocator hands the block back to the
        # system and the next backward pays a page fault per 4 KiB to get it again.
        self.pre, self.post, self.local_sig, self.audit, self.kept = [], [], {}, audit, []
        self.average = average
        self.sumsq = []

    def bucket_views(self, bucket, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The bucket's parameters and, for each, a view of its gradient in the bucket (cached).

        ``GradBucket.gradients()`` views every gradient row-major, but DDP lays a dense
        parameter's gradient out with the parameter's own strides (its "gradient layout
        contract"): for a channels_last weight the row-major view reads the right bytes in the
        wrong order. The views here follow DDP's layout, so they hold the gradient's true values.
        """
        key = (buf.data_ptr(), buf.numel())  # DDP rebuilds its buckets once, after the first step
        hit = self.views.get(bucket.index())
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        params = list(bucket.parameters())
        views = []
        for p, g in zip(params, bucket.gradients()):
            if _dense(p) and not p.is_contiguous():
                g = buf.as_strided(p.size(), p.stride(), g.storage_offset())
            views.append(g)
        self.views[bucket.index()] = (key, params, views)
        self.layouts[bucket.index()] = layout_of(bucket.index(), buf, [self.index[id(p)] for p in params], views)
        return params, views

    def step_layouts(self) -> list[BucketLayout]:
        """The layouts of the buckets reduced at this step (by index; a bucket rebuilt since
        has a new layout, and an index no longer used is not among this step's)."""
        return [self.layouts[i] for i in sorted({i for i, _ in self.sumsq})]

    def handed_over_intact(self) -> bool:
        """Does each bucket's first gradient still view the reduced bucket after backward?

        The hand-over relies on DDP leaving ``.grad`` alone once told an optimizer ran in backward
        (a private switch); were a torch release to reset or copy the gradients there instead, the
        optimizer would silently step on something else. One check per bucket per step catches it.
        """
        for _, params, views in self.views.values():
            for p, v in zip(params, views):
                if v.numel():
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                        return False
                    break
        return True


class _AverageOverRanks(torch.autograd.Function):
    """The identity forward; backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0] * ctx.factor, None


def average_over_ranks(loss: torch.Tensor, world: int) -> torch.Tensor:
    """``loss`` itself, whose gradient carries DDP's averaging over ``world`` ranks.

    A loop that back-propagates this (``AcceleratorAudit.loss``) lets the communication hook
    all-reduce the buckets as they are: their sum is already the average. Multiplying each bucket
    by ``1 / world`` in the hook, as DDP's own hook does while it copies the gradients in, is one
    more pass over every gradient per optimizer step (measured in the Accelerate loop of
    ``benchmarks/bench_accelerate.py``: about 3 ms of CPU per rank and step for 32 MiB of
    gradients), where scaling the scalar at the top of the backward costs nothing. The value is
    unchanged (the loop logs the true loss); the gradients equal DDP's average within rounding,
    not bit for bit, and a replay that scales its loss the same way (``CheckContext.scaled``)
    reproduces them bit for bit.
    """
    if world <= 1:
        return loss
    return _AverageOverRanks.apply(loss, 1.0 / world)


def finiteness_sum(buf: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor that is non-finite exactly when ``buf`` holds a NaN or an Inf.

    One reduction kernel instead of ``isfinite().all()``'s two: NaN and Inf propagate through a sum
    (a sum that overflows to Inf is flagged too, and means the gradients are unusable anyway). The
    hook keeps these sums and tests them once per step (``any_nonfinite``): on a GPU each kernel
    launch costs host time comparable to the reduction itself.
    """
    return buf.sum(dtype=torch.float32)


def any_nonfinite(sums: list[torch.Tensor]) -> torch.Tensor:
    """Whether any of the ``finiteness_sum`` results is non-finite (a 0-dim bool tensor, no host sync)."""
    if not sums:
        return torch.zeros((), dtype=torch.bool)
    both = sums[0] if len(sums) == 1 else torch.stack(sums)
    return ~torch.isfinite(both).all()


def nonfinite_flag(buf: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(finiteness_sum(buf))


def local_grads_sum(params: list[torch.Tensor]) -> torch.Tensor:
    """``finiteness_sum`` over the local gradients left in ``.grad`` (the lazy pre-reduce check)."""
    sums = [finiteness_sum(p.grad) for p in params if p.grad is not None]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float32)


def lazy_pre_possible(model: DistributedDataParallel, device: torch.device) -> bool:
    """Can the pre-reduce check wait until the reduced bucket is known to be non-finite?

    Only where reading a flag on the host is free (CPU tensors) and the local gradients survive the
    all-reduce: DDP copies each gradient into its bucket and copies the reduced bucket back into
    ``.grad`` only after every bucket's future (callback included) has completed, unless the
    gradients *are* bucket views. A non-finite local gradient always makes the reduced bucket
    non-finite (NaN and Inf survive a sum), so a clean step then pays one pass over the gradients
    instead of two, and a failing step still learns which rank's local gradients were bad.
    """
    return device.type == "cpu" and not getattr(model, "gradient_as_bucket_view", False)


def hand_over_possible(model: DistributedDataParallel) -> bool:
    """Can the callback hand the reduced bucket to ``.grad`` instead of DDP copying it there?

    With gradient copies, DDP copies every reduced bucket into ``.grad`` after the callbacks: a
    pass that reads and writes all the gradients, costing more than the non-finite check's own
    pass. Told that an optimizer ran in backward (``Reducer._set_optimizer_in_backward``), DDP
    leaves ``.grad`` alone, and the callback points each ``.grad`` at its gradient's view of the
    reduced bucket instead, as ``gradient_as_bucket_view=True`` would: the same values, no copy.
    Only where that is exactly what DDP would have produced: every parameter gets a gradient each
    step (no ``find_unused_parameters``, no static graph), the bucket has the parameters' dtype
    (no mixed precision), and gradients are not bucket views already. (Every view is dropped by the
    auditor's ``CheckContext.drop_grads`` before the next backward, which would otherwise accumulate into it.)
    """
    reducer = getattr(model, "reducer", None)
    return (
        hasattr(reducer, "_set_optimizer_in_backward")
        and not getattr(model, "gradient_as_bucket_view", False)
        and not getattr(model, "find_unused_parameters", True)
        and not getattr(model, "static_graph", True)
        and getattr(model, "mixed_precision", None) is None
    )


def _dense(t: torch.Tensor) -> bool:
    """Is ``t`` non-overlapping and dense (some permutation of its dimensions is contiguous)?"""
    expected = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim())):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _before_reduce(state: HookState, bucket: Any, buf: torch.Tensor, params: list, grads: list) -> None:
    """What the hook reads of a bucket's local gradients before its all-reduce: a drill's injected
    faults first, then the non-finite sum (eager), the sentinels' sum of squares and, on audit
    steps, the signatures."""
    idx: list[int] = []
    if state.audit or state.injector is not None:
        idx = [state.index[id(p)] for p in params]
        if state.injector is not None:
            state.injector.on_local_grads([state.names[i] for i in idx], grads)
            # A real fault in backward corrupts .grad, which DDP copied into the bucket: mirror an
            # injected one there too, so that the lazy pre-reduce check sees what a real one would.
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if p.grad is not None and p.grad.data_ptr() != g.data_ptr():
                        p.grad.copy_(g)
    if state.eager_pre:
        with span("nonfinite_flags"):
            state.pre.append(finiteness_sum(buf))
    if state.sentinels:
        with span("sentinels"):
            state.sumsq.append((bucket.index(), sum_of_squares(buf)))
    if state.audit:
        probes = state.probes.subset(idx) if state.probes is not None else None
        with span("train_signature"):
            sig = signature(grads, mode=state.mode, probes=probes)
        for i, row in zip(idx, sig):
            state.local_sig[i] = row


def comm_hook(state, bucket):
    # No annotations: DDP inspects them, and `from __future__ import annotations` turns them into
    # strings it rejects ("bucket annotation should be dist.GradBucket").
    buf = bucket.buffer()
    params, grads = state.bucket_views(bucket, buf)
    _before_reduce(state, bucket, buf, params, grads)
    # No division here on a one-batch step: the auditor folds DDP's averaging into the loss (loss /
    # world before backward), so the sum this all-reduce computes is already the average. DDP's
    # own hook fuses its division into the copy into the bucket; a hook's ``div_`` would be one
    # more full pass. A micro-batch step pays that pass once (after n backward passes), so that
    # its weights are bit-equal to plain DDP accumulation: the same multiplication DDP makes;
    # unless the loop's loss carries the averaging (``average_over_ranks``: average is None).
    if state.average is not None:
        buf.mul_(state.average)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()

    def post(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        if state.injector is not None:
            state.injector.on_reduced(out)
        with span("nonfinite_flags"):
            total = finiteness_sum(out)
            state.post.append(total)
            # a CPU sum: reading it costs no device sync
            if not state.eager_pre and not math.isfinite(float(total)):
                state.pre.append(local_grads_sum(params))
        if state.hand_over:  # after the lazy check, which reads the local gradients from .grad
            for p, g in zip(params, grads):
                if p.grad is not None:
                    state.kept.append((p, p.grad))
                p.grad = g
        return out

    return fut.then(post)
