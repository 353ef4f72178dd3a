"""A shard's contribution to its global tensor's device fingerprint, computed from the shard alone.

Rule (``docs/format.md``, "Sharded checkpoints (DCP)"): the contribution P of a shard of X is the v1
word sum S over X's byte sequence in which every byte outside the shard is zero. A shard is a
hyper-rectangle of X (DCP's ``offsets`` and ``sizes``); in X's C order it is a set of *runs*, maximal
stretches of consecutive elements (one run when the shard is split along the first dimension only).
Each run is a byte range ``[s*e, (s+R)*e)`` of X; its words are ``w_i`` for ``i`` from ``floor(s*e/4)``
to ``ceil((s+R)*e/4)``, with the bytes of the words it only partly covers read as zero. So for 4- and
8-byte dtypes a run is whole words; a 1- or 2-byte run may start or end inside a word, and then that
word's value is the sum of the present bytes' terms (bytes 0-2 unsigned, byte 3 signed).

Long runs go through ``format.fingerprinting.raw_sum`` (the same kernel as the fingerprint); many short
runs (a shard split along an inner dimension) through one vectorised gather of the multipliers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from certckpt.errors import ArgumentTypeError
from certckpt.format.fingerprinting import as_words, raw_sum
from certckpt.format.fpsum import FP_CHUNK_WORDS, SEED_V, tables_for

from .composition import M64

__all__ = ["contribution", "tensor_contribution", "write_sums", "sum_plan", "runs_of"]

_C = FP_CHUNK_WORDS
_LONG_RUN_BYTES = 1 << 18  # from 256 KiB on, a run is summed alone with raw_sum
_BLOCK_PIECES = 1 << 18  # pieces per vectorised block: about 8 MiB of int64 temporaries


def _signed(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)  # `>>` is arithmetic on int64: mask to make it logical


def _chunk_multipliers(first: int, count: int, device: torch.device) -> torch.Tensor:
    """``V[first : first + count]`` (splitmix64 of ``c ^ SEED_V``, made odd) as int64 on ``device``."""
    z = torch.arange(first, first + count, dtype=torch.int64, device=device) ^ SEED_V
    z = z + _signed(0x9E3779B97F4A7C15)
    z = (z ^ _lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _lsr(z, 27)) * _signed(0x94D049BB133111EB)
    return (z ^ _lsr(z, 31)) | 1


def _words_of(b: torch.Tensor) -> torch.Tensor:
    """Whole-word bytes (length a multiple of 4) as int32 words, without a copy when aligned."""
    if b.storage_offset() % 4:
        b = b.clone()
    return b.view(torch.int32)


def _sum_at(words: torch.Tensor, first_word: int) -> int:
    """``sum_j words[j] * m[first_word + j]`` mod 2**64, for any starting word index."""
    n = words.numel()
    if n == 0:
        return 0
    tabs = tables_for(words.device)
    a, c0 = first_word % _C, first_word // _C
    head = min(n, (_C - a) % _C)
    total = 0
    if head:
        part = (words[:head].to(torch.int64) * tabs.table[a : a + head]).sum() * _chunk_multipliers(c0, 1, words.device)
        total += int(part)
    if head < n:
        total += int(raw_sum(words[head:], (first_word + head) // _C))
    return total & M64


def _segment(b: torch.Tensor, global_byte: int) -> int:
    """The contribution of one run: bytes ``b`` at byte offset ``global_byte`` of the global tensor."""
    lead = global_byte % 4
    if lead == 0 and b.numel() % 4 == 0:
        return _sum_at(_words_of(b), global_byte // 4)
    padded = torch.zeros(-(-(lead + b.numel()) // 4) * 4, dtype=torch.uint8, device=b.device)
    padded[lead : lead + b.numel()] = b
    return _sum_at(padded.view(torch.int32), global_byte // 4)


def _rows(rows: torch.Tensor, starts: torch.Tensor, elem: int) -> int:
    """Many short runs at once: ``rows`` (uint8, one run per row), ``starts`` their global byte offsets.

    Rows are grouped by where they start inside a word (at most 4 groups), so the position of every
    piece inside its row's words is one 1-D pattern per group; each row then needs one window of the
    multiplier table and, as a run is at most one multiplier chunk long, at most two chunk factors.
    """
    leads = starts % 4
    total = 0
    for lead in torch.unique(leads).tolist():
        sel = leads == lead
        if bool(sel.all()):
            total += _rows_at(rows, starts, elem, lead)
        else:
            total += _rows_at(rows[sel], starts[sel], elem, lead)
    return total & M64


def _rows_at(rows: torch.Tensor, starts: torch.Tensor, elem: int, lead: int) -> int:
    device = rows.device
    width = rows.shape[1]
    if lead == 0 and width % 4 == 0:  # whole words: 4- and 8-byte dtypes, aligned 1- and 2-byte runs
        vals = rows.contiguous().view(torch.int32).to(torch.int64)
        woff = torch.arange(width // 4, dtype=torch.int64, device=device)
    else:
        # each element is a piece of its word, shifted to its byte position and read signed only
        # when it holds the word's top byte
        raw = rows.contiguous().view(torch.int8 if elem == 1 else torch.int16).to(torch.int64)
        pos = lead + torch.arange(0, width, elem, dtype=torch.int64, device=device)
        shift = pos % 4
        vals = torch.where(shift + elem == 4, raw, raw & ((1 << (8 * elem)) - 1)) << (8 * shift)
        woff = pos // 4
    first_word = (starts - lead) // 4
    a = first_word % _C
    c = first_word // _C
    c0 = int(c.min())
    v = _chunk_multipliers(c0, int(c.max()) - c0 + 2, device)
    v_lo = v[c - c0]
    tidx = a.unsqueeze(1) + woff
    table = tables_for(device).table
    if int(a.max()) + int(woff[-1]) < _C:  # no run crosses a multiplier chunk
        return int((((vals * table[tidx]).sum(1)) * v_lo).sum()) & M64
    cross = tidx >= _C
    prod = vals * table[tidx - _C * cross]
    hi = (prod * cross).sum(1)
    lo = prod.sum(1) - hi
    return int((lo * v_lo + hi * v[c - c0 + 1]).sum()) & M64


def runs_of(offsets: Sequence[int], sizes: Sequence[int], global_shape: Sequence[int]) -> tuple[int, int, list[int]]:
    """How a shard lies in its global tensor's C order.

    Returns:
        ``(d, run_length, global_strides)``: dimensions after ``d`` are whole, so each run covers
        ``sizes[d] * prod(global_shape[d+1:])`` consecutive elements; the runs are enumerated by the
        indices of dimensions ``0..d-1`` in C order.
    """
    k = len(global_shape)
    strides, acc = [0] * k, 1
    for a in range(k - 1, -1, -1):
        strides[a] = acc
        acc *= global_shape[a]
    if k == 0:
        return 0, 1, strides
    d = k - 1
    while d > 0 and offsets[d] == 0 and sizes[d] == global_shape[d]:
        d -= 1
    run = sizes[d]
    for a in range(d + 1, k):
        run *= global_shape[a]
    return d, run, strides


def _run_starts(
    first: int,
    count: int,
    d: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
    strides: Sequence[int],
    device: torch.device,
) -> torch.Tensor:
    """Global element index of the first element of runs ``first .. first+count-1``."""
    r = torch.arange(first, first + count, dtype=torch.int64, device=device)
    start = torch.full_like(r, offsets[d] * strides[d] if strides else 0)
    for a in range(d - 1, -1, -1):
        start += (offsets[a] + r % sizes[a]) * strides[a]
        r = r // sizes[a]
    return start


def _run_start(r: int, d: int, offsets: Sequence[int], sizes: Sequence[int], strides: Sequence[int]) -> int:
    start = offsets[d] * strides[d] if strides else 0
    for a in range(d - 1, -1, -1):
        start += (offsets[a] + r % sizes[a]) * strides[a]
        r //= sizes[a]
    return start


def contribution(
    b: torch.Tensor,
    *,
    elem_size: int,
    offsets: Sequence[int],
    sizes: Sequence[int],
    global_shape: Sequence[int],
    first_element: int = 0,
) -> int:
    """The contribution (mod 2**64) of some consecutive elements of a shard to its tensor's word sum S.

    Args:
        b: the elements' bytes, a 1-D uint8 tensor (any device), a whole number of elements.
        elem_size: bytes per element of the tensor's dtype.
        offsets, sizes: the shard's position and extent in the global tensor (DCP's chunk).
        global_shape: the global tensor's shape.
        first_element: index of ``b``'s first element among the shard's elements in C order (so a
            shard can be fed in pieces; the pieces' contributions add up).
    """
    offsets, sizes, global_shape = list(offsets), list(sizes), list(global_shape)
    if not (len(offsets) == len(sizes) == len(global_shape)) or any(
        o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, global_shape)
    ):
        raise ArgumentTypeError(f"shard offsets {offsets} and sizes {sizes} do not fit in shape {global_shape}")
    if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() % elem_size:
        raise ArgumentTypeError("contribution takes a 1-D uint8 tensor of whole elements")
    n = b.numel() // elem_size
    if n == 0:
        return 0
    d, run, strides = runs_of(offsets, sizes, global_shape)
    total = 0
    pos = first_element
    end = first_element + n
    while pos < end:
        r, within = divmod(pos, run)
        if within or end - pos < run or run * elem_size >= _LONG_RUN_BYTES:
            # a partial run, or a long one: alone
            take = min(run - within, end - pos)
            start = _run_start(r, d, offsets, sizes, strides) + within
            lo = (pos - first_element) * elem_size
            total += _segment(b[lo : lo + take * elem_size], start * elem_size)
            pos += take
            continue
        # whole short runs: as many as fit in one vectorised block
        count = min((end - pos) // run, max(1, _BLOCK_PIECES // max(run * elem_size // min(elem_size, 4), 1)))
        lo = (pos - first_element) * elem_size
        rows = b[lo : lo + count * run * elem_size].view(count, run * elem_size)
        starts = _run_starts(r, count, d, offsets, sizes, strides, b.device) * elem_size
        total += _rows(rows, starts, elem_size)
        pos += count * run
    return total & M64


def tensor_contribution(t: torch.Tensor, *, offsets: Sequence[int], global_shape: Sequence[int]) -> int:
    """The contribution of a whole shard held as a tensor (its shape is the shard's sizes)."""
    flat = t.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    flat = flat.reshape(-1)
    b = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if b.storage_offset() % 4 and flat.element_size() < 4:
        b = b.clone()  # keep word views possible for the aligned runs
    return contribution(b, elem_size=t.element_size(), offsets=offsets, sizes=list(t.shape), global_shape=global_shape)


def _dual_sum(words: torch.Tensor, shift: int) -> tuple[int, int]:
    """One pass, two sums: S of ``words`` as a tensor of its own, and S of the same words placed
    ``shift`` multiplier chunks further (a shard whose first word starts chunk ``shift``): each
    chunk's inner sum is the same, only the chunk factor differs."""
    device = words.device
    tabs = tables_for(device)
    n, full = words.numel(), words.numel() // _C
    own = torch.zeros((), dtype=torch.int64, device=device)
    placed = torch.zeros((), dtype=torch.int64, device=device)
    c = 0
    while c < full:
        k = min(tabs.buf.shape[0], full - c)
        buf = tabs.buf[:k]
        buf.copy_(words[c * _C : (c + k) * _C].view(k, _C))
        buf.mul_(tabs.table)
        rows = buf.sum(1)
        own += (rows * tabs.chunk_multipliers(c, k)).sum()
        placed += (rows * _chunk_multipliers(c + shift, k, device)).sum()
        c += k
    rest = n - full * _C
    if rest:
        tail = (words[full * _C :].to(torch.int64) * tabs.table[:rest]).sum()
        own += tail * tabs.chunk_multipliers(full, 1)[0]
        placed += tail * _chunk_multipliers(full + shift, 1, device)[0]
    return int(own) & M64, int(placed) & M64


def sum_plan(shape: Sequence[int], *, offsets: Sequence[int], global_shape: Sequence[int], elem_size: int) -> str:
    """How a writer gets a shard's contribution most cheaply, given that it fingerprints the shard anyway.

    Returns:
        ``"own"``: the shard is one run starting at the global tensor's first byte (the whole
        tensor, or FSDP's first dim-0 shard): its contribution is its own word sum S, which the
        fingerprint already holds (``composition.raw_of``). ``"dual"``: one run starting on a
        multiplier-chunk boundary: one pass gives both sums (``write_sums``). ``"separate"``: any
        other layout: a pass of its own (``tensor_contribution``).
    """
    shape, offsets, global_shape = list(shape), list(offsets), list(global_shape)
    d, _, strides = runs_of(offsets, shape, global_shape)
    runs = 1
    for a in range(d):
        runs *= shape[a]
    if runs != 1:
        return "separate"
    start_byte = _run_start(0, d, offsets, shape, strides) * elem_size
    if start_byte == 0:
        return "own"
    return "dual" if start_byte % (4 * _C) == 0 else "separate"


def write_sums(t: torch.Tensor, *, offsets: Sequence[int], global_shape: Sequence[int]) -> tuple[int, int]:
    """``(S of the shard as a tensor of its own, its contribution to the global tensor)`` in one pass
    where ``sum_plan`` says ``own`` or ``dual``, two otherwise."""
    words = as_words(t)
    plan = sum_plan(t.shape, offsets=offsets, global_shape=global_shape, elem_size=t.element_size())
    if plan == "own":
        s = int(raw_sum(words)) & M64
        return s, s
    if plan == "dual":
        d, _, strides = runs_of(list(offsets), list(t.shape), list(global_shape))
        start_byte = _run_start(0, d, list(offsets), list(t.shape), strides) * t.element_size()
        return _dual_sum(words, start_byte // (4 * _C))
    return int(raw_sum(words)) & M64, tensor_contribution(t, offsets=offsets, global_shape=global_shape)
