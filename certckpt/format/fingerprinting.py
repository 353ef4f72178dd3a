"""The device fingerprint: a 64-bit value per tensor, computed with torch ops on the tensor's device.

Specified in ``docs/format.md`` (fingerprint v1); in short, with all arithmetic mod 2**64:

    w_i  = the tensor's bytes read as little-endian signed 32-bit words (last word zero-padded),
           sign-extended to 64 bits
    m_i  = T[i mod 2**16] * V[i div 2**16], with T[j] = splitmix64(j ^ SEED_T) | 1 and
           V[c] = splitmix64(c ^ SEED_V) | 1 (odd, hence invertible)
    S    = sum_i w_i * m_i
    fp   = fmix64(S ^ xxh3_64("<dtype>:<d0,d1,...>:<nbytes>"))

Why this shape: integer sums mod 2**64 are associative and commutative, so any chunking and any
reduction order on any device gives the same bits. A change confined to one 32-bit word changes S by
``delta * m_i`` with ``0 < |delta| < 2**32`` and ``m_i`` odd, which is never 0 mod 2**64: always
detected. Widening 32-bit words (rather than reading 64-bit words) keeps pairs of sign-bit flips in two
different words from cancelling. Multipliers differ per position, so permutations change S. fmix64
is a bijection, so the finalizer keeps every guarantee while covering dtype and shape.

Internal API (shared with ``certckpt.detect``, not re-exported): ``as_words``, ``raw_sum``,
``finalize``, ``tables_for``, ``per_thread``; the auditor sums words on the device and finalizes
after one all-gather, and the audit digest reuses the multiplier tables.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch
import xxhash

from certckpt.errors import ArgumentTypeError, ConfigurationError, PlatformError

from .tensors import TORCH_TO_ST

__all__ = [
    "fingerprint",
    "fingerprint_many",
    "fingerprint_hex",
    "fingerprint_state",
    "enable_compile",
    "StreamingFingerprint",
    "FP_CHUNK_WORDS",
]

M64 = (1 << 64) - 1
SEED_T = 0x6365727463_6B7074  # "certckpt"
SEED_V = 0x76_61756C74_6670  # "vaultfp"
FP_CHUNK_WORDS = 1 << 16  # C: multiplier table length, part of the specification
_BLOCK_CHUNKS = 16  # implementation choice: 16 chunks (1 Mi words, 8 MiB of int64) per eager pass
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
        self.buf = torch.empty((_BLOCK_CHUNKS, FP_CHUNK_WORDS), dtype=torch.int64, device=device)
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
        if first % _BLOCK_CHUNKS or count > _BLOCK_CHUNKS:
            return self._make_v(first, count)
        block = first // _BLOCK_CHUNKS
        v = self._v.get(block)
        if v is None:
            v = self._make_v(first, _BLOCK_CHUNKS)
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


def as_words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat int32 tensor on its device, last word zero-padded."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
    if (t.storage_offset() * t.element_size()) % 4:
        flat = flat.clone()  # a view at an odd byte offset cannot be reinterpreted as int32 in place
    n = flat.numel()
    full = n - n % 4
    words = flat[:full].view(torch.int32)
    if full != n:
        tail = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        tail[: n - full] = flat[full:]
        words = torch.cat([words, tail.view(torch.int32)])
    return words


# --- optional compiled block kernel -------------------------------------------------------------

# The compiled ``_block_sum`` (its signature), once enabled and checked.
_BlockKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_compiled: _BlockKernel | None = None
_compile_checked = False
_compile_lock = threading.Lock()


def _block_sum(blk: torch.Tensor, table: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return ((blk.to(torch.int64) * table).sum(1) * v).sum()


def enable_compile(on: bool = True) -> bool:
    """Use a ``torch.compile``'d kernel for large tensors (about 2-3x faster on CPU, slower first call).

    The compiled kernel is checked against the eager one on a known block at first use; when they
    differ (torch 2.13's CPU inductor miscompiles some int64 constant arithmetic) certckpt warns and
    stays eager. Also enabled by the environment variable ``CERTCKPT_COMPILE=1``.

    Returns:
        Whether the compiled path is active.
    """
    global _compiled, _compile_checked
    with _compile_lock:
        if not on:
            _compiled, _compile_checked = None, True
            return False
        try:
            fn = torch.compile(_block_sum, dynamic=False)
            g = torch.Generator().manual_seed(20261130)
            blk = torch.randint(-(2**31), 2**31, (_BLOCK_CHUNKS, FP_CHUNK_WORDS), dtype=torch.int32, generator=g)
            tabs = tables_for(torch.device("cpu"))
            v = tabs.chunk_multipliers(0, _BLOCK_CHUNKS)
            if int(fn(blk, tabs.table, v)) != int(_block_sum(blk, tabs.table, v)):
                raise PlatformError("compiled fingerprint kernel disagrees with the eager one")
        except Exception as e:
            warnings.warn(f"certckpt: compiled fingerprint disabled, using eager ({e})", RuntimeWarning, stacklevel=2)
            _compiled, _compile_checked = None, True
            return False
        _compiled, _compile_checked = fn, True
        return True


def _maybe_compiled() -> _BlockKernel | None:
    if not _compile_checked and os.environ.get("CERTCKPT_COMPILE") == "1":
        enable_compile(True)
    return _compiled


# --- the sum S ----------------------------------------------------------------------------------


def raw_sum(words: torch.Tensor, first_chunk: int = 0) -> torch.Tensor:
    """S as a 0-dim int64 tensor on the words' device (no host synchronisation).

    ``words`` may be a piece of a longer word sequence that starts at chunk ``first_chunk`` (word
    index ``first_chunk * FP_CHUNK_WORDS``); the pieces' sums add up to the whole sequence's S.
    On CUDA with Triton, one fused kernel (``fused.py``, checked against this eager path at first use).
    """
    if words.device.type == "cuda":
        from . import fused

        if fused.ready(words.device):
            return fused.raw_sum_fused(words, first_chunk)
    return raw_sum_eager(words, first_chunk)


def raw_sum_eager(words: torch.Tensor, first_chunk: int = 0, *, block_chunks: int | None = None) -> torch.Tensor:
    """``raw_sum`` with torch ops in blocks of chunks (the reference every other path must match).

    ``block_chunks``: chunks per pass; default 16 on the CPU (a reused scratch buffer) and
    ``CUDA_BLOCK_CHUNKS`` on a GPU. Any value gives the same sum.
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
    compiled = _maybe_compiled() if words.device.type == "cpu" else None
    c = 0
    while c < full_chunks:
        k = min(_BLOCK_CHUNKS, full_chunks - c)
        blk = words[c * c_words : (c + k) * c_words].view(k, c_words)
        v = tabs.chunk_multipliers(first_chunk + c, k)
        if compiled is not None and k == _BLOCK_CHUNKS:
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


def _shape_key(dtype_code: str, shape: Sequence[int], nbytes: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{dtype_code}:{','.join(str(d) for d in shape)}:{nbytes}".encode("ascii"))


def finalize(raw: int, t: torch.Tensor) -> int:
    code = TORCH_TO_ST.get(t.dtype)
    if code is None:
        raise ArgumentTypeError(f"cannot fingerprint dtype {t.dtype}: safetensors cannot store it")
    return fmix64((raw & M64) ^ _shape_key(code, tuple(t.shape), t.numel() * t.element_size()))


class StreamingFingerprint:
    """The fingerprint of a tensor fed as consecutive byte pieces, in bounded memory.

    Every piece but the last must be a multiple of ``PIECE_ALIGN`` bytes (one multiplier chunk), so
    that pieces start on chunk boundaries.

    Example:
        >>> fp = StreamingFingerprint("F32", (1024, 1024))
        >>> for piece in pieces:  # uint8 tensors
        ...     fp.update(piece)
        >>> fp.hexdigest()
    """

    PIECE_ALIGN = 4 * FP_CHUNK_WORDS

    def __init__(self, dtype_code: str, shape: Sequence[int]):
        self.dtype_code = dtype_code
        self.shape = tuple(shape)
        self._nbytes = 0
        self._acc: torch.Tensor | None = None
        self._ragged = False

    def update(self, piece: torch.Tensor) -> None:
        if self._ragged:
            raise ConfigurationError("only the last piece may be shorter than a multiple of PIECE_ALIGN bytes")
        if piece.numel() % self.PIECE_ALIGN:
            self._ragged = True
        s = raw_sum(as_words(piece), self._nbytes // self.PIECE_ALIGN)
        self._acc = s if self._acc is None else self._acc + s
        self._nbytes += piece.numel()

    def intdigest(self) -> int:
        raw = int(self._acc) if self._acc is not None else 0
        return fmix64((raw & M64) ^ _shape_key(self.dtype_code, self.shape, self._nbytes))

    def hexdigest(self) -> str:
        return f"{self.intdigest():016x}"


def _raw_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's S, on its device; the CUDA tensors of one device in a single fused launch."""
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    cuda: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device.type == "cuda":
            cuda.setdefault(t.device, []).append(i)
    for device, idxs in cuda.items():
        if len(idxs) < 2:
            continue
        from . import fused

        if fused.many_ready(device):
            many = fused.raw_sums_fused([as_words(tensors[i]) for i in idxs])
            for k, i in enumerate(idxs):
                sums[i] = many[k]
    return [s if s is not None else raw_sum(as_words(t)) for s, t in zip(sums, tensors)]


def fingerprint_many(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Fingerprints of several tensors with a single device-to-host read per device.

    Example:
        >>> fps = fingerprint_many(model.state_dict().values())
    """
    tensors = list(tensors)
    sums = _raw_sums(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    raws: list[int] = [0] * len(tensors)
    for idxs in by_device.values():
        # one tensor: no stack (on a GPU every launch costs host time comparable to a 64 MiB sum)
        on_device = sums[idxs[0]].reshape(1) if len(idxs) == 1 else torch.stack([sums[i] for i in idxs])
        host = on_device.cpu().tolist()
        for i, r in zip(idxs, host):
            raws[i] = r
    return [finalize(r, t) for r, t in zip(raws, tensors)]


def fingerprint(tensor: torch.Tensor) -> int:
    """The 64-bit device fingerprint of one tensor, as an unsigned int.

    Example:
        >>> hex(fingerprint(torch.arange(4, dtype=torch.float32)))
    """
    return fingerprint_many([tensor])[0]


def fingerprint_state(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Hex fingerprints of every tensor in a flat mapping (e.g. ``model.state_dict()``), one sync.

    Example:
        >>> fps = fingerprint_state(model.state_dict())
        >>> fps["0.weight"]
        '4be8c5feb52ed24e'
    """
    names = list(state)
    return {n: f"{fp:016x}" for n, fp in zip(names, fingerprint_many(state[n] for n in names))}


def fingerprint_hex(tensor: torch.Tensor) -> str:
    """``fingerprint`` as 16 lowercase hex digits, the form stored in checkpoints."""
    return f"{fingerprint(tensor):016x}"
