"""The fused fingerprint and audit-digest kernels (certckpt/format/fused.py, Triton, for CUDA).

Without a GPU their arithmetic is checked through Triton's interpreter (``TRITON_INTERPRET=1``, in two
subprocesses that share the cases: the variable is read when the kernels are defined): the same bits
as the eager paths for lengths around every boundary (a word, a program's columns, a chunk, many
chunks per program), at a chunk offset (streamed pieces), for both sums; a kernel that disagrees is
refused by the first-use check with a warning. The CPU paths never import Triton. On CUDA (skipped
without): the dispatch serves CUDA tensors and agrees with the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

INTERPRETED = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from certckpt.format import fused
    from certckpt.format.fingerprinting import FP_CHUNK_WORDS as C, raw_sum_eager
    from certckpt.detect.digest import digest_words_eager

    # Two processes share the work (the interpreter runs on one core): "big" checks the largest length,
    # "rest" everything else. Both draw every input, so each case sees the same words either way.
    part = sys.argv[1]
    g = torch.Generator().manual_seed(7)
    out = {"cases": 0, "bad": []}
    sizes = [1, 3, 1023, 1024, 1025, C - 1, C, C + 1, 3 * C + 1234, 70 * C + 5]
    for n in sizes:
        w = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g)
        if (n == sizes[-1]) != (part == "big"):
            continue
        for first in (0, 7):
            out["cases"] += 1
            if int(fused.raw_sum_fused(w, first)) != int(raw_sum_eager(w, first)):
                out["bad"].append(["fingerprint", n, first])
        out["cases"] += 1
        if int(fused.digest_fused(w)) != int(digest_words_eager(w)):
            out["bad"].append(["digest", n])
    # many tensors in one launch: views of one buffer (a DDP bucket's gradients), tensors of their
    # own at either side of it in memory, empty ones, one past a chunk boundary; twice (cached layout)
    bucket = torch.randint(-(2**31), 2**31, (3 * C + 1234,), dtype=torch.int32, generator=g)
    parts = [torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, generator=g) for n in (7, 0, C + 1)]
    parts += [bucket[:1], bucket[1:0], bucket[1 : C + 3], bucket[C + 3 :]]
    parts += [torch.randint(-(2**31), 2**31, (1025,), dtype=torch.int32, generator=g)]
    if part == "big":
        print(json.dumps(out))
        sys.exit()
    for _ in range(2):
        out["many_cases"] = out.get("many_cases", 0) + 2 * len(parts)
        if fused.raw_sums_fused(parts).tolist() != [int(raw_sum_eager(w)) for w in parts]:
            out["bad"].append(["many fingerprint"])
        if fused.digests_fused(parts).tolist() != [int(digest_words_eager(w)) for w in parts]:
            out["bad"].append(["many digest"])
    cpu = torch.device("cpu")
    out["self_check"] = fused.self_check(cpu)
    out["ready_cpu"] = fused.ready(cpu)  # CPU tensors never take the kernels outside this test
    # the many-tensor kernels' first-use check passes them, and refuses one that is off by one
    out["many_check"] = fused._many_check(cpu, "many fp", fused.raw_sums_fused, raw_sum_eager)
    out["many_digest_check"] = fused._many_check(cpu, "many digest", fused.digests_fused, digest_words_eager)
    out["many_broken"] = fused._many_check(cpu, "many broken", lambda p: fused.raw_sums_fused(p) + 1, raw_sum_eager)
    fused.raw_sum_fused = lambda w, first=0: raw_sum_eager(w, first) + 1  # a miscompiled kernel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["broken_check"] = fused.self_check(cpu)
    out["warning"] = [str(c.message) for c in caught]
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_fused_kernels_compute_the_specified_bits_in_tritons_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", INTERPRETED, part],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for part in ("big", "rest")
    ]
    big, out = {}, {}
    try:
        for p, into in zip(procs, (big, out)):
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, stderr[-3000:]
            into.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out["cases"] += big["cases"]
    out["bad"] += big["bad"]
    assert out["cases"] == 30 and out["many_cases"] == 32 and out["bad"] == []
    assert out["self_check"] is True and out["ready_cpu"] is False
    assert out["many_check"] is True and out["many_digest_check"] is True and out["many_broken"] is False
    assert out["broken_check"] is False
    assert any("fused fingerprint kernel off on cpu" in w and "disagrees" in w for w in out["warning"])


def test_cpu_fingerprints_and_digests_never_import_triton():
    code = (
        "import sys, torch, certckpt\n"
        "from certckpt.detect.digest import digest\n"
        "certckpt.fingerprint(torch.arange(100000.0)); digest(torch.arange(10.0))\n"
        "print('triton' in sys.modules, 'certckpt.format.fused' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "False"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_tensors_take_the_fused_kernels_and_agree_with_the_cpu():
    pytest.importorskip("triton")
    from certckpt.detect.digest import digest
    from certckpt.format import fused
    from certckpt.format.fingerprinting import fingerprint

    dev = torch.device("cuda")
    assert fused.ready(dev) and fused.many_ready(dev)
    g = torch.Generator().manual_seed(3)
    for n in (1, 65535, 65537, 5 * 65536 + 3, 300 * 65536):
        t = torch.randn(n, generator=g)
        assert fingerprint(t.to(dev)) == fingerprint(t)
        assert int(digest(t.to(dev))) == int(digest(t))


@needs_cuda
def test_many_cuda_tensors_take_one_launch_and_agree_with_the_cpu():
    pytest.importorskip("triton")
    from certckpt.detect.digest import digest_words_eager, digests
    from certckpt.format import fused
    from certckpt.format.fingerprinting import fingerprint_many

    dev = torch.device("cuda")
    assert fused.many_digest_ready(dev, digest_words_eager)
    g = torch.Generator().manual_seed(4)
    flat = torch.randn(3 * 65536 + 77, generator=g)
    cpu = [
        torch.randn(10, 10, generator=g),
        torch.zeros(0),
        flat[:5],
        flat[5 : 65536 + 9].view(-1, 2),
        flat[65536 + 9 :],
        torch.randn(301, generator=g).to(torch.bfloat16),  # an odd byte count: the last word is padded
        torch.randn(7, 3, generator=g).t(),  # not contiguous
    ]
    gpu_flat = flat.to(dev)
    gpu = [t.to(dev) for t in cpu]
    gpu[2:5] = [gpu_flat[:5], gpu_flat[5 : 65536 + 9].view(-1, 2), gpu_flat[65536 + 9 :]]  # views of one buffer
    assert fingerprint_many(gpu) == fingerprint_many(cpu)
    assert digests(gpu).tolist() == digests(cpu).tolist()
