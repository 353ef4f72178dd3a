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

Shared with ``certckpt.detect`` (in ``__all__``, not re-exported by ``certckpt``): ``as_words``,
``raw_sum``, ``finalize``; the auditor sums words on the device and finalizes after one all-gather.
The constants, the multiplier tables (``tables_for``, ``per_thread``, which the audit digest
reuses) and the eager sum live one step down, in ``fpsum``.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import xxhash

from certckpt.errors import ArgumentTypeError, ConfigurationError, PlatformError

# fpsum holds the constants, the tables and the eager sum (fused builds on them too); the names
# imported `as` themselves stay importable from here, where callers found them before.
from . import fpsum
from .fpsum import BLOCK_CHUNKS as _BLOCK_CHUNKS
from .fpsum import CUDA_BLOCK_CHUNKS as CUDA_BLOCK_CHUNKS
from .fpsum import FP_CHUNK_WORDS, M64, fmix64, tables_for
from .fpsum import SEED_T as SEED_T
from .fpsum import SEED_V as SEED_V
from .fpsum import per_thread as per_thread
from .fpsum import splitmix64 as splitmix64
from .tensors import TORCH_TO_ST

__all__ = [
    "fingerprint",
    "fingerprint_many",
    "fingerprint_hex",
    "fingerprint_state",
    "enable_compile",
    "StreamingFingerprint",
    "SharedFingerprints",
    "FP_CHUNK_WORDS",
    "as_words",
    "raw_sum",
    "raw_sum_eager",
    "one_thread",
    "finalize",
]


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
    elif getattr(_one_thread, "on", False) and words.device.type == "cpu" and _one_thread_checked():
        return fpsum.raw_sum_one_thread(words, first_chunk)
    return raw_sum_eager(words, first_chunk)


# --- one thread ---------------------------------------------------------------------------------

_one_thread = threading.local()
_one_thread_ok: bool | None = None  # None: not checked yet in this process
_one_thread_lock = threading.Lock()


@contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, this thread's CPU sums run on this thread alone (``fpsum.raw_sum_one_thread``):
    for a worker that fingerprints beside another busy thread. The same bits as the eager path; the
    first use in a process checks that on a known block and, if they differ, warns and stays eager.
    """
    was = getattr(_one_thread, "on", False)
    _one_thread.on = True
    try:
        yield
    finally:
        _one_thread.on = was


def _one_thread_checked() -> bool:
    global _one_thread_ok
    if _one_thread_ok is None:
        with _one_thread_lock:
            if _one_thread_ok is None:
                g = torch.Generator().manual_seed(20261203)
                words = torch.randint(-(2**31), 2**31, (3 * FP_CHUNK_WORDS + 1234,), dtype=torch.int32, generator=g)
                try:
                    same = int(fpsum.raw_sum_one_thread(words, 5)) == int(fpsum.raw_sum_eager(words, 5))
                except Exception as e:  # a numpy or torch build without what it needs: eager serves
                    warnings.warn(f"certckpt: one-thread fingerprint sums disabled ({e})", RuntimeWarning, stacklevel=3)
                    same = None
                if same is False:
                    warnings.warn(
                        "certckpt: one-thread fingerprint sums disagree with the eager ones on this build; using eager",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                _one_thread_ok = bool(same)
    return _one_thread_ok


def raw_sum_eager(words: torch.Tensor, first_chunk: int = 0, *, block_chunks: int | None = None) -> torch.Tensor:
    """``raw_sum`` with torch ops in blocks of chunks (the reference every other path must match).

    ``block_chunks``: chunks per pass; default 16 on the CPU (a reused scratch buffer) and
    ``CUDA_BLOCK_CHUNKS`` on a GPU. Any value gives the same sum. The sum itself is
    ``fpsum.raw_sum_eager``; this adds the compiled block kernel when ``enable_compile`` turned it on.
    """
    compiled = _maybe_compiled() if block_chunks is None and words.device.type == "cpu" else None
    return fpsum.raw_sum_eager(words, first_chunk, block_chunks=block_chunks, compiled=compiled)


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


class SharedFingerprints:
    """The fingerprints of host tensors, cut into slices that several threads take in turn.

    A save's two threads finish their own ordered work at different times: the writer its writes,
    the hashing worker its digests (longer when signed: BLAKE3 has to see the data in order). Each
    then calls ``work``, which takes the next slice until none is left, so neither waits idle while
    the other fingerprints alone. Slices start on chunk boundaries and their sums add mod 2**64, so
    the result never depends on who took which slice.

    Example:
        >>> shared = SharedFingerprints(tensors)
        >>> worker.submit(shared.work); shared.work()  # on two threads, then wait for the worker
        >>> fps = shared.results()
    """

    SLICE_BYTES = 16 << 20  # a multiple of PIECE_BYTES; ~5 ms of one core, 64 slices per GiB
    PIECE_BYTES = 4 * FP_CHUNK_WORDS  # one multiplier chunk: slices start on chunk boundaries

    def __init__(self, tensors: Sequence[torch.Tensor]):
        if any(t.device.type != "cpu" for t in tensors):
            raise ArgumentTypeError("SharedFingerprints takes host tensors (device ones: fingerprint_many)")
        self._tensors = list(tensors)
        self._sums = [0] * len(self._tensors)
        # Each tensor's bytes, cut into words slice by slice: a tensor whose length is not a multiple
        # of 4 bytes (or that starts at an odd offset) copies one slice at a time, never all of it.
        self._bytes: list[torch.Tensor] = []
        self._slices: list[tuple[int, int, int]] = []  # (tensor, first byte, end byte), taken from the end
        step = self.SLICE_BYTES
        for i, t in enumerate(self._tensors):
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()  # (a save's tensors are contiguous already)
            flat = t.reshape(-1) if t.dtype == torch.uint8 else t.reshape(-1).view(torch.uint8)
            self._bytes.append(flat)
            self._slices.extend((i, a, min(a + step, flat.numel())) for a in range(0, flat.numel(), step))
        self._slices.reverse()
        self._lock = threading.Lock()
        self._cancelled = False

    def work(self) -> None:
        """Fingerprint slices until none is left (any number of threads at once)."""
        while True:
            with self._lock:
                if not self._slices:
                    return
                i, a, b = self._slices.pop()
            part = int(raw_sum(as_words(self._bytes[i][a:b]), a // self.PIECE_BYTES))
            with self._lock:
                self._sums[i] = (self._sums[i] + part) & M64

    def cancel(self) -> None:
        """Drop the slices no thread has taken yet (the save they were for has failed)."""
        with self._lock:
            self._slices.clear()
            self._cancelled = True

    def results(self) -> list[int]:
        """Each tensor's fingerprint; call once every ``work`` has returned."""
        if self._cancelled:
            raise ConfigurationError("SharedFingerprints.results() after cancel()")
        if self._slices:
            raise ConfigurationError("SharedFingerprints.results() before every slice was fingerprinted")
        return [finalize(s, t) for s, t in zip(self._sums, self._tensors)]


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
