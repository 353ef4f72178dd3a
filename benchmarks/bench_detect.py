#!/usr/bin/env python
"""Benchmark the detection auditor's overhead: plain DDP vs DDP driven by ``certckpt.detect.Auditor``.

Run from the repository root:

    python benchmarks/bench_detect.py            # ~9.4M-parameter MLP, 7 trials of 100 steps (~7 min on 2 cores)
    python benchmarks/bench_detect.py --quick    # ~2.4M-parameter MLP, 2 trials of 100 steps (smoke run)
    python benchmarks/bench_detect.py --json     # also print every figure and raw sample as JSON
    python benchmarks/bench_detect.py --micro 4  # gradient accumulation: 4 micro-batches per optimizer step
    python benchmarks/bench_detect.py --micro 4 --replay-micro-batches 1   # audits replay 1 of the 4

One job of 3 gloo ranks on this machine's CPUs (``certckpt.detect.launch.run_ranks``), one torch
thread per rank, ``torch.use_deterministic_algorithms(True)``. Every rank builds, once, five
DDP copies of the same MLP (identical initialisation), each with its own SGD optimizer:

    plain       DDP with its default communication hook; zero_grad, loss, backward, step
    audit/10    Auditor(audit_every=10): non-finite check every step; replay + consensus every 10th
    audit/100   Auditor(audit_every=100): the same, one full audit per 100 steps
    nonfinite   Auditor(audit_every=10**9): the non-finite check alone (no replay, no consensus)
    audit/10 sentinels off
                audit/10 with AuditOptions(triggers=Triggers(enabled=False)): against audit/10 (sentinels
                on, the default), the cost of the per-step sentinels (their sums of squares and the
                one small all-gather per step that carries them with the flags), goal <= 1.01x
    plain/view  reference, no target: plain DDP with gradient_as_bucket_view=True. With
                zero_grad(set_to_none=True) DDP still copies each fresh gradient into its bucket,
                but not the reduced bucket back into .grad: the same copies as the auditor, which
                hands .grad its view of the reduced bucket. Against this line the auditor's ratios
                are what its checks cost, with no copy saved on either side.

With ``--micro N`` (N > 1) every configuration runs the accumulation loop shape instead: each
optimizer step takes N micro-batches, plain DDP as its users write it (``loss / N`` backward per
micro-batch, all but the last under ``no_sync``) and the auditor through
``train_step(micro_batches=[...])``; a step's time is that of all N forward and backward passes, so
the targets compare each auditor configuration against the same loop shape in plain DDP.

Each configuration takes its untimed warm-up steps first (the Auditor's first step also runs its
one-off determinism check there). Then, in every trial, each configuration runs the same number of
steps (a multiple of 100, so that each trial of audit/100 holds exactly one audit and audit/10
exactly one per 10 steps: the audit counts are recorded and printed, not assumed), in slices of
``--slice`` steps (default 10) interleaved with the other configurations' slices in an order that
rotates every slice, so that they share the machine's noise (``--slice 100``: one block per
configuration per trial). A timed slice is: barrier, ``perf_counter``, the steps, barrier,
``perf_counter``; the figure is rank 0's wall time for a trial's slices divided by their steps.
Batches (32 x 1024 ``randn``, MSE loss against a seeded random target, different on every rank and
at every step, the same for every configuration) are generated before each block, untimed.

A last phase shows where the extra time goes. Single steps, each between two barriers, interleaved
step by step: audit/10 (audit and non-audit steps), plain DDP, and a fifth DDP copy with torch's own
Python ``allreduce_hook`` (the price of any Python comm hook). During these steps the auditor's
parts are timed in place through ``certckpt.detect.timing``: the library marks them itself (the
training signatures, the flag sums and their read, the ring shift, the replay and its signatures,
the replay audit, the weight consensus), and a ``timing.record()`` block in the rank processes
turns the marks on; nothing is replaced, and a part with no recorded call stops the run (a refactor
that drops a mark cannot leave a silent zero). Then ``auditor.weight_consensus(step)``,
``signature()`` over all gradients and two flag sums are called alone between barriers, a few times
each.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a toy MLP, one trial of 20 steps, one audit
step timed alone: every code path in seconds, figures meaningless.

Nothing here is hard-coded: every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from certckpt.detect.timing import PARTS

HERE = os.path.dirname(os.path.abspath(__file__))

WORLD = 3
CONFIGS = ("plain", "audit/10", "audit/100", "nonfinite", "audit/10 sentinels off", "plain/view")
AUDIT_EVERY = {"audit/10": 10, "audit/100": 100, "nonfinite": 10**9, "audit/10 sentinels off": 10}
NO_SENTINELS = "audit/10 sentinels off"
SENTINEL_GOAL = 1.01  # audit/10 (sentinels on) over audit/10 with them off, at most
LABELS = {
    "plain": "plain DDP (default hook)",
    "audit/10": "Auditor, full audit every 10 steps",
    "audit/100": "Auditor, full audit every 100 steps",
    "nonfinite": "Auditor, non-finite check alone",
    NO_SENTINELS: "Auditor, audit every 10 steps, sentinels off",
    "plain/view": "reference: plain DDP, gradient_as_bucket_view",
}


def configs_for(bucket_view: bool) -> tuple[str, ...]:
    """The configurations of one run (with --bucket-view, plain is already the no-copy reference)."""
    return tuple(c for c in CONFIGS if not (bucket_view and c == "plain/view"))


TARGETS = {"audit/10": 1.10, "audit/100": 1.02, "nonfinite": 1.02}  # ratio to plain DDP, at most

# the certckpt.detect.timing parts every audit step, and every other step, must record
AUDIT_PARTS = tuple(p for p in PARTS if p != "update_audit")  # (the optimizer-step replay: FSDP2 only)
NONAUDIT_PARTS = ("nonfinite_flags", "nonfinite_check")

FULL = {"widths": [1024, 2048, 2048, 1024, 1024], "batch": 32, "trials": 7, "steps": 100, "warmup": 10, "reps": 5}
QUICK = {"widths": [512, 1024, 1024, 512, 512], "batch": 32, "trials": 2, "steps": 100, "warmup": 10, "reps": 2}
# CERTCKPT_BENCH_TINY=1 (benchmarks/tinymode.py): every code path in seconds, figures meaningless
# (20 steps a trial: audit/100 audits in none of them, which only tiny mode allows)
TINY = {"widths": [32, 64, 64, 32, 32], "batch": 4, "trials": 1, "steps": 20, "warmup": 2, "reps": 1, "slice": 10}


# --------------------------------------------------------------------------------------------------
# the per-rank side (imported by the rank processes through run_ranks(extra_path=HERE))


def _mlp(widths: list[int], seed: int):
    import torch

    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.GELU())
    return torch.nn.Sequential(*layers)


def n_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def _batch(rank: int, step: int, batch: int, widths: list[int]):
    import torch

    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return torch.randn(batch, widths[0], generator=g), torch.randn(batch, widths[-1], generator=g)


def _loss(model, batch):
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


def _item(rank: int, step: int, batch: int, widths: list[int], micro: int):
    """One optimizer step's input: a batch, or a list of ``micro`` micro-batches."""
    if micro <= 1:
        return _batch(rank, step, batch, widths)
    return [_batch(rank, step * 1000 + k, batch, widths) for k in range(micro)]


def _plain_runner(ddp, opt, micro: int):
    """A plain DDP optimizer step, with accumulation under no_sync when ``micro`` > 1."""
    import contextlib

    def step(item):
        opt.zero_grad(set_to_none=True)
        if micro <= 1:
            loss = _loss(ddp, item)
            loss.backward()
        else:
            total = 0.0
            for k, mb in enumerate(item):
                with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    loss = _loss(ddp, mb) / micro
                    loss.backward()
                total = total + loss.detach()
            loss = total
        opt.step()
        return loss.detach()

    return step


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.detect import Triggers, timing
    from certckpt.detect.auditor import Auditor, nonfinite_flag
    from certckpt.detect.launch import ProgressLog
    from certckpt.detect.signature import signature

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    bucket_view = bool(args.get("bucket_view"))
    configs = configs_for(bucket_view)
    widths, bsz = args["widths"], args["batch"]
    micro = int(args.get("micro") or 1)
    t_start = time.perf_counter()
    log = ProgressLog(args.get("progress"), rank=rank)

    # --- one DDP model + optimizer per configuration, all built up front ---------------------------
    runners: dict[str, Any] = {}
    auditors: dict[str, Auditor] = {}
    steps_done: dict[str, int] = {}
    models: dict[str, Any] = {}
    for name in configs:
        model = _mlp(widths, seed=0)  # identical init on every rank and for every configuration
        ddp = DDP(model, gradient_as_bucket_view=bucket_view or name == "plain/view")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        models[name] = (ddp, opt)
        steps_done[name] = 0
        if name.startswith("plain"):
            runners[name] = _plain_runner(ddp, opt, micro)
        else:
            aud = Auditor(
                ddp,
                opt,
                loss_fn=_loss,
                run=f"bench-{name}",
                audit_every=AUDIT_EVERY[name],
                replay_micro_batches=args.get("replay_micro_batches"),
                triggers=Triggers(enabled=name != NO_SENTINELS),
            )
            auditors[name] = aud
            runners[name] = aud.train_step if micro <= 1 else (lambda item, a=aud: a.train_step(micro_batches=item))
    log(
        f"built {len(configs)} DDP models of "
        f"{sum(p.numel() for p in models['plain'][0].module.parameters()):,} parameters"
    )

    def batches_for(name: str, n: int) -> list:
        first = steps_done[name] + 1
        return [_item(rank, s, bsz, widths, micro) for s in range(first, first + n)]

    def timed_block(name: str, n: int) -> dict[str, Any]:
        batches = batches_for(name, n)
        aud = auditors.get(name)
        audits = 0
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for b in batches:
            runners[name](b)
            if aud is not None and aud.last.audited:
                audits += 1
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps_done[name] += n
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "steps": n,
            "audits": audits,
            "first_step": steps_done[name] - n + 1,
            "last_step": steps_done[name],
        }

    # --- warm-up (discarded) -------------------------------------------------------------------
    warmup = {}
    for name in configs:
        warmup[name] = timed_block(name, args["warmup"])
    log("warm-up done: " + ", ".join(f"{n} {w['wall_s'] / w['steps'] * 1e3:.0f} ms/step" for n, w in warmup.items()))

    # --- interleaved trials --------------------------------------------------------------------
    trials: list[dict[str, Any]] = []
    slice_n = args["slice"]
    for t in range(args["trials"]):
        k = t % len(configs)
        order = list(configs[k:] + configs[:k])
        # Each configuration's steps for this trial, run as slices of `slice_n` steps interleaved
        # with the other configurations' (the order rotating every slice), so that all of them
        # sample the same stretch of the machine's noise; a slice's figures add up into the block.
        blocks = {
            name: {"wall_s": 0.0, "cpu_s": 0.0, "steps": 0, "audits": 0, "first_step": steps_done[name] + 1}
            for name in configs
        }
        for j in range(args["steps"] // slice_n):
            r = j % len(order)
            for name in order[r:] + order[:r]:
                piece = timed_block(name, slice_n)
                for key in ("wall_s", "cpu_s", "steps", "audits"):
                    blocks[name][key] += piece[key]
        for name in configs:
            blocks[name]["last_step"] = steps_done[name]
        trials.append({"order": order, "blocks": blocks})
        log(
            f"trial {t + 1}/{args['trials']}: "
            + ", ".join(f"{n} {blocks[n]['wall_s'] / blocks[n]['steps'] * 1e3:.1f}" for n in configs)
            + " ms/step"
        )

    # --- breakdown of audit/10 ----------------------------------------------------------------
    # Single steps, each between two barriers, interleaved step by step: audit/10 (its parts timed in
    # place, see below), plain DDP, and DDP with torch's own Python allreduce_hook (the cost of any
    # Python comm hook, without the non-finite flags).
    reps = args["reps"]

    def between_barriers(fn) -> tuple[float, float]:
        """(wall s, this process's CPU s) of ``fn`` between two barriers."""
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, time.process_time() - c0

    bd_cpu: dict[str, list[float]] = {}

    def record(key: str, fn) -> float:
        wall, cpu = between_barriers(fn)
        bd[key].append(wall)
        bd_cpu.setdefault(key, []).append(cpu)
        return wall

    bd: dict[str, list[float]] = {
        k: []
        for k in (
            "barrier_only",
            "plain_step",
            "torch_hook_step",
            "nonaudit_step",
            "audit_step",
            "consensus",
            "signature_all_grads",
            "nonfinite_flags_x2",
        )
    }
    aud = auditors["audit/10"]
    hooked = DDP(_mlp(widths, seed=0))
    hooked.register_comm_hook(None, allreduce_hook)
    hooked_opt = torch.optim.SGD(hooked.module.parameters(), lr=1e-3, momentum=0.9)
    hooked_step = _plain_runner(hooked, hooked_opt, micro)

    for i in range(3):  # warm-up of the extra model (untimed)
        hooked_step(_item(rank, i + 1, bsz, widths, micro))

    # In-situ timers: the auditor's parts are marked in the library itself (certckpt.detect.timing:
    # a no-op unless a recording is open), so this reads them without replacing anything; a part the
    # library no longer marks shows up as missing below instead of as a silent zero.
    parts: dict[str, list[dict[str, float]]] = {"audit": [], "nonaudit": []}
    calls: dict[str, dict[str, int]] = {"audit": {}, "nonaudit": {}}
    plain_b, hooked_b = 10**6, 10**6  # their own batch streams for these steps
    with timing.record() as rec:
        while len(bd["audit_step"]) < reps:
            s = steps_done["audit/10"] + 1
            b = batches_for("audit/10", 1)[0]
            rec.clear()
            dt, dc = between_barriers(lambda b=b: runners["audit/10"](b))
            steps_done["audit/10"] += 1
            kind = "audit" if aud.last.audited else "nonaudit"
            assert aud.last.audited == (s % 10 == 0)
            bd[f"{kind}_step"].append(dt)
            bd_cpu.setdefault(f"{kind}_step", []).append(dc)
            parts[kind].append({**rec.seconds, "step": dt})
            for k, n in rec.calls.items():
                calls[kind][k] = calls[kind].get(k, 0) + n
            plain_b += 1
            pb = _item(rank, plain_b, bsz, widths, micro)
            record("plain_step", lambda pb=pb: runners["plain"](pb))
            hooked_b += 1
            hb = _item(rank, hooked_b, bsz, widths, micro)
            record("torch_hook_step", lambda hb=hb: hooked_step(hb))
    # the sentinels are off where no triggered replay could run (--bucket-view: no hand-over)
    sent = ("sentinels",) if aud.sentinels.active else ()
    audit_parts = tuple(p for p in AUDIT_PARTS if p != "sentinels" or sent)
    expected = {"audit": audit_parts, "nonaudit": NONAUDIT_PARTS + sent}
    missing = {kind: [k for k in want if not calls[kind].get(k)] for kind, want in expected.items()}
    if any(missing.values()):
        raise RuntimeError(
            "certckpt.detect.timing recorded no call of these parts (did a refactor drop their marks?): "
            + "; ".join(f"{kind} steps: {', '.join(ks)}" for kind, ks in missing.items() if ks)
        )
    log(f"breakdown: {len(bd['audit_step'])} audit and {len(bd['nonaudit_step'])} non-audit steps timed one by one")

    # Parts timed alone between barriers (every rank doing the same work at the same time).
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in aud.params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    for _ in range(reps):
        record("barrier_only", lambda: None)
        record("consensus", lambda: aud.weight_consensus(aud.step))
        record("signature_all_grads", lambda: signature(grads, mode="deterministic"))
        record("nonfinite_flags_x2", lambda: (nonfinite_flag(flat), nonfinite_flag(flat)))
    log("breakdown done")

    buckets = len(aud._hook.post)  # one post-reduce flag per DDP bucket: the comm hook ran this many times
    log.close()
    return {
        "rank": rank,
        "configs": list(configs),
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "params": sum(p.numel() for p in models["plain"][0].module.parameters()),
        "ddp_buckets": buckets,
        "warmup": warmup,
        "trials": trials,
        "breakdown": bd,
        "breakdown_cpu": bd_cpu,
        # the auditors' bookkeeping at the end (it is never trimmed without audits or checkpoints)
        "bookkeeping": {
            n: {
                "since_audit": getattr(a, "_checked_since_audit", 0),
                "events_since_checkpoint": len(a.state.lineage),
                "sink_events": len(a.sink.events),
            }
            for n, a in auditors.items()
        },
        "parts": parts,
        "events": {n: len(a.sink.events) for n, a in auditors.items()},
        # every step these auditors ran is a clean step: each triggered replay is a false trigger
        "sentinels": {
            n: {
                "on": a.sentinels.active,
                "steps": steps_done[n],
                "triggered": a.state.triggered_replays,
                "suppressed": a.state.triggers_suppressed,
                "failures": sum(e.failed for e in a.sink.events),
            }
            for n, a in auditors.items()
        },
        "rank_elapsed_s": time.perf_counter() - t_start,
    }


# --------------------------------------------------------------------------------------------------
# the driver


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    configs = r0["configs"]
    ms = {n: [tr["blocks"][n]["wall_s"] / tr["blocks"][n]["steps"] * 1e3 for tr in r0["trials"]] for n in configs}
    cpu = {
        n: [
            sum(pr["trials"][i]["blocks"][n]["cpu_s"] for pr in per_rank) / r0["trials"][i]["blocks"][n]["steps"] * 1e3
            for i in range(len(r0["trials"]))
        ]
        for n in configs
    }
    out: dict[str, Any] = {"step_ms": ms, "cpu_ms_per_step_all_ranks": cpu, "configs": {}}
    base = median(ms["plain"])
    for n in configs:
        paired = [a / p for a, p in zip(ms[n], ms["plain"])]
        out["configs"][n] = {
            "median_ms": median(ms[n]),
            "min_ms": min(ms[n]),
            "max_ms": max(ms[n]),
            "ratio": median(ms[n]) / base,
            "paired_ratio_median": median(paired),
            "paired_ratio_min": min(paired),
            "paired_ratio_max": max(paired),
            "cpu_ms_median": median(cpu[n]),
            "audits_per_trial": sorted({tr["blocks"][n]["audits"] for tr in r0["trials"]}),
            "verdict": None if n not in TARGETS else ("PASS" if median(ms[n]) / base <= TARGETS[n] else "MISS"),
        }
    bd = {
        k: {
            "median_ms": median(v) * 1e3,
            "min_ms": min(v) * 1e3,
            "max_ms": max(v) * 1e3,
            "n": len(v),
            "cpu_median_ms": median(r0["breakdown_cpu"][k]) * 1e3,
        }
        for k, v in r0["breakdown"].items()
        if v
    }
    out["breakdown"] = bd
    # in-situ parts of rank 0's audit steps, per step (ms), medians across the timed audit steps
    insitu: dict[str, dict[str, float]] = {}
    for kind, steps in r0["parts"].items():
        keys = sorted({k for st in steps for k in st})
        insitu[kind] = {k: median([st.get(k, 0.0) for st in steps]) * 1e3 for k in keys}
        insitu[kind]["n"] = len(steps)
    a = insitu["audit"]
    derived = {
        "training signatures (in the comm hook)": a.get("train_signature", 0.0),
        "ring shift of batch + RNG state (overlapped; what is not hidden)": a.get("ring_shift", 0.0),
        "replay forward + backward": a.get("replay", 0.0) - a.get("replay_signature", 0.0),
        "replay signature": a.get("replay_signature", 0.0),
        "signature all-gather + compare + event": a.get("replay_audit", 0.0) - a.get("replay", 0.0),
        "weight consensus (incl. its all-gather)": a.get("consensus", 0.0),
    }
    out["insitu"] = insitu
    out["insitu_audit_parts"] = derived
    if NO_SENTINELS in configs:
        paired = [a / b for a, b in zip(ms["audit/10"], ms[NO_SENTINELS])]
        ratio = median(ms["audit/10"]) / median(ms[NO_SENTINELS])
        on = [v for v in r0["sentinels"].values() if v["on"]]
        steps, triggered = sum(v["steps"] for v in on), sum(v["triggered"] for v in on)
        out["sentinels"] = {
            "ratio": ratio,
            "paired_ratio_median": median(paired),
            "paired_ratio_min": min(paired),
            "paired_ratio_max": max(paired),
            "verdict": "PASS" if ratio <= SENTINEL_GOAL else "MISS",
            "clean_steps": steps,
            "triggered": triggered,
            "suppressed": sum(v["suppressed"] for v in on),
            "failures": sum(v["failures"] for v in on),
            "per_1000_steps": triggered / steps * 1000 if steps else None,
            "on": bool(on),
        }
    return out


def print_report(R: dict[str, Any]) -> None:
    c, S = R["config"], R["summary"]
    print()
    print(
        f"certckpt detection-overhead benchmark ({c['mode']}): "
        f"{c['trials']} interleaved trials "
        f"x {c['steps']} steps per configuration, {c['warmup']} warm-up steps each (discarded)"
    )
    cores = (
        "OVERSUBSCRIBED (ranks and gloo threads share cores), expected here"
        if (c["cpus"] or 0) < WORLD
        else "one core per rank"
    )
    print(
        f"torch {c['torch']}, python {c['python']}, {c['cpus']} CPUs; "
        f"{WORLD} gloo ranks x {c['rank_threads']} torch thread"
        f" on {c['cpus']} cores: {cores}"
    )
    print(
        f"deterministic algorithms: {c['deterministic']}; load average {c['loadavg_start']} at start, "
        f"{c['loadavg_end']} at end (1/5/15 min)"
    )
    ob, oc = c.get("others_busy_cores_before"), c.get("others_cpu_s_during_run")
    if ob is not None and oc is not None:
        print(
            f"CPU used outside this benchmark: {ob:.2f} cores just before it; "
            f"{oc:.1f} CPU-s during its {R['elapsed_s']:.0f} s"
        )
    print(
        f"model: MLP {'-'.join(map(str, c['widths']))} (GELU between Linears), {c['params']:,} parameters "
        f"({c['params'] * 4 / 2**20:.1f} MiB float32, "
        f"{c['ddp_buckets'] if c['ddp_buckets'] is not None else '?'} DDP buckets); "
        f"batch {c['batch']} x {c['widths'][0]} per rank, MSE; SGD momentum 0.9"
        + ("; gradient_as_bucket_view=True on every DDP copy" if c.get("bucket_view") else "")
        + (
            f"; accumulation: {c['micro']} micro-batches per optimizer step (no_sync / micro_batches=)"
            + (
                f", audits replay {c['replay_micro_batches']} of them"
                if c.get("replay_micro_batches")
                else ", audits replay all"
            )
            if c.get("micro", 1) > 1
            else ""
        )
    )
    print(
        f"figure: rank 0's wall time over a trial's interleaved slices of {c['slice']} steps "
        "(each barrier to barrier) / steps; median across trials [min-max]"
    )
    print()
    head = (
        "configuration",
        "ms/step median [min-max]",
        "ratio to plain",
        "target",
        "",
        "paired ratio med [min-max]",
        "audits/trial",
        "CPU ms/step (3 ranks)",
    )
    rows = []
    for n in S["configs"]:
        s = S["configs"][n]
        rows.append(
            (
                LABELS[n],
                f"{s['median_ms']:.1f} [{s['min_ms']:.1f}-{s['max_ms']:.1f}]",
                f"{s['ratio']:.3f}x",
                f"≤ {TARGETS[n]:.2f}x" if n in TARGETS else "",
                s["verdict"] or "",
                ""
                if n == "plain"
                else f"{s['paired_ratio_median']:.3f} [{s['paired_ratio_min']:.3f}-{s['paired_ratio_max']:.3f}]",
                "-" if n.startswith("plain") else ",".join(map(str, s["audits_per_trial"])),
                f"{s['cpu_ms_median']:.1f}",
            )
        )
    w = [max(len(r[i]) for r in [*rows, head]) for i in range(len(head))]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)).rstrip())
    print("  ".join("-" * x for x in w))
    for r in rows:
        print("  ".join(x.ljust(w[i]) for i, x in enumerate(r)).rstrip())

    bd = S["breakdown"]
    m = {k: v["median_ms"] for k, v in bd.items()}
    ins, parts = S["insitu"], S["insitu_audit_parts"]

    def line(label: str, key: str, note: str = "") -> None:
        v = bd[key]
        cell = f"{v['median_ms']:8.2f}  [{v['min_ms']:.2f}-{v['max_ms']:.2f}]"
        print(f"   {label:<50} {cell:<26} {v['cpu_median_ms']:7.2f}   {note}".rstrip())

    print()
    print(
        "Where the extra time goes: rank 0, single steps, each between two barriers, the three models interleaved step"
    )
    print(
        f"by step ({bd['plain_step']['n']} plain, {bd['nonaudit_step']['n']} non-audit and "
        f"{bd['audit_step']['n']} audit steps);"
        " ms, median [min-max], and rank 0's process CPU ms (all its threads)"
    )
    print(f"   {'':<50} {'wall':<26} {'CPU':>7}")
    line("plain DDP step (default hook)", "plain_step")
    line(
        "DDP + torch's Python allreduce_hook",
        "torch_hook_step",
        f"{m['torch_hook_step'] - m['plain_step']:+.2f} wall vs plain: any Python comm hook (unfused division)",
    )
    line(
        "audit/10, non-audit step",
        "nonaudit_step",
        f"{m['nonaudit_step'] - m['plain_step']:+.2f} wall vs plain; in situ: flag sums "
        f"{ins['nonaudit'].get('nonfinite_flags', 0.0):.2f}, "
        f"flag read {ins['nonaudit'].get('nonfinite_check', 0.0):.2f}",
    )
    line("audit/10, audit step", "audit_step", f"{m['audit_step'] - m['nonaudit_step']:+.2f} wall vs non-audit step")
    extra = m["audit_step"] - m["nonaudit_step"]
    print(
        "   inside the audit steps (rank 0's clock around the parts certckpt.detect.timing marks, "
        "median per audit step;"
    )
    print("   the collective ones include waiting for the other ranks):")
    total = 0.0
    for label, v in parts.items():
        total += v
        share = f"{v / extra * 100:5.0f}% of the extra" if extra > 0 else ""
        print(f"     {label:<48} {v:8.2f}   {share}")
    print(
        f"     {'sum':<48} {total:8.2f}   (measured extra {extra:.2f}; "
        f"that step's flag sums {ins['audit'].get('nonfinite_flags', 0.0):.2f}, "
        f"flag read {ins['audit'].get('nonfinite_check', 0.0):.2f})"
    )
    print(f"   alone between two barriers, every rank doing the same (median of {bd['consensus']['n']}):")
    line("  bare barrier pair", "barrier_only")
    line("  auditor.weight_consensus(step), called directly", "consensus")
    line("  signature() over all gradients", "signature_all_grads")
    line("  2 non-finite flag sums over all gradients", "nonfinite_flags_x2")
    rk = sorted(((v, k) for k, v in parts.items()), reverse=True)
    hook_cost = m["nonaudit_step"] - m["plain_step"]
    print(f"   dominant part of an audit: {rk[0][1]} ({rk[0][0]:.1f} ms), then {rk[1][1]} ({rk[1][0]:.1f} ms)")
    print(
        "   predicted from these single steps: audit/10 "
        f"{(m['plain_step'] + hook_cost + extra / 10) / m['plain_step']:.3f}x"
        f" (hook {hook_cost / m['plain_step'] * 100:+.1f}% + audits {extra / 10 / m['plain_step'] * 100:+.1f}%),"
        f" audit/100 {(m['plain_step'] + hook_cost + extra / 100) / m['plain_step']:.3f}x,"
        f" non-finite alone {(m['plain_step'] + hook_cost) / m['plain_step']:.3f}x"
    )
    replay_ms = parts["replay forward + backward"]
    base = S["configs"]["plain"]["median_ms"]
    print(
        f"   replay floor (the replay's forward + backward / K / plain step, no implementation of a full replay"
        f" goes below it): K=10 {replay_ms / 10 / base * 100:.1f}%, K=100 {replay_ms / 100 / base * 100:.2f}%"
    )
    bk = R["per_rank"][0]["bookkeeping"]
    print(
        "   info, auditor bookkeeping on rank 0 at the end "
        "(steps since the last audit, lineage entries since the last checkpoint, sink): "
        + "; ".join(
            f"{n}: {v['since_audit']}, {v['events_since_checkpoint']}, {v['sink_events']}" for n, v in bk.items()
        )
    )

    sn = S.get("sentinels")
    if sn is not None:
        print()
        print(
            f"Sentinels: audit/10 with them on (the default) vs off, same loop, interleaved: {sn['ratio']:.4f}x"
            f" (goal <= {SENTINEL_GOAL:.2f}x: {sn['verdict']}; paired per trial {sn['paired_ratio_median']:.4f}"
            f" [{sn['paired_ratio_min']:.4f}-{sn['paired_ratio_max']:.4f}])"
            + ("" if sn["on"] else " -- the sentinels were off in every auditor (--bucket-view: no hand-over)")
        )
        rate = "-" if sn["per_1000_steps"] is None else f"{sn['per_1000_steps']:.1f}"
        print(
            f"   false triggers on these clean runs: {sn['triggered']} triggered replay(s) in {sn['clean_steps']}"
            f" steps with sentinels on ({rate} per 1,000 steps), {sn['suppressed']} held back by the rate limit,"
            f" {sn['failures']} detection(s)"
        )

    misses = [n for n in TARGETS if S["configs"][n]["verdict"] != "PASS"]
    print()
    print(
        f"{len(misses)} target(s) missed"
        + (": " + ", ".join(misses) if misses else "")
        + f"; total {R['elapsed_s']:.0f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~2.4M-parameter MLP, 2 trials: a smoke run")
    ap.add_argument("--json", action="store_true", help="also print all results as JSON")
    ap.add_argument("--trials", type=int, default=None, help="interleaved trials (default 7, quick 2)")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per configuration per trial, a multiple of 100 (default 100)"
    )
    ap.add_argument(
        "--slice",
        type=int,
        default=None,
        help="steps per interleaved slice, dividing --steps (default 10; 100: one block per configuration per trial)",
    )
    ap.add_argument(
        "--bucket-view",
        action="store_true",
        help="every DDP copy with gradient_as_bucket_view=True (no gradient copies on either side)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="micro-batch rows per rank (default 32); larger batches give the compute-heavier steps of real training",
    )
    ap.add_argument(
        "--micro",
        type=int,
        default=1,
        help="micro-batches per optimizer step (default 1; 4: the accumulation loop shape, no_sync in plain DDP,"
        " train_step(micro_batches=...) in the auditor)",
    )
    ap.add_argument(
        "--replay-micro-batches",
        type=int,
        default=None,
        help="with --micro: Auditor(replay_micro_batches=K), an audit replays K of the step's micro-batches"
        " (default: all)",
    )
    args = ap.parse_args()

    from rankbench import Machine, progress_tail
    from tinymode import announce

    tiny = announce("bench_detect")
    P = dict(TINY if tiny else QUICK if args.quick else FULL)
    if args.trials is not None:
        P["trials"] = args.trials
    if args.steps is not None:
        P["steps"] = args.steps
    if args.batch is not None:
        P["batch"] = args.batch
    if args.slice is not None:
        P["slice"] = args.slice
    P.setdefault("slice", 10)
    P["bucket_view"] = args.bucket_view
    P["micro"] = args.micro
    P["replay_micro_batches"] = args.replay_micro_batches
    if args.micro < 1:
        ap.error("--micro must be >= 1")
    if P["slice"] < 1 or P["steps"] % P["slice"]:
        ap.error("--slice must divide --steps")
    if P["steps"] % 100 and not tiny:
        ap.error(
            "--steps must be a multiple of 100 (each trial of audit/100 must hold exactly one audit per 100 steps)"
        )
    if P["trials"] < 7 and not (args.quick or tiny):
        print(f"note: {P['trials']} trials (fewer than 7)", file=sys.stderr)

    from certckpt.detect.launch import run_ranks

    machine = Machine(tiny=tiny)
    common = machine.start()
    R: dict[str, Any] = {
        "config": {
            "quick": args.quick,
            "mode": "tiny" if tiny else "quick" if args.quick else "full",
            **P,
            "params": n_params(P["widths"]),
            "world": WORLD,
            "rank_threads": 1,
            **common,
        }
    }
    t0 = time.perf_counter()
    import tempfile

    banner = (
        f"running {WORLD} ranks: {P['trials']} trials x {len(configs_for(args.bucket_view))} configurations "
        f"x {P['steps']} steps of a {n_params(P['widths']):,}-parameter MLP"
    )
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-detect-") as d, progress_tail(d, banner) as prog:
        per_rank = run_ranks(
            f"{os.path.splitext(os.path.basename(__file__))[0]}:rank_main",
            WORLD,
            {**P, "progress": prog},
            timeout=1800,
            threads=1,
            extra_path=HERE,
        )
    R["elapsed_s"] = time.perf_counter() - t0
    R["config"].update(machine.end())
    R["config"]["params"] = per_rank[0]["params"]
    R["config"]["ddp_buckets"] = per_rank[0]["ddp_buckets"]
    R["config"]["deterministic"] = all(pr["deterministic"] for pr in per_rank)
    R["config"]["rank_threads"] = per_rank[0]["torch_threads"]
    R["summary"] = summarise(per_rank)
    R["per_rank"] = per_rank
    print_report(R)
    if args.json:
        print()
        print(json.dumps(R, indent=2))


if __name__ == "__main__":
    main()
