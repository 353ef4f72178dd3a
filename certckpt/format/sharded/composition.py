"""Composing a tensor's fingerprint from its shards' contributions, without torch.

The device fingerprint v1 (``docs/format.md`` section 4) of a tensor X is ``fmix64(S ^ K)``, where S
is a sum mod 2**64 over X's 32-bit words. Each word's sign-extended value is a sum of independent
per-byte terms (bytes 0-2 unsigned, byte 3 signed), so S is a sum over X's *bytes*: the contribution
of a shard (any set of X's elements) is S computed over X's byte sequence with every byte outside the
shard set to zero, and the contributions of shards that partition X add up to S. This module holds
the part of that rule that needs no tensor arithmetic: finalizing a summed S into the fingerprint and
the whole-state fingerprint over named tensor fingerprints. ``shardfp`` computes contributions.

Specified in ``docs/format.md`` ("Sharded checkpoints (DCP)"); checked against
``certckpt.fingerprint`` of full tensors in ``tests/dcp/test_dcp.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import xxhash

from certckpt.format.header import DTYPE_SIZES
from certckpt.format.record import state_fingerprint

__all__ = [
    "M64",
    "fmix64",
    "unfmix64",
    "shape_key",
    "finalize",
    "raw_of",
    "compose",
    "state_fp",
    "hex64",
    "is_partition",
]

M64 = (1 << 64) - 1


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer (the same bijection fingerprint v1 ends with)."""
    x &= M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB93FE53B6E53) & M64
    return x ^ (x >> 33)


_INV1 = pow(0xFF51AFD7ED558CCD, -1, 1 << 64)
_INV2 = pow(0xC4CEB93FE53B6E53, -1, 1 << 64)


def unfmix64(y: int) -> int:
    """The inverse of ``fmix64``: ``x ^= x >> 33`` undoes itself on 64 bits, and the multipliers are
    odd, hence invertible mod 2**64."""
    y &= M64
    y ^= y >> 33
    y = (y * _INV2) & M64
    y ^= y >> 33
    y = (y * _INV1) & M64
    return y ^ (y >> 33)


def shape_key(dtype_code: str, shape: Iterable[int]) -> int:
    """K of fingerprint v1: ``xxh3_64("D:d0,d1,...:L")`` for the *global* tensor."""
    dims = [int(d) for d in shape]
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * DTYPE_SIZES[dtype_code]
    return xxhash.xxh3_64_intdigest(f"{dtype_code}:{','.join(str(d) for d in dims)}:{nbytes}".encode("ascii"))


def finalize(raw: int, dtype_code: str, shape: Iterable[int]) -> int:
    """The fingerprint of a tensor whose word sum S is ``raw`` (any int; taken mod 2**64)."""
    return fmix64((raw & M64) ^ shape_key(dtype_code, shape))


def raw_of(fp: int, dtype_code: str, shape: Iterable[int]) -> int:
    """The word sum S behind a tensor's fingerprint (``finalize`` undone): a whole tensor's
    contribution to itself, recovered from the fingerprint a writer already computed."""
    return unfmix64(fp) ^ shape_key(dtype_code, shape)


def compose(raws: Iterable[int], dtype_code: str, shape: Iterable[int]) -> int:
    """The fingerprint of a global tensor from the contributions of shards that partition it."""
    return finalize(sum(raws) & M64, dtype_code, shape)


def state_fp(named_fps: Mapping[str, str]) -> str:
    """The whole-state fingerprint over ``{fqn: fingerprint hex}``: the rule of ``format`` section 5."""
    return state_fingerprint(dict(named_fps))


def hex64(x: int) -> str:
    """A 64-bit value as 16 lowercase hex digits (its value mod 2**64)."""
    return f"{x & M64:016x}"


_PAIRWISE_LIMIT = 256


def is_partition(boxes: Sequence[tuple[Sequence[int], Sequence[int]]], shape: Sequence[int]) -> bool:
    """Whether ``(offsets, sizes)`` boxes, all inside ``shape``, tile it exactly once.

    The volumes must add up to the tensor's; then the boxes tile it when they are distinct cells of
    one grid (DCP's chunks always are: every dimension is cut at the same points), checked in
    linear time; other layouts are checked pair by pair up to a bound, and beyond it the volume sum
    is the check.
    """
    numel = 1
    for d in shape:
        numel *= d
    volume = 0
    for _, sizes in boxes:
        v = 1
        for s in sizes:
            v *= s
        volume += v
    if volume != numel:
        return False
    live = [(tuple(o), tuple(s)) for o, s in boxes if all(s)]
    if len({o for o, _ in live}) != len(live):
        return False
    nexts = []
    for a in range(len(shape)):
        cuts = sorted({o[a] for o, _ in live} | {o[a] + s[a] for o, s in live})
        nexts.append(dict(zip(cuts, cuts[1:])))
    if all(nexts[a].get(o[a]) == o[a] + s[a] for o, s in live for a in range(len(shape))):
        return True  # distinct cells of one grid whose volumes add up: a tiling
    if len(live) > _PAIRWISE_LIMIT:
        return True
    for i, (ao, asz) in enumerate(live):
        for bo, bsz in live[i + 1 :]:
            if all(a < b + bs and b < a + az for a, az, b, bs in zip(ao, asz, bo, bsz)):
                return False
    return True
