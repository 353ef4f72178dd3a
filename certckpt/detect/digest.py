"""The audit digest: a 32-bit value per tensor, for comparing tensors *within one job*.

The replay audit (deterministic mode) and the weight consensus only ask whether two ranks hold the
same bytes at the same moment; nothing outside the job ever reads these values. They use this digest,
about 2.5x cheaper than the 64-bit fingerprint (``certckpt.format.fingerprinting``, which checkpoints keep
and which the consensus at a checkpoint step still computes, for the writer to reuse):

    S32 = sum_i w_i * (T[i mod 2**16] * V[i div 2**16])  mod 2**32

with the fingerprint's words ``w_i`` (the bytes as 32-bit words) and the low 32 bits of its odd
multipliers ``T`` and ``V``. Every multiplier is odd, so a change confined to one word changes S32
by ``delta * m`` with ``0 < |delta| < 2**32`` and ``m`` odd, never 0 mod 2**32: always detected, as
with the fingerprint; unrelated changes collide with probability 2**-32 per tensor.

Why it is cheaper: the products stay 32-bit (one int32 multiply into a reused cache-sized buffer and
a row sum, against the fingerprint's widening to 64 bits), so it moves about a third of the bytes.
Wrapping int32 multiplication is checked at first use, as the fingerprint checks its int64 one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from certckpt.errors import PlatformError
from certckpt.format.fingerprinting import as_words
from certckpt.format.fpsum import CUDA_BLOCK_CHUNKS, FP_CHUNK_WORDS, per_thread, tables_for

__all__ = ["digest", "digests"]

_BLOCK_CHUNKS = 16  # 16 chunks of 2**16 words: a 4 MiB int32 scratch buffer per pass


def _low32_signed(x: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of int64 values as int32 (two's complement), without an overflowing cast."""
    return (((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000).to(torch.int32)


class _Tables32:
    def __init__(self, device: torch.device):
        t64 = tables_for(device)
        self.fp_tables = t64
        self.table = _low32_signed(t64.table)
        self.buf = torch.empty((_BLOCK_CHUNKS, FP_CHUNK_WORDS), dtype=torch.int32, device=device)
        probe = torch.tensor([0x7FFFFFFF, -(2**31), 0x12345679], dtype=torch.int32, device=device)
        got = (probe * self.table[:3]).tolist()
        want = [
            _low32_signed(torch.tensor(int(a) * int(b))).item() for a, b in zip(probe.tolist(), self.table[:3].tolist())
        ]
        if got != want:
            raise PlatformError("torch int32 multiplication does not wrap mod 2**32 on this build; cannot digest")


def _tables32(device: torch.device) -> _Tables32:
    return per_thread(_Tables32, device)


def _digest_words(words: torch.Tensor) -> torch.Tensor:
    if words.device.type == "cuda":
        from certckpt.format import fused

        if fused.digest_ready(words.device, digest_words_eager):
            return fused.digest_fused(words)
    return digest_words_eager(words)


def digest_words_eager(words: torch.Tensor, *, block_chunks: int | None = None) -> torch.Tensor:
    """S32 of int32 words with torch ops (the reference the fused CUDA kernel is checked against).

    ``block_chunks``: chunks per pass; default 16 on the CPU (a reused scratch buffer) and
    ``CUDA_BLOCK_CHUNKS`` on a GPU (launch-bound there; the caching allocator's memory). Any value
    gives the same digest.
    """
    tabs = _tables32(words.device)
    c_words = FP_CHUNK_WORDS
    n = words.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    chunks = -(-n // c_words)
    row_sums = torch.empty(chunks, dtype=torch.int32, device=words.device)
    if block_chunks is None and words.device.type == "cuda":
        block_chunks = CUDA_BLOCK_CHUNKS
    c = 0
    full = n // c_words
    while c < full:
        k = min(block_chunks or _BLOCK_CHUNKS, full - c)
        blk = words[c * c_words : (c + k) * c_words].view(k, c_words)
        buf = torch.mul(blk, tabs.table) if block_chunks else torch.mul(blk, tabs.table, out=tabs.buf[:k])
        # int32 row sums: exact mod 2**32 whatever the accumulator, and a quarter of an int64 row
        torch.sum(buf, 1, dtype=torch.int32, out=row_sums[c : c + k])
        c += k
    rest = n - full * c_words
    if rest:
        torch.sum(words[full * c_words :] * tabs.table[:rest], 0, dtype=torch.int32, out=row_sums[full])
    v = tabs.fp_tables.v_range(0, chunks) if block_chunks else _chunk_multipliers(tabs, chunks)
    # int64 products of int32 row sums and 64-bit odd multipliers: their low 32 bits are what count
    return (row_sums.to(torch.int64) * v).sum() & 0xFFFFFFFF


def _chunk_multipliers(tabs: _Tables32, chunks: int) -> torch.Tensor:
    """``V[0:chunks]`` from the fingerprint's cache of aligned blocks."""
    parts = []
    for first in range(0, chunks, _BLOCK_CHUNKS):
        parts.append(tabs.fp_tables.chunk_multipliers(first, min(_BLOCK_CHUNKS, chunks - first)))
    return torch.cat(parts)


def digest(t: torch.Tensor) -> torch.Tensor:
    """The tensor's 32-bit audit digest, as a 0-dim int64 tensor on its device (no host sync)."""
    return _digest_words(as_words(t))


def digests(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The digests of several tensors, stacked (int64 ``[P]``) on their device."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    device = tensors[0].device
    if len(tensors) > 1 and device.type == "cuda" and all(t.device == device for t in tensors):
        from certckpt.format import fused

        # one launch for all of them: per tensor, a launch costs more host time than a small digest
        if fused.many_digest_ready(device, digest_words_eager):
            return fused.digests_fused([as_words(t) for t in tensors])
    return torch.stack([digest(t) for t in tensors])
