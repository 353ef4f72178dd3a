"""A second preimage for xxh3-128, as an attacker would build one (docs/signing.md: xxh3 stops
accidents, not people). Used by the tests to prove that every keyed read refuses data that keeps its
xxh3 digests but not its signed cryptographic digest.

XXH3 (inputs over 240 bytes) folds each 64-byte stripe into eight 64-bit accumulators: for lane i,
``acc[i ^ 1] += word`` and ``acc[i] += lo32(word ^ key) * hi32(word ^ key)``, with ``key`` the
default secret's word at ``8 * (stripe + i)``; after 16 stripes (a 1,024-byte block) the
accumulators are scrambled by a bijection. Rewriting six words of one lane in the first block so
that both sums stay the same leaves every accumulator, and so the digest, unchanged.
"""

from __future__ import annotations

import struct

# XXH3's default secret (the xxHash specification's kSecret), 192 bytes.
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_M64, _M32 = (1 << 64) - 1, (1 << 32) - 1
_STRIPES = 6  # words rewritten: up to four set the product sum, two set the plain sum


def _product(x: int) -> int:
    return (x & _M32) * (x >> 32)


def forge(data: bytes, *, lane: int = 0) -> bytes:
    """``data`` (more than 1,024 bytes) with six words of one lane of its first block rewritten so
    that its xxh3-64 and xxh3-128 digests (default seed and secret) are unchanged."""
    if len(data) <= 1024 + 64:
        raise ValueError("the forgery rewrites the first 1,024-byte block: give more than 1,088 bytes")
    out = bytearray(data)
    offsets = [s * 64 + lane * 8 for s in range(_STRIPES)]
    keys = [struct.unpack_from("<Q", SECRET, 8 * (s + lane))[0] for s in range(_STRIPES)]
    words = [struct.unpack_from("<Q", data, o)[0] for o in offsets]
    total = sum(words) & _M64
    products = sum(_product(w ^ k) for w, k in zip(words, keys)) & _M64
    # four keyed words whose products add up to the old sum of products
    keyed, rest = [], products
    for _ in range(3):
        b = min(_M32, rest // _M32)
        keyed.append((b << 32) | _M32)
        rest -= b * _M32
    keyed.append((rest << 32) | 1)  # rest < 2**32 now
    new = [x ^ k for x, k in zip(keyed, keys)]
    # two keyed words with a zero product (one half zero) whose plain words restore the sum
    need = (total - sum(new)) & _M64
    k4, k5 = keys[4], keys[5]
    low = (need - (k5 & _M32)) & _M32
    carry = (low + (k5 & _M32)) >> 32
    high = ((need >> 32) - (k4 >> 32) - carry) & _M32
    new.append(((k4 >> 32) << 32) | low)  # keyed: low ^ lo32(k4) in the low half, 0 in the high
    new.append((high << 32) | (k5 & _M32))  # keyed: 0 in the low half
    for o, w in zip(offsets, new):
        struct.pack_into("<Q", out, o, w)
    return bytes(out)
