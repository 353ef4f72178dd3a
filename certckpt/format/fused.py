"""One-pass fingerprint and audit-digest kernels for CUDA, written in Triton.

The eager path (``fingerprinting.raw_sum``, ``detect.digest``) costs about five kernel launches per
block of 16 chunks and is launch-bound on a GPU (1 % of an H200's read bandwidth, issue 15). The
same sums, regrouped: with ``w[c, j]`` the word at position ``j`` of chunk ``c``,

    S = sum_c sum_j w[c, j] * T[j] * V[c] = sum_j T[j] * (sum_c w[c, j] * V[c])   (mod 2**64)

so a program owns a block of positions ``j`` across a group of chunks: it reads its words once
(contiguous, coalesced), accumulates ``w * V[c]`` per position in registers, multiplies by its slice
of ``T`` once at the end and writes one partial sum. The partials (one per program) are added by
torch. Integer sums mod 2**64 (mod 2**32 for the digest) do not depend on grouping or order, so the
result is the specification's bits exactly, as on every other path; the first use on each device
checks that against the eager path and, if it differs or Triton fails, warns and stays eager.

Used only for CUDA tensors, and only where Triton imports (torch's CUDA wheels ship it);
``CERTCKPT_TRITON=0`` turns it off. With ``TRITON_INTERPRET=1`` (Triton's interpreter) the kernels
also run on CPU tensors: that is how the tests check the arithmetic on machines without a GPU.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import SupportsInt, TypedDict

import torch

from .fpsum import FP_CHUNK_WORDS, SEED_V, raw_sum_eager, tables_for, torch_splitmix64

__all__ = [
    "LAUNCH",
    "ready",
    "digest_ready",
    "raw_sum_fused",
    "raw_sums_fused",
    "digest_fused",
    "digests_fused",
    "many_ready",
    "many_digest_ready",
    "self_check",
]


# How the kernel is launched: positions per program (a power of two dividing FP_CHUNK_WORDS), warps
# per program, and chunks per program (None: by size, ``_chunks_per_program``). Any choice gives the
# same bits; benchmarks/bench_gpu.py times the alternatives on a GPU.
class Launch(TypedDict):
    cols: int
    num_warps: int
    chunks: int | None


LAUNCH: Launch = {"cols": 1024, "num_warps": 4, "chunks": None}

# The eager sum a fused one is checked against: ``reference(words)``, a 0-dim tensor or an int.
Reference = Callable[[torch.Tensor], SupportsInt]
# A layout's kernel table: the device tensor, its program rows, chunks per program, multipliers reached.
_LayoutTable = tuple[torch.Tensor, int, int, int]

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton (CPU wheels), or a broken install: the eager path serves
    triton = None

if triton is not None:
    # Triton reads these kernels' parameter annotations (tl.constexpr) to specialize them, so they get
    # no others; to the type checker triton is untyped. Hence the two ignores on each.
    @triton.jit  # type: ignore[untyped-decorator]
    def _partials_kernel(  # type: ignore[no-untyped-def]
        words_ptr,
        table_ptr,
        v_ptr,
        out_ptr,
        n_words,
        n_chunks,
        COLS: tl.constexpr,
        CHUNKS: tl.constexpr,
        C: tl.constexpr,
        ACC: tl.constexpr,
    ):
        col_block = tl.program_id(0)
        group = tl.program_id(1)
        j = col_block * COLS + tl.arange(0, COLS)
        acc = tl.zeros([COLS], dtype=ACC)
        first = group * CHUNKS
        for k in range(CHUNKS):
            c = first + k
            offs = c.to(tl.int64) * C + j
            w = tl.load(words_ptr + offs, mask=offs < n_words, other=0).to(ACC)
            v = tl.load(v_ptr + c, mask=c < n_chunks, other=0).to(ACC)
            acc += w * v
        t = tl.load(table_ptr + j).to(ACC)
        # Summed as int64 and stored truncated: the digest's int32 partial keeps the low 32 bits, as a
        # wrapping int32 sum would (Triton 3.6's interpreter refuses an int32 sum that overflows).
        tl.store(out_ptr + group * tl.num_programs(0) + col_block, tl.sum((acc * t).to(tl.int64), axis=0))

    @triton.jit  # type: ignore[untyped-decorator]
    def _many_kernel(  # type: ignore[no-untyped-def]
        base_ptr,
        meta_ptr,
        table_ptr,
        v_ptr,
        out_ptr,
        n_tensors,
        COLS: tl.constexpr,
        CHUNKS: tl.constexpr,
        C: tl.constexpr,
        ACC: tl.constexpr,
    ):
        # One launch for many tensors. ``meta`` (int64) holds, per tensor, its words' offset from
        # ``base_ptr`` and its word count, then per program row the tensor and its group of chunks.
        col_block = tl.program_id(0)
        row = tl.program_id(1)
        p = tl.load(meta_ptr + 2 * n_tensors + 2 * row)
        group = tl.load(meta_ptr + 2 * n_tensors + 2 * row + 1)
        start = tl.load(meta_ptr + 2 * p)
        n_words = tl.load(meta_ptr + 2 * p + 1)
        j = col_block * COLS + tl.arange(0, COLS)
        acc = tl.zeros([COLS], dtype=ACC)
        first = group * CHUNKS
        for k in range(CHUNKS):
            c = first + k
            offs = c * C + j
            w = tl.load(base_ptr + start + offs, mask=offs < n_words, other=0).to(ACC)
            v = tl.load(v_ptr + c).to(ACC)  # V is long enough for every row: no mask
            acc += w * v
        t = tl.load(table_ptr + j).to(ACC)
        # Integer sums mod 2**64 do not depend on order: the programs of a tensor add up atomically.
        tl.atomic_add(out_ptr + p, tl.sum((acc * t).to(tl.int64), axis=0))


class _Multipliers:
    """``V[0:n]`` (as int64, and its low 32 bits as int32) on one device, grown as needed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.v64 = torch.zeros(0, dtype=torch.int64, device=device)
        self.v32 = torch.zeros(0, dtype=torch.int32, device=device)
        self.t32: torch.Tensor | None = None
        self.layouts: dict[tuple[tuple[tuple[int, int], ...], int | None], _LayoutTable] = {}

    def get(self, first: int, count: int, *, wide: bool) -> torch.Tensor:
        if first:  # a piece of a longer sequence (streaming): computed for this call only
            v = _v_range(first, count, self.device)
            return v if wide else _low32(v)
        if count > self.v64.numel():
            size = max(count, 2 * self.v64.numel(), 256)
            self.v64 = _v_range(0, size, self.device)
            self.v32 = _low32(self.v64)
        return self.v64[:count] if wide else self.v32[:count]

    def layout(self, layout: tuple[tuple[int, int], ...]) -> _LayoutTable:
        """The multi-tensor kernel's table for ``layout`` (each tensor's word offset and count): the
        device tensor, its program rows, chunks per program and the multipliers the rows reach.
        Kept for the last few layouts: a model's parameters and a DDP bucket's views keep theirs."""
        key = (layout, LAUNCH["chunks"])
        hit = self.layouts.get(key)
        if hit is not None:
            return hit
        chunks = [-(-n // FP_CHUNK_WORDS) for _, n in layout]
        per = LAUNCH["chunks"] or _chunks_per_program(max(chunks))
        head = [x for pair in layout for x in pair]
        rows = [x for k, c in enumerate(chunks) for g in range(-(-c // per)) for x in (k, g)]
        meta = torch.tensor(head + rows, dtype=torch.int64).to(self.device)
        hit = (meta, len(rows) // 2, per, -(-max(chunks) // per) * per)
        if len(self.layouts) >= 64:
            self.layouts.pop(next(iter(self.layouts)))
        self.layouts[key] = hit
        return hit

    def table32(self) -> torch.Tensor:
        if self.t32 is None:
            self.t32 = _low32(tables_for(self.device).table)
        return self.t32


def _v_range(first: int, count: int, device: torch.device) -> torch.Tensor:
    c = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return torch_splitmix64(c ^ SEED_V) | 1


def _low32(x: torch.Tensor) -> torch.Tensor:
    return (((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


_local = threading.local()


def _multipliers(device: torch.device) -> _Multipliers:
    cache = getattr(_local, "mult", None)
    if cache is None:
        cache = _local.mult = {}
    m = cache.get(device)
    if m is None:
        m = cache[device] = _Multipliers(device)
    return m


def _chunks_per_program(n_chunks: int) -> int:
    # enough programs to fill a large GPU (64 column blocks x groups), few partials to add up
    if n_chunks >= 1024:
        return 32
    if n_chunks >= 64:
        return 8
    return 1


def _partials(words: torch.Tensor, first_chunk: int, *, wide: bool) -> torch.Tensor:
    n = words.numel()
    c_words = FP_CHUNK_WORDS
    cols = LAUNCH["cols"]
    n_chunks = -(-n // c_words)
    per = LAUNCH["chunks"] or _chunks_per_program(n_chunks)
    groups = -(-n_chunks // per)
    mult = _multipliers(words.device)
    acc = tl.int64 if wide else tl.int32
    table = tables_for(words.device).table if wide else mult.table32()
    v = mult.get(first_chunk, groups * per, wide=wide)
    out = torch.empty(groups * (c_words // cols), dtype=torch.int64 if wide else torch.int32, device=words.device)
    grid = (c_words // cols, groups)
    _partials_kernel[grid](
        words, table, v, out, n, n_chunks, COLS=cols, CHUNKS=per, C=c_words, ACC=acc, num_warps=LAUNCH["num_warps"]
    )
    return out


def raw_sum_fused(words: torch.Tensor, first_chunk: int = 0) -> torch.Tensor:
    """``fingerprinting.raw_sum`` in one kernel (plus one torch sum of the partials); same bits."""
    if not words.numel():
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return _partials(words, first_chunk, wide=True).sum()


def digest_fused(words: torch.Tensor) -> torch.Tensor:
    """``detect.digest``'s S32 of the words (0-dim int64 in [0, 2**32)), in one kernel; same bits."""
    if not words.numel():
        return torch.zeros((), dtype=torch.int64, device=words.device)
    return _partials(words, 0, wide=False).sum(dtype=torch.int64) & 0xFFFFFFFF


def _many(words: list[torch.Tensor], *, wide: bool) -> torch.Tensor:
    """Per-tensor sums (int64 ``[P]``; the digest's still to be masked to 32 bits) in one launch."""
    device = words[0].device
    live = [(i, w) for i, w in enumerate(words) if w.numel()]
    if not live:
        return torch.zeros(len(words), dtype=torch.int64, device=device)
    base = min((w for _, w in live), key=lambda w: w.data_ptr())
    # Every word view is 4-byte aligned (as_words), so each tensor is a whole number of words away
    # from the lowest-addressed one; the kernel addresses all of them from its pointer, forwards.
    layout = tuple(((w.data_ptr() - base.data_ptr()) // 4, w.numel()) for _, w in live)
    mult = _multipliers(device)
    meta, rows, per, span = mult.layout(layout)
    v = mult.get(0, span, wide=wide)
    table = tables_for(device).table if wide else mult.table32()
    cols = LAUNCH["cols"]
    sums = torch.zeros(len(live), dtype=torch.int64, device=device)
    _many_kernel[(FP_CHUNK_WORDS // cols, rows)](
        base,
        meta,
        table,
        v,
        sums,
        len(live),
        COLS=cols,
        CHUNKS=per,
        C=FP_CHUNK_WORDS,
        ACC=tl.int64 if wide else tl.int32,
        num_warps=LAUNCH["num_warps"],
    )
    if len(live) == len(words):
        return sums
    out = torch.zeros(len(words), dtype=torch.int64, device=device)
    out[torch.tensor([i for i, _ in live], device=device)] = sums
    return out


def raw_sums_fused(words: list[torch.Tensor]) -> torch.Tensor:
    """``fingerprinting.raw_sum`` of each of several word tensors on one CUDA device: int64 ``[P]``, one
    kernel launch for all of them (a model's many small tensors cost one launch, not one each)."""
    return _many(words, wide=True)


def digests_fused(words: list[torch.Tensor]) -> torch.Tensor:
    """``detect.digest``'s S32 of each of several word tensors on one device: int64 ``[P]``, one launch."""
    return _many(words, wide=False) & 0xFFFFFFFF


_checked: dict[tuple[torch.device, str], bool] = {}
_lock = threading.Lock()


def _sample(device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(20261130)
    n = 3 * FP_CHUNK_WORDS + 1234  # whole chunks and a partial one
    return torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g).to(device)


def _agree(device: torch.device, what: str, cases: Callable[[], Iterable[tuple[SupportsInt, SupportsInt]]]) -> bool:
    """Run ``cases() -> [(fused, eager), ...]``; a disagreement or a failure is warned about once."""
    try:
        problem = None if all(int(a) == int(b) for a, b in cases()) else "it disagrees with the eager path"
    except Exception as e:  # any Triton or driver failure: stay eager
        problem = f"{type(e).__name__}: {e}"
    if problem is not None:
        warnings.warn(f"certckpt: fused {what} kernel off on {device}, using eager ({problem})", stacklevel=4)
    return problem is None


def self_check(device: torch.device) -> bool:
    """The fused fingerprint sum against the eager one on a known block (and at a chunk offset)."""
    words = _sample(device)
    piece = words[: FP_CHUNK_WORDS + 7]
    return _agree(
        device,
        "fingerprint",
        lambda: [(raw_sum_fused(words), raw_sum_eager(words)), (raw_sum_fused(piece, 5), raw_sum_eager(piece, 5))],
    )


def _many_sample(device: torch.device) -> list[torch.Tensor]:
    # empty, one word, a chunk and a bit, several chunks (views of one buffer) and a tensor of its own
    words = _sample(device)
    c = FP_CHUNK_WORDS
    return [words[c + 8 :], words[:0], words[:1], words[1 : c + 8], words[5:9].clone()]  # not in address order


def _many_check(
    device: torch.device, what: str, many: Callable[[list[torch.Tensor]], torch.Tensor], reference: Reference
) -> bool:
    """``many(words_list)`` against ``reference(words)`` of each, on the mixed sample, once per device."""

    def check() -> bool:
        parts = _many_sample(device)
        return _agree(device, what, lambda: zip(many(parts).tolist(), map(reference, parts)))

    return _once(device, what, check)


def many_ready(device: torch.device) -> bool:
    """Whether the one-launch fingerprint sum of many tensors serves ``device`` (checked once)."""
    return ready(device) and _many_check(device, "many-tensor fingerprint", raw_sums_fused, raw_sum_eager)


def many_digest_ready(device: torch.device, reference: Reference) -> bool:
    """Whether the one-launch audit digest of many tensors serves ``device``, checked once against
    ``reference(words)`` (the eager digest)."""
    return digest_ready(device, reference) and _many_check(device, "many-tensor digest", digests_fused, reference)


def _enabled(device: torch.device) -> bool:
    return device.type == "cuda" and triton is not None and os.environ.get("CERTCKPT_TRITON") != "0"


def _once(device: torch.device, kind: str, check: Callable[[], bool]) -> bool:
    ok = _checked.get((device, kind))
    if ok is None:
        with _lock:
            ok = _checked.get((device, kind))
            if ok is None:
                ok = _checked[(device, kind)] = check()
    return ok


def ready(device: torch.device) -> bool:
    """Whether the fused fingerprint serves tensors on ``device`` (CUDA with Triton, checked once)."""
    return _enabled(device) and _once(device, "fingerprint", lambda: self_check(device))


def digest_ready(device: torch.device, reference: Reference) -> bool:
    """Whether the fused audit digest serves ``device``, checked once against ``reference(words)``
    (the eager digest, which lives with the detection code above this layer)."""
    if not _enabled(device):
        return False

    def check() -> bool:
        words = _sample(device)
        return _agree(device, "audit digest", lambda: [(digest_fused(words), reference(words))])

    return _once(device, "digest", check)
