"""An independent pure-Python implementation of fingerprint v1, written from docs/format.md.

Slow (one Python loop iteration per 32-bit word): used on small tensors only, to pin the
torch implementation to the specification.
"""

from __future__ import annotations

import struct

import xxhash

M64 = (1 << 64) - 1
SEED_T = 0x63657274636B7074
SEED_V = 0x7661756C746670
CHUNK = 65536


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB93FE53B6E53) & M64
    return x ^ (x >> 33)


def reference_fingerprint(data: bytes, dtype: str, shape: tuple[int, ...]) -> int:
    padded = data + b"\0" * (-len(data) % 4)
    s = 0
    for i in range(len(padded) // 4):
        (w,) = struct.unpack_from("<i", padded, 4 * i)
        m = ((splitmix64((i % CHUNK) ^ SEED_T) | 1) * (splitmix64((i // CHUNK) ^ SEED_V) | 1)) & M64
        s = (s + w * m) & M64
    key = xxhash.xxh3_64_intdigest(f"{dtype}:{','.join(str(d) for d in shape)}:{len(data)}".encode("ascii"))
    return fmix64(s ^ key)


def reference_digest(data: bytes) -> int:
    """The 32-bit audit digest (certckpt/detect/digest.py): S mod 2**32, no finalizer."""
    padded = data + b"\0" * (-len(data) % 4)
    s = 0
    for i in range(len(padded) // 4):
        (w,) = struct.unpack_from("<i", padded, 4 * i)
        m = (splitmix64((i % CHUNK) ^ SEED_T) | 1) * (splitmix64((i // CHUNK) ^ SEED_V) | 1)
        s += w * m
    return s % (1 << 32)
