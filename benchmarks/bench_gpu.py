"""The GPU checks of issue 15, as one script for a session lent a GPU (CI never has one).

Measures, side by side in one run, and writes a text report and JSON under ``--out`` (default
``$OUT`` when set, else the working directory):

1. agreement: certckpt fingerprints of the same tensors on the CPU and on the GPU (dtypes x shapes x
   non-contiguous views), every case must agree bit for bit;
2. fingerprint and audit-digest throughput on the GPU, the fused Triton kernels
   (``certckpt/format/fused.py``, what ``certckpt.fingerprint`` uses on CUDA once its first-use check
   passed) and the eager torch path, against a plain ``sum`` reading the same tensor (64 MiB and
   ``--fp-gib``), and ``fingerprint_state`` over many 32 MiB bf16 tensors; targets (issue 15): fused
   >= 50 % of the read bandwidth from 64 MiB up, ``fingerprint_state`` >= 25 %;
3. saving a CUDA state: ``certckpt.save`` vs ``torch.save`` vs ``safetensors.torch.save_file``
   (all fsync'd), ratios;
4. loading to the GPU: ``certckpt.load(map_location="cuda")`` (plain and ``mmap=True``) vs
   ``torch.load(map_location="cuda", weights_only=True)`` vs ``safetensors.torch.load_file(device=
   "cuda")``, ratios (target: plain <= 1.3x safetensors);
5. the fault drill on CUDA: ``certckpt drill faults --device cuda`` (12 cases, 3 gloo ranks sharing
   the GPU), how many behaved as designed, then ``certckpt status --verify-bytes`` of one case's run
   store and ``verify --deep`` of its checkpoints (fingerprints computed on the GPU);
6. the per-step checks on CUDA: ``certckpt envelope --quick --device cuda`` with one NCCL rank and with
   3 gloo ranks sharing the GPU (plain DDP against the auditor, premium per K beside the replay floor),
   their tables as printed;
7. the fused kernels' launch choices (``fused.LAUNCH``: columns, warps, chunks per program), each
   checked bit for bit, timed on one large tensor and on 32 tensors of 32 MiB;
8. a profile of plain and audited non-audit steps (one NCCL rank): wall time, kernel launches, host
   syncs and copies per step, and the profiler's tables in ``profile.txt``.

Each section runs on its own (one that fails is reported, the rest still run) and the report is
rewritten after each, so a run cut short still leaves what it measured.

Usage on the device machine (one call, a timeout that leaves room for a rerun)::

    python benchmarks/bench_gpu.py --state-gib 3 --fp-gib 4 --out "$OUT"

``--quick`` shrinks everything (a smoke run, also possible on a CPU-only machine with ``--device cpu``).
``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``) shrinks it further, to every code path in
seconds: MiB-sized tensors, one trial, two launch choices, one drill case (the one whose run store is
checked), one shape per envelope; figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from tinymode import tiny as _tiny

import certckpt

# CERTCKPT_BENCH_TINY=1: every section on MiB-sized tensors (see the module docstring)
TINY = _tiny()
SMALL = (1 << 20) if TINY else (64 << 20)  # the "small" single tensor of the throughput rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, trials: int) -> list[float]:
    fn()  # warm-up
    _sync(device)
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def agreement(device: torch.device) -> dict:
    from certckpt.detect.digest import digest

    cases = ok = 0
    bad = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool):
        for shape in ((0,), (1,), (7,), (3, 5), (1000, 33), (65536 * 2 + 3,)):
            base = torch.randn(shape, generator=g) * 10
            t = base.to(dtype) if dtype is not torch.bool else base > 0
            views = [t] + ([t.t()] if t.dim() == 2 else []) + ([t[::2]] if t.numel() > 1 else [])
            for v in views:
                cases += 2
                a, b = certckpt.fingerprint(v), certckpt.fingerprint(v.to(device))
                da, db = int(digest(v)), int(digest(v.to(device)))
                ok += (a == b) + (da == db)
                if a != b:
                    bad.append(f"fingerprint {dtype} {tuple(v.shape)} stride {v.stride()}")
                if da != db:
                    bad.append(f"digest {dtype} {tuple(v.shape)} stride {v.stride()}")
    return {"cases": cases, "agree": ok, "disagree": bad[:10]}


def _speeds(t: torch.Tensor, device: torch.device, trials: int) -> dict:
    from certckpt.detect.digest import digest, digest_words_eager
    from certckpt.format.fingerprinting import as_words, raw_sum, raw_sum_eager

    nbytes = t.numel() * t.element_size()
    words = as_words(t)
    timings = {
        "sum": _timed(lambda: t.sum(), device, trials),
        "fingerprint": _timed(lambda: certckpt.fingerprint(t), device, trials),  # fused where ready
        "fingerprint_eager": _timed(lambda: int(raw_sum_eager(words)), device, trials),
        "digest": _timed(lambda: int(digest(t)), device, trials),
        "digest_eager": _timed(lambda: int(digest_words_eager(words)), device, trials),
        # where a single fingerprint's time goes: the sum read back to the host, and the fused sum
        # alone (kernel and partials, no host read)
        "sum_read": _timed(lambda: t.sum().item(), device, trials),
        "raw_sum_only": _timed(lambda: raw_sum(words), device, trials),
    }
    gbps = {k: nbytes / _med(v) / 1e9 for k, v in timings.items()}
    return {"bytes": nbytes, "GBps": gbps, "fraction_of_sum": {k: v / gbps["sum"] for k, v in gbps.items()}}


def fingerprint_speed(device: torch.device, gib: float, trials: int) -> dict:
    from certckpt.format import fused

    out = {"fused_active": fused.ready(device), "digest_fused_active": None}
    sizes = sorted({SMALL, int(gib * (1 << 30))})
    out["sizes"] = [_speeds(torch.randn(n // 4, device=device), device, trials) for n in sizes]
    each = (128 << 10) if TINY else (16 << 20)  # 32 MiB bf16 tensors (tiny: 256 KiB)
    many = [torch.randn(each, device=device, dtype=torch.bfloat16) for _ in range(max(4, int(gib * 24)))]
    nbytes_many = sum(x.numel() * x.element_size() for x in many)
    st = _timed(lambda: certckpt.fingerprint_state({str(i): x for i, x in enumerate(many)}), device, trials)
    sm = _timed(lambda: [x.sum() for x in many], device, trials)
    out["fingerprint_state_GBps"] = nbytes_many / _med(st) / 1e9
    out["fingerprint_state_fraction_of_sum"] = _med(sm) / _med(st)
    out["fingerprint_state_tensors"] = len(many)
    out["fingerprint_state_tensor_mib"] = each * 2 / 2**20
    from certckpt.detect.digest import digest, digest_words_eager, digests

    out["digest_fused_active"] = fused.digest_ready(device, digest_words_eager)
    out["many_active"] = fused.many_ready(device), fused.many_digest_ready(device, digest_words_eager)
    # a small model's parameters: 200 tensors of 64 KiB, one launch for all of them or one each
    small = [torch.randn(16 << 10, device=device) for _ in range(200)]
    t_many = _med(_timed(lambda: digests(small).cpu(), device, trials))
    t_each = _med(_timed(lambda: torch.stack([digest(x) for x in small]).cpu(), device, trials))
    t_fps = _med(_timed(lambda: certckpt.fingerprint_state({str(i): x for i, x in enumerate(small)}), device, trials))
    out["small_200x64KiB_ms"] = {"digests": t_many * 1e3, "digest_each": t_each * 1e3, "fingerprint_state": t_fps * 1e3}
    return out


def _state(device: torch.device, gib: float) -> dict[str, torch.Tensor]:
    each = SMALL  # 64 MiB bf16 tensors, as a large model's layers (tiny: 1 MiB)
    count = max(2, int(gib * (1 << 30) // each))
    return {f"layer{i}.weight": torch.randn(each // 2, device=device, dtype=torch.bfloat16) for i in range(count)}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_and_load(device: torch.device, gib: float, trials: int, directory: str) -> dict:
    from safetensors.torch import load_file, save_file

    state = _state(device, gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    paths = {k: os.path.join(directory, f"bench.{k}") for k in ("certckpt", "torch", "safetensors")}

    def save_certckpt():
        certckpt.save(state, paths["certckpt"])

    def save_torch():
        torch.save(state, paths["torch"])
        _fsync(paths["torch"])

    def save_st():
        save_file(state, paths["safetensors"])
        _fsync(paths["safetensors"])

    saves = {
        name: _timed(fn, device, trials)
        for name, fn in (("certckpt", save_certckpt), ("torch", save_torch), ("safetensors", save_st))
    }
    where = str(device)
    loads = {
        "certckpt": _timed(lambda: certckpt.load(paths["certckpt"], map_location=where), device, trials),
        "certckpt_mmap": _timed(
            lambda: certckpt.load(paths["certckpt"], map_location=where, mmap=True), device, trials
        ),
        "torch": _timed(lambda: torch.load(paths["torch"], map_location=where, weights_only=True), device, trials),
        "safetensors": _timed(lambda: load_file(paths["safetensors"], device=where), device, trials),
    }
    back = certckpt.load(paths["certckpt"], map_location=where)
    equal = all(torch.equal(back[k], v) for k, v in state.items())
    return {
        "bytes": nbytes,
        "save_s": {k: _med(v) for k, v in saves.items()},
        "load_s": {k: _med(v) for k, v in loads.items()},
        "save_ratio_vs_torch": _med(saves["certckpt"]) / _med(saves["torch"]),
        "save_ratio_vs_safetensors": _med(saves["certckpt"]) / _med(saves["safetensors"]),
        "load_ratio_vs_safetensors": _med(loads["certckpt"]) / _med(loads["safetensors"]),
        "load_mmap_ratio_vs_safetensors": _med(loads["certckpt_mmap"]) / _med(loads["safetensors"]),
        "load_ratio_vs_torch": _med(loads["certckpt"]) / _med(loads["torch"]),
        "verify_after_gpu_save": certckpt.verify(paths["certckpt"], deep=True).ok,
        "round_trip_equal": equal,
    }


def gpu_drill(directory: str) -> dict:
    import subprocess

    from certckpt.detect.drill import matrix_cases, run_matrix

    # tiny: only the case whose run store is checked below
    cases = [
        c
        for c in matrix_cases(audit_every=10, ckpt_every=5, rank=1)
        if not TINY or (c["fault"], c["timing"]) == ("post-optimizer", "persistent")
    ]
    t0 = time.perf_counter()
    m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=directory, device="cuda", cases=cases)
    elapsed = time.perf_counter() - t0
    designed = [
        (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
        and (c["caught_by"] is None or c["suspect_ranks"] == [c["rank"]])
        for c in m["cases"]
    ]
    rows = [
        f"{c['fault']}/{c['timing']}: caught by {c['caught_by'] or 'ESCAPED'} at {c['detected_step']}"
        f" naming {c['suspect_ranks']} ({'as designed' if ok else 'NOT as designed'})"
        for c, ok in zip(m["cases"], designed)
    ]
    store = os.path.join(directory, "post-optimizer-persistent")
    status = subprocess.run(
        [sys.executable, "-m", "certckpt_cli.main", "status", store, "--verify-bytes"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    files = sorted(f for f in os.listdir(store) if f.endswith(".safetensors"))
    deep = {f: certckpt.verify(os.path.join(store, f), deep=True).ok for f in files}
    return {
        "seconds": elapsed,
        "cases": len(designed),
        "as_designed": sum(designed),
        "rows": rows,
        "status_exit": status.returncode,
        "status": status.stdout[-3000:],
        "verify_deep": deep,
    }


def tune_fused(device: torch.device, gib: float, trials: int) -> dict:
    """The fused kernels' launch choices (``fused.LAUNCH``) timed on one large tensor and on many 32 MiB
    ones; every choice's bits are checked against the eager path first. The shipped choice is the first row."""
    from certckpt.detect.digest import digest_words_eager
    from certckpt.format import fused
    from certckpt.format.fingerprinting import as_words, raw_sum_eager

    if not fused.ready(device):
        return {"skipped": "fused kernels not active"}
    big = as_words(torch.randn(int(gib * (1 << 28)), device=device))
    many = [as_words(torch.randn((64 << 10) if TINY else (8 << 20), device=device)) for _ in range(32)]
    ref_sum, ref_digest = int(raw_sum_eager(big)), int(digest_words_eager(big))
    ref_many = [int(raw_sum_eager(w)) for w in many]
    shipped = dict(fused.LAUNCH)
    choices = [shipped] + [
        {"cols": c, "num_warps": w, "chunks": k}
        for c in (1024, 2048, 4096)
        for w in (4, 8)
        for k in (None, 16, 64)
        if {"cols": c, "num_warps": w, "chunks": k} != shipped
    ][: 2 if TINY else None]
    rows = []
    nbytes = big.numel() * 4
    # the reference reads the same bytes as float32 (a sum of the int32 words accumulates in int64: slower)
    sum_s = _med(_timed(lambda: big.view(torch.float32).sum(), device, trials))
    many_sum_s = _med(_timed(lambda: [w.view(torch.float32).sum() for w in many], device, trials))
    try:
        for choice in choices:
            fused.LAUNCH.update(choice)
            try:
                ok = int(fused.raw_sum_fused(big)) == ref_sum and int(fused.digest_fused(big)) == ref_digest
                ok = ok and [int(fused.raw_sum_fused(w)) for w in many] == ref_many
                fp = _med(_timed(lambda: fused.raw_sum_fused(big), device, trials))
                dg = _med(_timed(lambda: fused.digest_fused(big), device, trials))
                st = _med(_timed(lambda: [fused.raw_sum_fused(w) for w in many], device, trials))
                rows.append(
                    {
                        **choice,
                        "bits_ok": ok,
                        "fingerprint_GBps": nbytes / fp / 1e9,
                        "digest_GBps": nbytes / dg / 1e9,
                        "fingerprint_fraction_of_sum": sum_s / fp,
                        "digest_fraction_of_sum": sum_s / dg,
                        "many_32MiB_fraction_of_sum": many_sum_s / st,
                    }
                )
            except Exception as e:  # a choice Triton cannot compile here: say so, try the next
                rows.append({**choice, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    finally:
        fused.LAUNCH.clear()
        fused.LAUNCH.update(shipped)
    good = [r for r in rows if r.get("bits_ok")]
    best = max(good, key=lambda r: r["fingerprint_fraction_of_sum"]) if good else None
    return {"bytes": nbytes, "sum_GBps": nbytes / sum_s / 1e9, "rows": rows, "best": best}


def envelope_cuda(*, ranks: int, backend: str, timeout: int, seconds_per_shape: int, read: str = "immediate") -> dict:
    import subprocess

    cmd = [
        "certckpt", "envelope", "--quick", "--backend", backend, "--device", "cuda", "--ranks", str(ranks),
        "--seconds-per-shape", str(seconds_per_shape), "--nonfinite-read", read,
    ]  # fmt: skip
    if TINY:
        cmd += ["--seq-lens", "16", "--micro-batches", "1", "--audit-every", "10", "--steps", "1"]
    t0 = time.perf_counter()
    try:
        run = subprocess.run(
            [sys.executable, "-m", "certckpt_cli.main", *cmd[1:]], capture_output=True, text=True, timeout=timeout
        )
        code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        code, err = "timeout", (e.stderr or b"").decode(errors="replace")
    return {
        "command": " ".join(cmd),
        "exit": code,
        "seconds": time.perf_counter() - t0,
        "table": out[-4000:],
        "stderr_tail": err[-2500:],
    }


def profile_steps(device: torch.device, steps: int, out_dir: str, trials: int = 5) -> dict:
    """Where a non-audit step's time goes on CUDA: plain DDP and the auditor's non-audit steps (one NCCL
    rank, the envelope's tiny transformer), wall time per step, kernel launches and host syncs per
    step from the profiler, and the profiler's op tables written to ``profile.txt``."""
    import copy
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    from certckpt.detect.auditor import Auditor
    from certckpt.detect.events import MemorySink
    from certckpt.tools.envelope.models import tiny_transformer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        cuda = device.type == "cuda"
        group = dist.new_group(backend="nccl") if cuda else None
        torch.use_deterministic_algorithms(True)
        model, batch_fn, loss_fn = tiny_transformer()
        model = model.to(device)
        kw = {"device_ids": [device.index or 0], "process_group": group} if cuda else {}
        plain = DDP(copy.deepcopy(model), **kw)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
        auds = {}
        for read, every in (("immediate", 10**9), ("deferred", 10**9), ("audit", 1)):
            aud_model = DDP(copy.deepcopy(model), **kw)
            auds[read] = Auditor(
                aud_model,
                torch.optim.AdamW(aud_model.parameters(), lr=1e-4),
                loss_fn=loss_fn,
                run="profile",
                audit_every=every,
                sink=MemorySink(),
                nonfinite_read="deferred" if read == "deferred" else "immediate",
            )
        batches = [tuple(x.to(device) for x in batch_fn(0, i, 256, 4)) for i in range(steps)]

        def plain_steps():
            for b in batches:
                plain_opt.zero_grad(set_to_none=True)
                loss_fn(plain, b).backward()
                plain_opt.step()

        def audited_steps(read):
            def steps():
                for b in batches:
                    auds[read].train_step(b)

            return steps

        results, tables = {}, []
        variants = [
            ("plain", plain_steps),
            ("audited_nonaudit", audited_steps("immediate")),
            ("audited_deferred", audited_steps("deferred")),
            ("audit_every_step", audited_steps("audit")),  # replay, digests and consensus at every step
        ]
        for name, fn in variants * 2:  # twice, interleaved: the second round's figures are kept
            fn()  # warm-up (the auditor's first step runs its set-up checks)
            wall = _med(_timed(fn, device, min(trials, 5))) / steps
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
                fn()
                _sync(device)
            ka = prof.key_averages()
            count = {e.key: e.count for e in ka}
            launches = sum(v for k, v in count.items() if "LaunchKernel" in k or "cuLaunch" in k)
            syncs = sum(v for k, v in count.items() if "Synchronize" in k)
            copies = sum(v for k, v in count.items() if "Memcpy" in k and "cuda" in k.lower())
            results[name] = {
                "ms_per_step": wall * 1e3,
                "launches_per_step": launches / steps,
                "syncs_per_step": syncs / steps,
                "memcpy_calls_per_step": copies / steps,
            }
            if len(tables) < len(variants):
                tables.append(f"== {name} ({steps} steps) ==\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "profile.txt"), "w") as fh:
            fh.write("\n\n".join(tables))
        results["nonaudit_ratio"] = results["audited_nonaudit"]["ms_per_step"] / results["plain"]["ms_per_step"]
        results["deferred_ratio"] = results["audited_deferred"]["ms_per_step"] / results["plain"]["ms_per_step"]
        results["audit_step_ratio"] = results["audit_every_step"]["ms_per_step"] / results["plain"]["ms_per_step"]
        return results
    finally:
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()


SECTIONS = (
    "agreement",
    "fingerprint",
    "drill",
    "save_load",
    "profile",
    "envelope_nccl",
    "envelope_nccl_deferred",
    "envelope_gloo3",
    "tune",
)


def _lines(report: dict) -> list[str]:
    """The human-readable report of whatever sections have run so far."""
    lines = [f"bench_gpu on {report['device']} (torch {report['torch']}, certckpt {report['certckpt']})"]
    for name, err in report.get("errors", {}).items():
        lines.append(f"{name}: FAILED: {err.splitlines()[-1] if err else ''}")
    a = report.get("agreement")
    if a:
        lines.append(
            f"agreement CPU/GPU fingerprints and digests: {a['agree']} of {a['cases']}"
            + (f"  DISAGREE: {a['disagree']}" if a["disagree"] else "")
        )
    t = report.get("tune")
    if t and "rows" in t:
        lines.append(f"fused launch choices on {t['bytes'] / 2**30:.2f} GiB fp32 (sum {t['sum_GBps']:.0f} GB/s):")
        for r in t["rows"]:
            choice = f"cols {r['cols']} warps {r['num_warps']} chunks {r['chunks']}"
            if "error" in r:
                lines.append(f"  {choice}: {r['error']}")
            else:
                bits = "ok" if r["bits_ok"] else "WRONG"
                lines.append(
                    f"  {choice}: bits {bits}, fingerprint {r['fingerprint_GBps']:.0f} GB/s"
                    f" ({100 * r['fingerprint_fraction_of_sum']:.0f} %), digest {r['digest_GBps']:.0f} GB/s"
                    f" ({100 * r['digest_fraction_of_sum']:.0f} %),"
                    f" 32x32 MiB {100 * r['many_32MiB_fraction_of_sum']:.0f} %"
                )
        if t.get("best"):
            b = t["best"]
            lines.append(f"  best: cols {b['cols']} warps {b['num_warps']} chunks {b['chunks']}")
    elif t:
        lines.append(f"fused launch choices: {t}")
    f = report.get("fingerprint")
    if f:
        lines.append(f"fused kernels active: fingerprint {f['fused_active']}, digest {f['digest_fused_active']}")
        for size in f["sizes"]:
            g, fr = size["GBps"], size["fraction_of_sum"]
            lines.append(
                f"{size['bytes'] / 2**20:.0f} MiB fp32: sum {g['sum']:.1f} GB/s; "
                + ", ".join(f"{k} {g[k]:.1f} GB/s ({100 * fr[k]:.1f} %)" for k in g if k != "sum")
                + f"  [target fused >= 50 %: {'met' if fr['fingerprint'] >= 0.5 and fr['digest'] >= 0.5 else 'MISSED'}]"
            )
        lines.append(
            f"fingerprint_state of {f['fingerprint_state_tensors']} bf16"
            f" {f.get('fingerprint_state_tensor_mib', 32):g} MiB tensors:"
            f" {f['fingerprint_state_GBps']:.1f} GB/s"
            f" ({100 * f['fingerprint_state_fraction_of_sum']:.1f} % of their sums' bandwidth)"
            f"  [target >= 25 %: {'met' if f['fingerprint_state_fraction_of_sum'] >= 0.25 else 'MISSED'}]"
        )
        sm = f.get("small_200x64KiB_ms")
        if sm:
            lines.append(
                f"200 tensors of 64 KiB (many-tensor kernels active {f['many_active']}): digests {sm['digests']:.2f} ms"
                f" (one digest each: {sm['digest_each']:.2f} ms), fingerprint_state {sm['fingerprint_state']:.2f} ms"
            )
    s = report.get("save_load")
    if s:
        lines.append(
            f"save {s['bytes'] / 1e9:.2f} GB: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in s["save_s"].items())
            + f"; ratio /torch.save {s['save_ratio_vs_torch']:.2f}x, /safetensors {s['save_ratio_vs_safetensors']:.2f}x"
        )
        lines.append(
            "load to device: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in s["load_s"].items())
            + f"; ratio /safetensors {s['load_ratio_vs_safetensors']:.2f}x"
            + f" (mmap {s['load_mmap_ratio_vs_safetensors']:.2f}x), /torch.load {s['load_ratio_vs_torch']:.2f}x"
            + "  [target <= 1.3x: "
            + ("met" if s["load_ratio_vs_safetensors"] <= 1.3 else "MISSED")
            + "]"
        )
        lines.append(
            f"verify --deep of the GPU-fingerprinted file: {s['verify_after_gpu_save']}; "
            f"round trip equal: {s['round_trip_equal']}"
        )
    dr = report.get("drill")
    if dr:
        lines.append(
            f"drill on CUDA (3 gloo ranks): {dr['as_designed']} of {dr['cases']} cases as designed"
            f" in {dr['seconds']:.0f} s; status --verify-bytes exit {dr['status_exit']};"
            f" verify --deep {sum(dr['verify_deep'].values())} of {len(dr['verify_deep'])} checkpoints"
        )
        lines += ["  " + r for r in dr["rows"]]
    for key in ("envelope_nccl", "envelope_nccl_deferred", "envelope_gloo3"):
        ev = report.get(key)
        if ev:
            lines.append(f"{ev['command']}: exit {ev['exit']} in {ev['seconds']:.0f} s")
            lines += ["  " + r for r in ev["table"].splitlines()]
            if ev["exit"] not in (0, 1):
                lines += ["  stderr: " + r for r in ev["stderr_tail"].splitlines()[-8:]]
    pr = report.get("profile")
    if pr:
        for name in ("plain", "audited_nonaudit", "audited_deferred", "audit_every_step"):
            r = pr[name]
            lines.append(
                f"profile {name}: {r['ms_per_step']:.2f} ms/step, {r['launches_per_step']:.0f} launches,"
                f" {r['syncs_per_step']:.1f} syncs, {r['memcpy_calls_per_step']:.1f} copies per step"
            )
        lines.append(
            f"profile: non-audit step / plain step {pr['nonaudit_ratio']:.3f}x (immediate flag read),"
            f" {pr['deferred_ratio']:.3f}x (nonfinite_read='deferred')  [target <= 1.02x];"
            f" an audit step {pr['audit_step_ratio']:.2f}x"
        )
    return lines


def _write(report: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    text = "\n".join(_lines(report))
    with open(os.path.join(out, "bench_gpu.txt"), "w") as fh:
        fh.write(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--state-gib", type=float, default=3.0, help="size of the saved/loaded bf16 state")
    ap.add_argument("--fp-gib", type=float, default=4.0, help="size of the fingerprint throughput tensor")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB everywhere, 3 trials")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default=None, help="where the files go (a local disk)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--envelope-timeout", type=int, default=150)
    ap.add_argument("--envelope-seconds", type=int, default=8, help="seconds per shape in each envelope")
    args = ap.parse_args(argv)
    if args.quick:
        args.state_gib = args.fp_gib = 0.25
        args.trials = 3
    if TINY:
        print("bench_gpu: tiny mode (CERTCKPT_BENCH_TINY=1): toy sizes, the figures mean nothing", file=sys.stderr)
        args.state_gib = args.fp_gib = 1 / 256
        args.trials = 1
        args.envelope_seconds = 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke run", file=sys.stderr)
        return 2
    wanted = [x for x in args.only.split(",") if x]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections: {', '.join(unknown)}")
    cuda = device.type == "cuda"
    report: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "certckpt": certckpt.__version__,
        "errors": {},
        "seconds": {},
    }
    work = {
        "agreement": lambda: agreement(device),
        "tune": lambda: tune_fused(device, args.fp_gib / 4 if TINY else max(args.fp_gib / 4, 0.25), args.trials),
        "fingerprint": lambda: fingerprint_speed(device, args.fp_gib, args.trials),
        "save_load": lambda: _in_tmp(args.dir, lambda d: save_and_load(device, args.state_gib, args.trials, d)),
        "drill": lambda: _in_tmp(args.dir, lambda d: gpu_drill(os.path.join(d, "drill"))),
        "envelope_nccl": lambda: envelope_cuda(
            ranks=1, backend="nccl", timeout=args.envelope_timeout, seconds_per_shape=args.envelope_seconds
        ),
        "envelope_nccl_deferred": lambda: envelope_cuda(
            ranks=1,
            backend="nccl",
            timeout=args.envelope_timeout,
            seconds_per_shape=args.envelope_seconds,
            read="deferred",
        ),
        "envelope_gloo3": lambda: envelope_cuda(
            ranks=3, backend="gloo", timeout=args.envelope_timeout, seconds_per_shape=args.envelope_seconds
        ),
        "profile": lambda: profile_steps(device, 3 if TINY else 30, args.out, args.trials),
    }
    gpu_only = {"drill", "envelope_nccl", "envelope_nccl_deferred", "envelope_gloo3"}
    for name in SECTIONS:
        if name not in wanted or (name in gpu_only and not cuda):
            continue
        # Each section on its own: one that fails is reported and the others still run, and the
        # report is rewritten after each, so that a run cut short still leaves what it measured.
        t0 = time.perf_counter()
        print(f"[bench_gpu] {name} ...", flush=True)
        try:
            report[name] = work[name]()
        except Exception:
            import traceback

            report["errors"][name] = traceback.format_exc()[-3000:]
        report["seconds"][name] = round(time.perf_counter() - t0, 1)
        print(f"[bench_gpu] {name} done in {report['seconds'][name]:.0f} s", flush=True)
        _write(report, args.out)
    print(_write(report, args.out))
    a, s = report.get("agreement"), report.get("save_load")
    broken = s and not (s["round_trip_equal"] and s["verify_after_gpu_save"])
    bad = report["errors"] or (a and a["disagree"]) or broken
    return 1 if bad else 0


def _in_tmp(where: str | None, fn):
    with tempfile.TemporaryDirectory(dir=where) as d:
        return fn(d)


if __name__ == "__main__":
    sys.exit(main())
