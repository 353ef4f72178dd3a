"""Fingerprint v1: known answers, the spec's guarantees, and device independence."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import certckpt
from certckpt.format.fingerprinting import FP_CHUNK_WORDS, as_words, fingerprint_many, raw_sum, raw_sum_eager
from certckpt.format.tensors import TORCH_TO_ST
from tests.support.fpref import reference_fingerprint

# Pinned values: changing the algorithm must change these on purpose (and bump the format).
KNOWN_ANSWERS = {
    "f32_arange5": (lambda: torch.arange(5, dtype=torch.float32), "dec0b78c6b00438d"),
    "f64_scalar": (lambda: torch.tensor(3.5, dtype=torch.float64), "fcc684fa35e6435b"),
    "f32_empty_0x3": (lambda: torch.zeros(0, 3), "dc468872f31d1368"),
    "u8_arange7": (lambda: torch.arange(7, dtype=torch.uint8), "3bb14bdfb7e27b31"),
    "bf16_2x3": (lambda: torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16), "ea9975487c83fab1"),
    "bool_3": (lambda: torch.tensor([True, False, True]), "bb3b5fb11dfce809"),
    "i64_extremes": (lambda: torch.tensor([-1, 2**62, -(2**63)], dtype=torch.int64), "2dff8f343047f26d"),
}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def ref(t: torch.Tensor) -> int:
    return reference_fingerprint(raw(t), TORCH_TO_ST[t.dtype], tuple(t.shape))


@pytest.mark.parametrize("name", sorted(KNOWN_ANSWERS))
def test_known_answer_vectors(name):
    make, expected = KNOWN_ANSWERS[name]
    t = make()
    assert certckpt.fingerprint_hex(t) == expected
    assert f"{ref(t):016x}" == expected  # the spec's reference implementation agrees


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.int32,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    ],
)
def test_matches_reference_for_every_dtype(dtype):
    g = torch.Generator().manual_seed(1)
    nbytes = 3 * 11 * torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        data = data % 2
    t = data.view(dtype).reshape(3, 11)
    assert certckpt.fingerprint(t) == ref(t)


def test_spans_several_chunks_and_a_ragged_tail():
    # 2 full 64 Ki-word chunks plus a partial one, and a byte length that is not a multiple of 4.
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 256, (4 * (2 * FP_CHUNK_WORDS + 5) + 3,), dtype=torch.uint8, generator=g)
    assert certckpt.fingerprint(t) == ref(t)


def test_independent_of_chunking_and_reduction_order():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(40 * FP_CHUNK_WORDS + 123, generator=g)
    words = as_words(t)
    whole = int(raw_sum(words))
    # Recompute S from arbitrary slices: the sum of per-slice contributions must equal S.
    from certckpt.format.fingerprinting import M64, SEED_T, SEED_V, splitmix64

    def slice_sum(lo: int, hi: int) -> int:
        idx = torch.arange(lo, hi)
        tt = torch.tensor([(splitmix64(j ^ SEED_T) | 1) for j in range(FP_CHUNK_WORDS)], dtype=torch.uint64).to(
            torch.int64
        )
        vv = torch.tensor(
            [(splitmix64(c ^ SEED_V) | 1) & M64 for c in range(int(idx.max()) // FP_CHUNK_WORDS + 1)],
            dtype=torch.uint64,
        ).to(torch.int64)
        m = tt[idx % FP_CHUNK_WORDS] * vv[idx // FP_CHUNK_WORDS]
        return int((words[lo:hi].to(torch.int64) * m).sum()) & M64

    cuts = [0, 7, 65536 * 3 + 11, 65536 * 17, 65536 * 39 + 1, words.numel()]
    parts = [slice_sum(a, b) for a, b in zip(cuts, cuts[1:])]
    assert sum(reversed(parts)) & M64 == whole & M64


def test_views_and_copies_agree():
    base = torch.randn(64, 33)
    view = base[:, 1:]  # non-contiguous, odd offset
    assert certckpt.fingerprint(view) == certckpt.fingerprint(view.contiguous())
    u8 = torch.arange(40, dtype=torch.uint8)[3:27]  # storage offset not a multiple of 4 bytes
    assert certckpt.fingerprint(u8) == ref(u8)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=300),
    pos=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.float16]),
)
def test_any_single_word_change_is_detected(n, pos, bit, dtype):
    g = torch.Generator().manual_seed(n)
    t = (
        torch.randn(n, generator=g).to(dtype)
        if dtype != torch.int8
        else torch.randint(-128, 127, (n,), dtype=torch.int8, generator=g)
    )
    b = t.clone().view(torch.uint8)
    words = (b.numel() + 3) // 4
    w = pos % words
    byte = 4 * w + bit // 8
    if byte >= b.numel():
        byte = b.numel() - 1
    b[byte] ^= 1 << (bit % 8)
    assert certckpt.fingerprint(b.view(dtype)) != certckpt.fingerprint(t)


def test_paired_sign_bit_flips_do_not_cancel():
    # Reading raw int64 words makes two sign-bit flips cancel (2**63 * (m1 + m2) == 0 mod 2**64).
    t = torch.randn(1024, dtype=torch.float64)
    flipped = t.clone()
    flipped[10] = -flipped[10]
    flipped[500] = -flipped[500]
    assert certckpt.fingerprint(flipped) != certckpt.fingerprint(t)
    f32 = torch.randn(1024)
    f2 = f32.clone()
    f2[3], f2[900] = -f2[3], -f2[900]
    assert certckpt.fingerprint(f2) != certckpt.fingerprint(f32)


def test_position_aware():
    t = torch.arange(100, dtype=torch.float32)
    swapped = t.clone()
    swapped[[3, 77]] = swapped[[77, 3]]
    assert certckpt.fingerprint(swapped) != certckpt.fingerprint(t)
    assert certckpt.fingerprint(t.flip(0)) != certckpt.fingerprint(t)


def test_dtype_and_shape_are_covered():
    t = torch.arange(12, dtype=torch.int32)
    fps = {
        certckpt.fingerprint(t),
        certckpt.fingerprint(t.reshape(3, 4)),
        certckpt.fingerprint(t.reshape(4, 3)),
        certckpt.fingerprint(t.view(torch.float32)),
        certckpt.fingerprint(t.view(torch.uint32)),
    }
    assert len(fps) == 5
    assert certckpt.fingerprint(torch.zeros(0, 3)) != certckpt.fingerprint(torch.zeros(3, 0))


def test_fingerprint_many_equals_one_by_one():
    ts = [torch.randn(5), torch.arange(9, dtype=torch.int16), torch.tensor(True), torch.randn(70000).bfloat16()]
    assert fingerprint_many(ts) == [certckpt.fingerprint(t) for t in ts]


def test_refuses_unstorable_dtype():
    with pytest.raises(TypeError, match="complex128"):
        certckpt.fingerprint(torch.zeros(2, dtype=torch.complex128))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu():
    for make, expected in KNOWN_ANSWERS.values():
        assert certckpt.fingerprint_hex(make().cuda()) == expected
    big = torch.randn(3 * FP_CHUNK_WORDS * 16 + 77)
    assert certckpt.fingerprint(big.cuda()) == certckpt.fingerprint(big)


def test_streaming_pieces_equal_the_whole():
    from certckpt.format.fingerprinting import StreamingFingerprint

    t = torch.randn(3 * FP_CHUNK_WORDS + 5, 1)
    raw_bytes = t.reshape(-1).view(torch.uint8)
    sfp = StreamingFingerprint("F32", tuple(t.shape))
    step = 2 * StreamingFingerprint.PIECE_ALIGN
    for lo in range(0, raw_bytes.numel(), step):
        sfp.update(raw_bytes[lo : lo + step])
    assert sfp.intdigest() == certckpt.fingerprint(t)
    with pytest.raises(ValueError, match="last piece"):
        sfp.update(raw_bytes[:4])  # after a ragged piece nothing may follow


class _SmallSlices:
    """SharedFingerprints cut into one-chunk slices, so small tensors span several."""

    @staticmethod
    def make(tensors):
        from certckpt.format.fingerprinting import SharedFingerprints, StreamingFingerprint

        class Small(SharedFingerprints):
            SLICE_BYTES = StreamingFingerprint.PIECE_ALIGN

        return Small(tensors)


def test_shared_slices_taken_by_two_threads_equal_the_whole():
    import threading

    tensors = [
        torch.randn(5 * FP_CHUNK_WORDS + 3),  # six slices, the last one ragged
        torch.zeros(0),
        torch.arange(7, dtype=torch.uint8),  # 7 bytes: a zero-padded last word
        torch.randn(300, 301)[:, :7],  # not contiguous
        torch.randn(2 * FP_CHUNK_WORDS).to(torch.bfloat16),
        torch.randint(0, 256, (12 * FP_CHUNK_WORDS + 7,), dtype=torch.uint8),  # 4 slices, the last ragged
        torch.randint(0, 256, (12 * FP_CHUNK_WORDS + 9,), dtype=torch.uint8)[1:],  # at an odd byte offset
    ]
    shared = _SmallSlices.make(tensors)
    taken = {}
    real_sum = raw_sum

    def counting_sum(words, first_chunk=0):
        name = threading.current_thread().name
        taken[name] = taken.get(name, 0) + 1
        return real_sum(words, first_chunk)

    import certckpt.format.fingerprinting as fpmod

    fpmod.raw_sum = counting_sum
    try:
        other = threading.Thread(target=shared.work, name="other")
        other.start()
        shared.work()
        other.join()
    finally:
        fpmod.raw_sum = real_sum
    assert shared.results() == fingerprint_many(tensors)
    assert sum(taken.values()) == 6 + 1 + 1 + 1 + 4 + 4  # each slice once; the empty tensor has none


def test_shared_slices_refuse_results_before_the_work_and_device_tensors():
    from certckpt.format.fingerprinting import SharedFingerprints

    shared = _SmallSlices.make([torch.randn(3 * FP_CHUNK_WORDS)])
    with pytest.raises(ValueError, match="before every slice"):
        shared.results()
    shared.cancel()
    shared.work()  # nothing left to take
    with pytest.raises(ValueError, match="after cancel"):
        shared.results()
    with pytest.raises(TypeError, match="host tensors"):
        SharedFingerprints([torch.empty(4, device="meta")])


def test_a_save_whose_writer_and_worker_share_the_slices_records_the_true_fingerprints(tmp_path, monkeypatch):
    from certckpt.format import fingerprinting
    from certckpt.format.fingerprinting import StreamingFingerprint

    monkeypatch.setattr(fingerprinting.SharedFingerprints, "SLICE_BYTES", StreamingFingerprint.PIECE_ALIGN)
    state = {"big": torch.randn(40 * FP_CHUNK_WORDS + 9), "small": torch.ones(3), "half": torch.randn(999).half()}
    for signed in (False, True):
        kw = {}
        if signed:
            from certckpt.format.signing import generate_key

            kw["signing_key"] = generate_key(str(tmp_path / "k"))[0]
        p = tmp_path / f"c{signed}.safetensors"
        certckpt.save(state, p, **kw)
        assert {k: v["fp"] for k, v in certckpt.inspect(p).record.tensors.items()} == certckpt.fingerprint_state(state)
        assert certckpt.verify(p, deep=True).ok


def test_deep_verify_catches_a_wrong_fingerprint_with_consistent_digests(tmp_path):
    from certckpt.format.record import build_header, state_fingerprint

    p = tmp_path / "c.safetensors"
    certckpt.save({"w": torch.randn(70_000), "b": torch.ones(3)}, p)
    info = certckpt.inspect(p)
    data = p.read_bytes()[info.header.data_start :]
    record = info.record
    record.tensors["w"]["fp"] = "0123456789abcdef"  # as if the writer fingerprinted other values
    record.state_fp = state_fingerprint({k: v["fp"] for k, v in record.tensors.items()})
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(build_header(list(info.header.entries), record) + data)
    assert certckpt.verify(forged).ok  # bytes match their digests...
    report = certckpt.verify(forged, deep=True)  # ...but not the fingerprint
    assert not report.ok
    assert [(p.kind, p.tensor) for p in report.problems] == [("fingerprint", "w")]
    assert "expected 0123456789abcdef" in report.problems[0].message


def test_fingerprint_state_matches_the_saved_record(tmp_path):
    sd = torch.nn.Linear(7, 3).state_dict()
    fps = certckpt.fingerprint_state(sd)
    p = tmp_path / "m.safetensors"
    certckpt.save(sd, p)
    assert fps == {k: v["fp"] for k, v in certckpt.inspect(p).record.tensors.items()}


def test_miscompiled_kernel_falls_back_to_eager(monkeypatch):
    import certckpt.format.fingerprinting as fpm

    # Simulate torch 2.13's CPU-inductor miscompile: the "compiled" kernel returns a wrong sum.
    monkeypatch.setattr(fpm.torch, "compile", lambda fn, **kw: lambda *a: fn(*a) + 1)
    monkeypatch.setattr(fpm, "_compiled", None)
    monkeypatch.setattr(fpm, "_compile_checked", False)
    t = torch.randn(3 * 16 * FP_CHUNK_WORDS)
    expected = certckpt.fingerprint(t)
    with pytest.warns(RuntimeWarning, match="compiled fingerprint disabled"):
        assert certckpt.enable_compile() is False
    assert fpm._compiled is None and certckpt.fingerprint(t) == expected


def test_a_correct_compiled_kernel_is_used(monkeypatch):
    import certckpt.format.fingerprinting as fpm

    calls = []

    def fake_compile(fn, **kw):  # stands in for torch.compile: same arithmetic, counts its calls
        def run(*a):
            calls.append(1)
            return fn(*a)

        return run

    monkeypatch.setattr(fpm.torch, "compile", fake_compile)
    monkeypatch.setattr(fpm, "_compiled", None)
    monkeypatch.setattr(fpm, "_compile_checked", False)
    t = torch.randn(2 * 16 * FP_CHUNK_WORDS + 9)
    expected = certckpt.fingerprint(t)
    assert certckpt.enable_compile() is True
    calls.clear()
    assert certckpt.fingerprint(t) == expected
    assert len(calls) == 2  # the two full blocks went through the compiled kernel


def test_the_eager_sum_does_not_depend_on_its_block_size():
    # The GPU's fallback path takes 256 chunks per pass (CUDA_BLOCK_CHUNKS), the CPU's 16 in a scratch buffer.
    from certckpt.format.fingerprinting import FP_CHUNK_WORDS, raw_sum_eager

    g = torch.Generator().manual_seed(11)
    for n in (5, FP_CHUNK_WORDS, 40 * FP_CHUNK_WORDS + 1234):
        words = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g)
        for first in (0, 7):
            want = int(raw_sum_eager(words, first))
            assert [int(raw_sum_eager(words, first, block_chunks=b)) for b in (1, 3, 256)] == [want] * 3, (n, first)


@pytest.mark.parametrize("chunks, tail", [(0, 0), (0, 5), (1, 0), (17, 3), (33, 65535)])
def test_one_thread_sums_equal_the_reference(chunks, tail):
    from certckpt.format.fingerprinting import _one_thread_checked, one_thread

    assert _one_thread_checked()  # the one-thread sums serve on this build (not a silent fall-back)
    g = torch.Generator().manual_seed(chunks + tail)
    t = torch.randint(0, 256, (4 * (chunks * FP_CHUNK_WORDS + tail) + 2,), dtype=torch.uint8, generator=g)
    with one_thread():
        assert certckpt.fingerprint(t) == ref(t)
        # a piece placed further along the sequence (first_chunk): the same as the eager sum
        assert int(raw_sum(as_words(t), 3)) == int(raw_sum_eager(as_words(t), 3))


def test_one_thread_sums_that_disagree_fall_back_to_eager(monkeypatch):
    import certckpt.format.fingerprinting as fpm

    monkeypatch.setattr(fpm, "_one_thread_ok", None)
    monkeypatch.setattr(fpm.fpsum, "raw_sum_one_thread", lambda words, first_chunk=0: torch.tensor(1))
    t = torch.randn(2 * FP_CHUNK_WORDS + 9)
    with fpm.one_thread(), pytest.warns(RuntimeWarning, match="disagree with the eager ones"):
        assert certckpt.fingerprint(t) == ref(t)
    assert fpm._one_thread_ok is False
