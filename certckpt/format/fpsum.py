"""The fingerprint's sum S with torch ops: the specification's constants, the multiplier tables and
the eager sum that every faster path must match (``docs/format.md``, fingerprint v1).

``fingerprinting`` (the fingerprint API, which picks the fastest path) and ``fused`` (the Triton
kernels, checked against the eager sum at first use) both build on this module, so neither imports
the other to get at the tables. ``certckpt.detect`` shares the tables and ``per_thread`` for the
audit digest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from certckpt.errors import PlatformError

__all__ = [
    "M64",
    "SEED_T",
    "SEED_V",
    "FP_CHUNK_WORDS",
    "BLOCK_CHUNKS",
    "CUDA_BLOCK_CHUNKS",
    "BlockSum",
    "splitmix64",
    "fmix64",
    "torch_splitmix64",
    "FingerprintTables",
    "per_thread",
    "tables_for",
    "raw_sum_eager",
    "raw_sum_one_thread",
]

# S of one block of BLOCK_CHUNKS chunks: (words [k, C] int32, T [C] int64, V [k] int64) -> 0-dim int64
BlockSum = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

M64 = (1 << 64) - 1
SEED_T = 0x6365727463_6B7074  # "certckpt"
SEED_V = 0x76_61756C74_6670  # "vaultfp"
FP_CHUNK_WORDS = 1 << 16  # C: multiplier table length, part of the specification
BLOCK_CHUNKS = 16  # implementation choice: 16 chunks (1 Mi words, 8 MiB of int64) per eager pass
# On a GPU the eager path (the fallback without Triton) is launch-bound: six launches per 16 chunks
# read 1 % of an H200's bandwidth (issue 15). There it takes 256 chunks per pass, in the caching
# allocator's memory rather than a scratch buffer kept per thread (128 MiB of int64 per pass).
CUDA_BLOCK_CHUNKS = 256


def splitmix64(x: int) -> int:
    """The splitmix64 output function (Steele, Lea, Flood 2014) on a 64-bit integer."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer: a bijection on 64-bit integers."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB93FE53B6E53) & M64
    return x ^ (x >> 33)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def torch_splitmix64(x: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps mod 2**64; `>>` is arithmetic on int64, so mask to make it logical.
    def lsr(z: torch.Tensor, k: int) -> torch.Tensor:
        return (z >> k) & ((1 << (64 - k)) - 1)

    z = x + _signed(0x9E3779B97F4A7C15)
    z = (z ^ lsr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ lsr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ lsr(z, 31)


class FingerprintTables:
    """Per-device multiplier tables and scratch buffers (one set per thread: buffers are reused)."""

    def __init__(self, device: torch.device):
        j = torch.arange(FP_CHUNK_WORDS, dtype=torch.int64)
        t = torch_splitmix64(j ^ SEED_T) | 1
        # Guard against a torch build whose int64 ops do not wrap: spot-check against Python ints.
        for idx in (0, 1, 12345, FP_CHUNK_WORDS - 1):
            if int(t[idx]) != _signed(splitmix64(idx ^ SEED_T) | 1):
                raise PlatformError("torch int64 arithmetic does not wrap mod 2**64 on this build; cannot fingerprint")
        self.device = device
        self.table = t.to(device)
        self.buf = torch.empty((BLOCK_CHUNKS, FP_CHUNK_WORDS), dtype=torch.int64, device=device)
        self._v: dict[int, torch.Tensor] = {}
        self._v_all = torch.zeros(0, dtype=torch.int64, device=device)

    def v_range(self, first: int, count: int) -> torch.Tensor:
        """``V[first : first + count]`` from one device tensor that grows as needed (large blocks)."""
        end = first + count
        if end > self._v_all.numel():
            size = max(end, 2 * self._v_all.numel(), 1024)
            c = torch.arange(size, dtype=torch.int64, device=self.device)
            self._v_all = torch_splitmix64(c ^ SEED_V) | 1
        return self._v_all[first:end]

    def chunk_multipliers(self, first: int, count: int) -> torch.Tensor:
        """``V[first : first + count]`` on the device; aligned blocks are cached (bounded)."""
        if first % BLOCK_CHUNKS or count > BLOCK_CHUNKS:
            return self._make_v(first, count)
        block = first // BLOCK_CHUNKS
        v = self._v.get(block)
        if v is None:
            v = self._make_v(first, BLOCK_CHUNKS)
            if len(self._v) < 4096:  # 4096 blocks of 16 chunks cover a 256 GiB tensor
                self._v[block] = v
        return v[:count]

    def _make_v(self, first: int, count: int) -> torch.Tensor:
        values = [_signed(splitmix64(c ^ SEED_V) | 1) for c in range(first, first + count)]
        return torch.tensor(values, dtype=torch.int64, device=self.device)


_local = threading.local()
_T = TypeVar("_T")


def per_thread(factory: Callable[[torch.device], _T], device: torch.device) -> _T:
    """``factory(device)``, built once per thread and device (its scratch buffers are reused)."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    key = (factory, device)
    t: _T | None = cache.get(key)  # (the cache holds what factory made for this key)
    if t is None:
        t = cache[key] = factory(device)
    return t


def tables_for(device: torch.device) -> FingerprintTables:
    return per_thread(FingerprintTables, device)


def raw_sum_eager(
    words: torch.Tensor, first_chunk: int = 0, *, block_chunks: int | None = None, compiled: BlockSum | None = None
) -> torch.Tensor:
    """``raw_sum`` with torch ops in blocks of chunks (the reference every other path must match).

    ``block_chunks``: chunks per pass; default 16 on the CPU (a reused scratch buffer) and
    ``CUDA_BLOCK_CHUNKS`` on a GPU. Any value gives the same sum. ``compiled``: a kernel for one block
    of ``BLOCK_CHUNKS`` chunks (``fingerprinting.enable_compile``'s), used by the default CPU path.
    """
    tabs = tables_for(words.device)
    n = words.numel()
    c_words = FP_CHUNK_WORDS
    full_chunks = n // c_words
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    if block_chunks is None and words.device.type == "cuda":
        block_chunks = CUDA_BLOCK_CHUNKS
    if block_chunks is not None:
        for c in range(0, full_chunks, block_chunks):
            k = min(block_chunks, full_chunks - c)
            prod = words[c * c_words : (c + k) * c_words].view(k, c_words).to(torch.int64)
            prod.mul_(tabs.table)
            acc += (prod.sum(1) * tabs.v_range(first_chunk + c, k)).sum()
        return _add_tail(acc, words, first_chunk, full_chunks, tabs)
    c = 0
    while c < full_chunks:
        k = min(BLOCK_CHUNKS, full_chunks - c)
        blk = words[c * c_words : (c + k) * c_words].view(k, c_words)
        v = tabs.chunk_multipliers(first_chunk + c, k)
        if compiled is not None and k == BLOCK_CHUNKS:
            acc += compiled(blk, tabs.table, v)
        else:
            buf = tabs.buf[:k]
            buf.copy_(blk)
            buf.mul_(tabs.table)
            acc += (buf.sum(1) * v).sum()
        c += k
    return _add_tail(acc, words, first_chunk, full_chunks, tabs)


def _add_tail(
    acc: torch.Tensor, words: torch.Tensor, first_chunk: int, full_chunks: int, tabs: FingerprintTables
) -> torch.Tensor:
    """``acc`` plus the last, partial chunk's share of S (none when the words end on a chunk boundary)."""
    rest = words.numel() - full_chunks * FP_CHUNK_WORDS
    if rest:
        tail = words[full_chunks * FP_CHUNK_WORDS :].to(torch.int64) * tabs.table[:rest]
        acc += tail.sum() * tabs.chunk_multipliers(first_chunk + full_chunks, 1)[0]
    return acc


ONE_THREAD_BLOCK_CHUNKS = 16


def raw_sum_one_thread(words: torch.Tensor, first_chunk: int = 0) -> torch.Tensor:
    """``raw_sum`` of CPU words on the calling thread alone (the same sum; checked at first use by
    ``fingerprinting.one_thread``, which is where it is used).

    torch spreads an elementwise op over its intra-op threads, so the eager path, run on a thread
    beside another busy one (a load's reads), puts three threads on two cores and each op then waits
    for the slowest; here the words are widened by numpy (one thread) into the scratch block and
    each chunk's sum is one int64 ``torch.mv`` (one thread, one pass: no product written back), about
    as fast on one core as the eager path on two.
    """
    tabs = tables_for(words.device)
    n = words.numel()
    full = n // FP_CHUNK_WORDS
    src = words.numpy()
    buf = tabs.buf
    scratch = buf.numpy()
    acc = torch.zeros((), dtype=torch.int64)
    step = ONE_THREAD_BLOCK_CHUNKS
    for c in range(0, full, step):
        k = min(step, full - c)
        np.copyto(scratch[:k], src[c * FP_CHUNK_WORDS : (c + k) * FP_CHUNK_WORDS].reshape(k, FP_CHUNK_WORDS))
        acc += torch.dot(torch.mv(buf[:k], tabs.table), tabs.v_range(first_chunk + c, k))
    rest = n - full * FP_CHUNK_WORDS
    if rest:
        np.copyto(scratch[0, :rest], src[full * FP_CHUNK_WORDS :])
        acc += torch.dot(buf[0, :rest], tabs.table[:rest]) * tabs.v_range(first_chunk + full, 1)[0]
    return acc
