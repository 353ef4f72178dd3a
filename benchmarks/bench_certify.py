"""Ledger scale: a 1,000,000-step run, a full audit every 100 steps, a checkpoint every 1,000.

Writes the ledger through the real Ledger API into a temp dir on local disk (events batched into one
segment per checkpoint, as the auditor's LedgerSink does), then measures, side by side:
- the ledger's size on disk (target < 100 MB);
- certifying it: read every record + the pure certifier (target < 2 s), in-process and as the whole
  `certckpt status --json` / `certckpt latest-good --no-verify` processes.

    python benchmarks/bench_certify.py [--steps 1000000] [--audit-every 100] [--ckpt-every 1000] [--json]
    python benchmarks/bench_certify.py --baseline REV [--trials 5]   # the trust kernel against REV

``--baseline REV`` measures only the trust kernel's overhead (issue 41): latest-good over 1,000,000
signed event lines, cold and warm, and a vault prune's plan, each as a whole process, the library at
REV (a git worktree) and the one here interleaved, with their ratios.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): 2,000 steps, one trial, and a signed ledger of
600 lines from 2 writers too: every code path in seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_startup import importtime_ms
from tinymode import announce

from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store


def build(store: str, steps: int, audit_every: int, ckpt_every: int) -> tuple[int, float]:
    led = Ledger(store)
    inv = {str(r): {"host": f"node-{r // 8}", "device": "NVIDIA H100 80GB HBM3"} for r in range(3)}
    buf: list[dict] = []
    n_events = 0
    t0 = time.perf_counter()
    for s in range(audit_every, steps + 1, audit_every):
        fp = f"{s:016x}"
        buf += [
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "replay",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"comparisons": 3, "mode": "deterministic"},
                "inventory": {},
            },
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "nonfinite",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"steps_checked": audit_every, "first": s - audit_every + 1},
                "inventory": {},
            },
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "consensus",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"fp": fp, "params": 300},
                "inventory": {},
            },
        ]
        if s == steps // 2:  # one detection, for realism
            buf.append(
                {
                    "run": "big",
                    "branch": "main",
                    "step": s + 7,
                    "kind": "replay",
                    "outcome": "fail",
                    "ranks": [0, 1, 2],
                    "suspect_ranks": [1],
                    "contained": False,
                    "details": {"failed": [{"origin": 1, "replayer": 2}]},
                    "inventory": inv,
                }
            )
        if s % ckpt_every == 0:
            n_events += len(buf)
            led.append_events(buf)
            buf = []
            led.commit_checkpoint(
                branch="main",
                step=s,
                location=f"{store}/step{s:09d}.safetensors",
                run="big",
                consensus_fp=fp,
                state_fp="1" * 16,
                header_digest="2" * 32,
                step_range=[s - ckpt_every + 1, s],
                nbytes=10**9,
            )
    led.append_events(buf)
    n_events += len(buf)
    return n_events, time.perf_counter() - t0


def du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def timed(fn, trials: int) -> list[float]:
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def build_signed(store: str, n_events: int, writers: int) -> float:
    """``n_events`` audit event lines from ``writers`` signing writers (one Ledger each, 4,096 lines a
    segment, as the LedgerSink flushes), each on its own branch; returns seconds spent."""
    from certckpt.format.signing import SigningKey, generate_key

    key_path, pub = generate_key(os.path.join(store, "..", f"bench-key-{os.getpid()}"))
    key = SigningKey.load(key_path)
    ledgers = [Ledger(store, signing_key=key, trusted_keys=None) for _ in range(writers)]
    per, seg = n_events // writers, 4096
    t0 = time.perf_counter()
    for w, led in enumerate(ledgers):
        branch = f"b{w}"
        for first in range(0, per, seg):
            batch = []
            for i in range(first, min(first + seg, per)):
                s = (i // 3 + 1) * 10
                kind = ("replay", "nonfinite", "consensus")[i % 3]
                batch.append(
                    {
                        "run": "big",
                        "branch": branch,
                        "step": s,
                        "kind": kind,
                        "outcome": "pass",
                        "ranks": [0, 1, 2],
                        "suspect_ranks": [],
                        "contained": False,
                        "details": {"fp": f"{s:016x}"} if kind == "consensus" else {"comparisons": 3},
                        "inventory": {},
                    }
                )
            led.append_events(batch)
        led.commit_checkpoint(
            branch=branch,
            step=10 * (per // 3),
            location=f"{store}/{branch}.safetensors",
            run="big",
            consensus_fp=f"{10 * (per // 3):016x}",
        )
    return time.perf_counter() - t0, pub


def _latest_good_process(exe: str, store: str, env: dict[str, str]) -> tuple[float, float, int]:
    """(seconds, peak MB, exit code) of one whole `certckpt latest-good --no-verify` process."""
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        f"r = subprocess.run([{exe!r}, 'latest-good', {store!r}, '--no-verify'], capture_output=True); "
        "dt = time.perf_counter() - t; "
        "print(dt, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    dt, rss_kb, rc = out.stdout.split()
    return float(dt), int(rss_kb) / 1024, int(rc)


def signed_scale(n_events: int, writers: int, exe: str) -> dict:
    """latest-good over a signed, chained ledger of ``n_events`` lines from ``writers`` writers: cold
    (no reader memory), then warm after 1,000 lines more (issue 26: <= 10 s, <= 0.5 s, <= 500 MB)."""
    from certckpt.format.signing import SigningKey

    with tempfile.TemporaryDirectory(prefix="certckpt-bench-signed-") as top:
        store = os.path.join(top, "run")
        os.makedirs(store)
        build_s, pub = build_signed(store, n_events, writers)
        env = dict(os.environ, CERTCKPT_TRUSTED_KEYS=pub, CERTCKPT_STATE_DIR=os.path.join(top, "state"))
        cold_s, cold_mb, rc = _latest_good_process(exe, store, env)
        key = SigningKey.load(pub.removesuffix(".pub"))
        extra = [
            {
                "run": "big",
                "branch": "b0",
                "step": 10**7 + i // 3,
                "kind": ("replay", "nonfinite", "consensus")[i % 3],
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {},
                "inventory": {},
            }
            for i in range(1000)
        ]
        Ledger(store, signing_key=key, trusted_keys=None).append_events(extra)
        warm_s, warm_mb, _ = _latest_good_process(exe, store, env)
        # warm, nothing new: the best of three whole processes (start-up noise is one-sided)
        again_s = min(_latest_good_process(exe, store, env)[0] for _ in range(3))
        floor_s, _, _ = _latest_good_process(exe, os.path.join(top, "empty"), env)
        imports = subprocess.run(
            [exe, "latest-good", store, "--no-verify"],
            capture_output=True,
            text=True,
            env=dict(env, PYTHONPROFILEIMPORTTIME="1"),
        )
        import_ms = importtime_ms(imports.stderr)[0]
    res = {
        "signed_events": n_events,
        "writers": writers,
        "build_seconds": build_s,
        "cold_latest_good_s": cold_s,
        "cold_peak_mb": cold_mb,
        "warm_after_1000_lines_s": warm_s,
        "warm_peak_mb": warm_mb,
        "warm_unchanged_s": again_s,
        "process_floor_s": floor_s,
        "import_ms": import_ms,
        "exit": rc,
    }
    ok = lambda good: "PASS" if good else "MISS"  # noqa: E731
    print(
        f"signed ledger: {n_events:,} event lines from {writers} signing writers (built in {build_s:.1f} s)\n"
        f"  latest-good, cold, whole process        {cold_s:8.2f} s   target <= 10 s    {ok(cold_s <= 10)}\n"
        f"  peak memory, cold                       {cold_mb:8.0f} MB  target <= 500 MB  {ok(cold_mb <= 500)}\n"
        f"  latest-good, warm after 1,000 lines     {warm_s:8.2f} s   target <= 0.5 s   {ok(warm_s <= 0.5)}"
        f"   (of which {floor_s:.2f} s is starting the `certckpt` process itself)\n"
        f"  latest-good, warm, nothing new          {again_s:8.2f} s   target <= 0.5 s   {ok(again_s <= 0.5)}"
        f"   (best of 3 whole processes; peak {warm_mb:.0f} MB; its imports: {import_ms:.0f} ms)"
    )
    return res


def _worktree(rev: str, top: str) -> str:
    """A checkout of ``rev`` (the library as it was), for the side-by-side baseline."""
    path = os.path.join(top, "baseline")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["git", "-C", here, "worktree", "add", "--detach", path, rev], capture_output=True, check=True)
    return path


def _prune_process(exe: str, vault: str, env: dict[str, str]) -> float:
    t = time.perf_counter()
    r = subprocess.run([exe, "vault", "prune", vault, "--keep-last", "5", "--json"], capture_output=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"vault prune exited {r.returncode}: {r.stderr.decode()[-300:]}")
    return time.perf_counter() - t


def build_vault(top: str, copies: int) -> tuple[str, dict[str, str]]:
    """A signed run of ``copies`` small checkpoints, every one promoted into a vault (accept verified)."""
    import torch

    import certckpt
    from certckpt.format.signing import SigningKey, generate_key
    from certckpt.vault.promotion import promote

    key_path, pub = generate_key(os.path.join(top, "vault-key"))
    run, vault = os.path.join(top, "vrun"), os.path.join(top, "vault")
    os.makedirs(run)
    key = SigningKey.load(key_path)
    led = Ledger(run, signing_key=key, trusted_keys=None)
    for s in range(1, copies + 1):
        certckpt.save(
            {"w": torch.full((64,), float(s))}, f"{run}/s{s:05d}.safetensors", ledger=led, step=s, signing_key=key
        )
    env = dict(os.environ, CERTCKPT_SIGNING_KEY=key_path, CERTCKPT_TRUSTED_KEYS=pub)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        promote(run, vault, accept="verified")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return vault, env


def kernel_overhead(a: argparse.Namespace, exe: str) -> dict:
    """The trust kernel's checks (issue 41) against the library at ``a.baseline``, interleaved, whole
    processes: latest-good over a signed ledger cold (no reader memory) and warm, and a vault prune's
    plan (``--keep-last 5``, dry run: every deletion asks the gate)."""
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-kernel-") as top:
        base = _worktree(a.baseline, top)
        store = os.path.join(top, "run")
        os.makedirs(store)
        _, pub = build_signed(store, a.kernel_events, a.writers)
        vault, venv = build_vault(top, a.prune_copies)
        variants = {"baseline": {"PYTHONPATH": base}, "now": {}}
        times: dict[str, dict[str, list[float]]] = {v: {"cold": [], "warm": [], "prune": []} for v in variants}
        for trial in range(a.trials):
            for name, extra in variants.items():
                state = os.path.join(top, f"state-{name}-{trial}")
                env = dict(os.environ, CERTCKPT_TRUSTED_KEYS=pub, CERTCKPT_STATE_DIR=state, **extra)
                times[name]["cold"].append(_latest_good_process(exe, store, env)[0])
                times[name]["warm"].append(_latest_good_process(exe, store, env)[0])
                times[name]["prune"].append(_prune_process(exe, vault, dict(venv, CERTCKPT_STATE_DIR=state, **extra)))
        subprocess.run(
            ["git", "worktree", "remove", "--force", base], capture_output=True, cwd=os.path.dirname(__file__)
        )
    med = {v: {k: statistics.median(x) for k, x in t.items()} for v, t in times.items()}
    print(
        f"trust kernel overhead against {a.baseline} ({a.kernel_events:,} signed event lines from {a.writers} writers; "
        f"a vault of {a.prune_copies} copies; median of {a.trials}, interleaved, whole processes)"
    )
    print(f"  {'':36s} {'baseline':>9s} {'now':>9s} {'ratio':>7s}  target <= 1.10x")
    labels = {"cold": "latest-good, cold", "warm": "latest-good, warm", "prune": "vault prune --keep-last 5 (plan)"}
    res: dict = {"baseline": a.baseline}
    for k, label in labels.items():
        ratio = med["now"][k] / med["baseline"][k]
        res[k] = {"baseline_s": med["baseline"][k], "now_s": med["now"][k], "ratio": ratio}
        print(
            f"  {label:36s} {med['baseline'][k]:8.3f}s {med['now'][k]:8.3f}s {ratio:6.3f}x  "
            f"{'PASS' if ratio <= 1.10 else 'MISS'}"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--signed-events", type=int, default=None, help="also: a signed ledger of this many event lines (tiny: 600)"
    )
    ap.add_argument("--writers", type=int, default=None, help="default 64 (tiny 2)")
    ap.add_argument("--signed-only", action="store_true", help="run only the signed-ledger measurement")
    ap.add_argument("--steps", type=int, default=None, help="default 1,000,000 (tiny 2,000)")
    ap.add_argument("--audit-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=None, help="default 5 (tiny 1)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--baseline",
        metavar="GIT_REV",
        default=None,
        help="only: the trust kernel's overhead against the library at GIT_REV (a git worktree), side by side",
    )
    ap.add_argument("--kernel-events", type=int, default=None, help="with --baseline (default 1,000,000; tiny 600)")
    ap.add_argument("--prune-copies", type=int, default=None, help="with --baseline (default 100; tiny 6)")
    a = ap.parse_args()
    tiny = announce("bench_certify")  # explicit options still win
    a.steps = a.steps or (2000 if tiny else 1_000_000)
    a.trials = a.trials or (1 if tiny else 5)
    a.signed_events = a.signed_events if a.signed_events is not None else (600 if tiny else 0)
    a.writers = a.writers or (2 if tiny else 64)
    exe = os.path.join(os.path.dirname(sys.executable), "certckpt")
    if a.baseline:
        a.kernel_events = a.kernel_events or (600 if tiny else 1_000_000)
        a.prune_copies = a.prune_copies or (6 if tiny else 100)
        res = kernel_overhead(a, exe)
        if a.json:
            print(json.dumps(res, indent=2))
        return
    if a.signed_events:
        signed = signed_scale(a.signed_events, a.writers, exe)
        if a.json:
            print(json.dumps(signed, indent=2))
        if a.signed_only:
            return
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-ledger-") as store:
        n_events, build_s = build(store, a.steps, a.audit_every, a.ckpt_every)
        size = du(os.path.join(store, "_ledger"))
        inproc = timed(lambda: certify_store(store, write_certificates=False), a.trials)
        st = certify_store(store, write_certificates=False)
        status_proc = timed(
            lambda: subprocess.run([exe, "status", store, "--json"], capture_output=True, check=True), a.trials
        )
        lg_proc = timed(
            lambda: subprocess.run([exe, "latest-good", store, "--no-verify"], capture_output=True, check=True),
            a.trials,
        )
        first_cert = timed(lambda: certify_store(store, write_certificates=True), 1)[0]
    res = {
        "steps": a.steps,
        "audit_every": a.audit_every,
        "ckpt_every": a.ckpt_every,
        "checkpoints": len(st.snapshot.checkpoints),
        "events": n_events,
        "segments": st.snapshot.segments,
        "ledger_bytes": size,
        "build_seconds": build_s,
        "certify_in_process_s": statistics.median(inproc),
        "status_process_s": statistics.median(status_proc),
        "latest_good_process_s": statistics.median(lg_proc),
        "first_certificates_s": first_cert,
        "latest_good": st.certification.latest_good,
        "suspect": sum(not v.trusted for v in st.certification.verdicts.values()),
    }
    print(
        f"ledger scale: {a.steps:,} steps, full audit every {a.audit_every}, checkpoint every {a.ckpt_every} "
        f"({res['checkpoints']} checkpoints, {n_events:,} events in {res['segments']} segments; "
        f"built in {build_s:.1f} s)"
    )
    print(
        f"  ledger size                        {size / 1e6:8.1f} MB   target < 100 MB   "
        f"{'PASS' if size < 100e6 else 'MISS'}"
    )
    print(
        f"  certify (read + verdicts), in-proc {res['certify_in_process_s']:8.3f} s    target < 2 s      "
        f"{'PASS' if res['certify_in_process_s'] < 2 else 'MISS'}"
    )
    print(
        f"  certckpt status --json (process)   {res['status_process_s']:8.3f} s    target < 2 s      "
        f"{'PASS' if res['status_process_s'] < 2 else 'MISS'}"
    )
    print(f"  certckpt latest-good --no-verify   {res['latest_good_process_s']:8.3f} s")
    print(
        f"  first certify writing {res['checkpoints']} certificates {first_cert:.2f} s "
        "(once; later runs write only changes)"
    )
    print(f"  verdicts: latest-good {res['latest_good']}, {res['suspect']} suspect (one injected detection)")
    if a.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
