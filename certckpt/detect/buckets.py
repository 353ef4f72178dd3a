"""DDP buckets as a triggered replay sees them: each bucket's layout, and its sum of squares
recomputed from replayed gradients.

Where a step's local gradients do not survive the all-reduce (no hand-over of ``.grad``:
``gradient_as_bucket_view=True``, ``hand_over_grads=False``, ``find_unused_parameters``, a static
graph), nothing is left after the step to digest. What is left is what the communication hook
took of each bucket's flat buffer before its all-reduce for the sentinels: its sum of squares
(``sum_of_squares``; ``HookState.sumsq``). That sum is the step's trained signature: a replay
recomputes the local gradients bit for bit (what every audit checks), lays them out as DDP lays
them into the bucket (``BucketLayout``: each parameter's gradient at its offset, in
``bucket.parameters()`` order, with the strides DDP gives it, zeros where a parameter has no
gradient) in a fresh buffer of the bucket's dtype and length, and reduces it with the same kernel:
the same bytes in the same order give the same 32 bits (``squares_match``). A sum of squares is a
weaker signature than a digest (a sign flip keeps it), but a trigger fires because some bucket's
sum of squares moved, so the fault that fired it is one the comparison sees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BucketLayout",
    "BucketSquares",
    "TrainedSquares",
    "layout_of",
    "lay_out",
    "bucket_squares",
    "squares_match",
    "sum_of_squares",
]


def sum_of_squares(buf: torch.Tensor) -> torch.Tensor:
    """A float32 0-dim tensor: the sum of the squares of ``buf`` (a sentinel; no host sync).

    A dot product: one read of the bucket without a temporary. It overflows to inf for an element
    near 1e19 or larger, which the sentinels read as an outlier (such a gradient is one).
    """
    if buf.dtype in (torch.float32, torch.float64) and buf.dim() == 1:
        return torch.dot(buf, buf).to(torch.float32)
    return torch.linalg.vector_norm(buf, dtype=torch.float32).square()


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketLayout:
    """Where each parameter's gradient lies in one DDP bucket's flat buffer.

    Attributes:
        index: DDP's bucket index (``GradBucket.index()``).
        numel: the buffer's length, in elements.
        dtype: the buffer's dtype.
        params: the trained parameters' indices, in ``bucket.parameters()`` order.
        offsets: each gradient's first element in the buffer.
        sizes: each gradient's shape.
        strides: each gradient's strides in the buffer (the parameter's own for a dense one,
            row-major otherwise: DDP's "gradient layout contract").
    """

    index: int
    numel: int
    dtype: torch.dtype
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.params)
        if not len(self.offsets) == len(self.sizes) == len(self.strides) == n:
            raise ValueError(f"bucket {self.index}: {n} parameters but other counts of offsets, sizes or strides")


@dataclass(frozen=True, slots=True)
class TrainedSquares:
    """A step's trained signature where no local gradient survived: the layouts of the buckets the
    hook reduced and the sums of squares it took of them, both in bucket-index order."""

    layouts: tuple[BucketLayout, ...]
    sums: torch.Tensor


def layout_of(index: int, buf: torch.Tensor, params: Sequence[int], views: Sequence[torch.Tensor]) -> BucketLayout:
    """The layout of bucket ``index`` from its buffer and each parameter's view into it (pure)."""
    base = buf.storage_offset()
    return BucketLayout(
        index=index,
        numel=buf.numel(),
        dtype=buf.dtype,
        params=tuple(params),
        offsets=tuple(int(v.storage_offset()) - int(base) for v in views),
        sizes=tuple(tuple(v.size()) for v in views),
        strides=tuple(tuple(v.stride()) for v in views),
    )


class BucketSquares:
    """Each bucket's sum of squares from gradients handed in one parameter at a time (a replay's).

    A bucket's buffer is made when its first gradient arrives and reduced, then freed, once its last
    one has: at most the buckets backward is filling are alive, as in training. ``result`` reduces
    the rest (a parameter that got no gradient stays zeros, as DDP's bucket holds it).
    """

    def __init__(self, layouts: Sequence[BucketLayout], *, device: torch.device) -> None:
        self.layouts = sorted(layouts, key=lambda lay: lay.index)
        self.device = device
        self.where = {p: (k, j) for k, lay in enumerate(self.layouts) for j, p in enumerate(lay.params)}
        self.bufs: list[torch.Tensor | None] = [None] * len(self.layouts)
        self.missing = [len(lay.params) for lay in self.layouts]
        self.sums: list[torch.Tensor | None] = [None] * len(self.layouts)

    def buffer(self, k: int) -> torch.Tensor:
        """Bucket k's buffer (the k-th layout by index), made on first use."""
        buf = self.bufs[k]
        if buf is None:
            # a buffer of its own, as DDP's is: a slice of a larger one could start at another
            # alignment, and a vectorised reduction may then add in another order
            lay = self.layouts[k]
            buf = self.bufs[k] = torch.zeros(lay.numel, dtype=lay.dtype, device=self.device)
        return buf

    def place(self, param: int, grad: torch.Tensor) -> int | None:
        """Copy trained parameter ``param``'s gradient into its bucket; returns the bucket's position
        (None: a parameter in no bucket, which DDP does not reduce, or one already reduced)."""
        hit = self.where.get(param)
        if hit is None or self.sums[hit[0]] is not None:
            return None
        k, j = hit
        lay = self.layouts[k]
        with torch.no_grad():
            self.buffer(k).as_strided(lay.sizes[j], lay.strides[j], lay.offsets[j]).copy_(grad)
        return k

    def add(self, param: int, grad: torch.Tensor) -> None:
        """``place`` the gradient; a bucket whose last gradient this was is reduced and freed."""
        k = self.place(param, grad)
        if k is not None:
            self.missing[k] -= 1
            if self.missing[k] == 0:
                self._reduce(k)

    def _reduce(self, k: int) -> None:
        self.sums[k] = sum_of_squares(self.buffer(k))
        self.bufs[k] = None

    def result(self) -> torch.Tensor:
        """The sums of squares, one per bucket in bucket-index order (float32, no host sync)."""
        for k, s in enumerate(self.sums):
            if s is None:
                self._reduce(k)
        if not self.sums:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.stack([s for s in self.sums if s is not None])


def lay_out(layout: BucketLayout, grads: Mapping[int, torch.Tensor], *, device: torch.device) -> torch.Tensor:
    """The bucket's flat buffer holding ``grads`` (trained parameter index -> gradient) as DDP lays
    them out; zeros for a parameter without one (pure)."""
    squares = BucketSquares([layout], device=device)
    buf = squares.buffer(0)
    for i, g in grads.items():
        squares.place(i, g)
    return buf


def bucket_squares(
    layouts: Sequence[BucketLayout], grads: Mapping[int, torch.Tensor], *, device: torch.device
) -> torch.Tensor:
    """Each bucket's sum of squares of ``grads`` laid out as DDP lays them into its buffers (pure;
    see ``BucketSquares``)."""
    squares = BucketSquares(layouts, device=device)
    for i, g in grads.items():
        squares.add(i, g)
    return squares.result()


def squares_match(a: torch.Tensor, b: torch.Tensor, *, mode: str, rtol: float) -> list[bool]:
    """Per bucket: do two float32 sums of squares agree? (Host tensors.)

    Deterministic mode compares their 32 bits (a replay reproduces the sum exactly; a NaN agrees
    only with the same NaN). Tolerance mode compares the bucket norms (the square roots) within
    ``rtol``, as an audit compares each gradient's norm there; two equal infinities agree (a finite
    gradient of 1e19 or more overflows the sum in training and replay alike), a NaN never.
    """
    if mode == "deterministic":
        return (a.view(torch.int32) == b.view(torch.int32)).tolist()
    na, nb = a.double().sqrt(), b.double().sqrt()
    close = (na - nb).abs() <= rtol * torch.maximum(na, nb) + 1e-30
    return ((a == b) | (close & torch.isfinite(na) & torch.isfinite(nb))).tolist()
