"""The 32-bit audit digest: known answers, the reference implementation, and its one guarantee."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.detect.digest import digest, digests
from certckpt.detect.signature import matches, signature
from tests.support.fpref import reference_digest


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


KNOWN_ANSWERS = {  # pinned: a change here changes what ranks compare, so it must be deliberate
    "arange10_f32": (lambda: torch.arange(10, dtype=torch.float32), 1892679680),
    "empty": (lambda: torch.zeros(0), 0),
    "three_bytes": (lambda: torch.tensor([1, 2, 3], dtype=torch.uint8), 3626077463),
    "randn70000_f64": (
        lambda: torch.randn(70000, generator=torch.Generator().manual_seed(7), dtype=torch.float64),
        806799234,
    ),
}


@pytest.mark.parametrize("name", sorted(KNOWN_ANSWERS))
def test_known_answers_match_the_torch_and_the_reference_implementations(name):
    make, expected = KNOWN_ANSWERS[name]
    t = make()
    assert int(digest(t)) == expected
    assert reference_digest(_bytes(t)) == expected


@pytest.mark.parametrize("n", [1, 3, 65535, 65536, 65537, 16 * 65536 + 5, 17 * 65536])
def test_chunk_and_block_boundaries_agree_with_the_reference(n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert int(digest(t)) == reference_digest(_bytes(t))


def test_views_and_odd_offsets_digest_their_own_bytes():
    base = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    for t in (base.t(), base[3:9, 5:], base.view(-1)[1:]):
        assert int(digest(t)) == reference_digest(_bytes(t))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3 * 65536), data=st.data())
def test_a_change_confined_to_one_word_always_changes_the_digest(n, data):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    i = data.draw(st.integers(0, n - 1))
    words = t.clone().view(torch.int32)
    delta = data.draw(st.integers(1, 2**32 - 1))
    words[i] = ((int(words[i]) + delta + 2**31) % 2**32) - 2**31
    assert int(digest(words.view(torch.float32))) != int(digest(t))


def test_deterministic_signatures_are_digests_and_compare_exactly():
    grads = [torch.randn(4, 5), torch.randn(7)]
    sig = signature(grads, mode="deterministic")
    assert sig.tolist() == digests(grads).tolist() == [reference_digest(_bytes(g)) for g in grads]
    flipped = [grads[0], grads[1].clone()]
    flipped[1].view(torch.int32)[3] ^= 1  # the lowest mantissa bit of one element
    assert matches(sig, signature(flipped, mode="deterministic"), mode="deterministic", rtol=0) == [True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digests_equal_cpu_digests():
    g = torch.Generator().manual_seed(3)
    for t in (torch.randn(17 * 65536 + 3, generator=g), torch.randn(33, 7, generator=g).half(), torch.zeros(0)):
        assert int(digest(t.cuda())) == int(digest(t))


def test_the_eager_digest_does_not_depend_on_its_block_size():
    # The GPU's fallback path takes 256 chunks per pass (CUDA_BLOCK_CHUNKS), the CPU's 16 in a scratch buffer.
    from certckpt.detect.digest import digest_words_eager
    from certckpt.format.fingerprinting import FP_CHUNK_WORDS

    g = torch.Generator().manual_seed(12)
    for n in (5, FP_CHUNK_WORDS, 40 * FP_CHUNK_WORDS + 1234):
        words = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g)
        want = int(digest_words_eager(words))
        assert [int(digest_words_eager(words, block_chunks=b)) for b in (1, 3, 256)] == [want] * 3, n
