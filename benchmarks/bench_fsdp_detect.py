#!/usr/bin/env python
"""Benchmark the detection overhead under FSDP2: plain FSDP2 vs FSDP2 driven by ``ShardedAuditSession``.

Run from the repository root:

    python benchmarks/bench_fsdp_detect.py            # ~7.9M-parameter MLP, 2 x 2 HSDP, 2 trials x 100 steps (~5.5 min)
    python benchmarks/bench_fsdp_detect.py --quick    # ~2.0M-parameter MLP, 1 trial of 100 steps (smoke run, ~1 min)
    python benchmarks/bench_fsdp_detect.py --json     # also print every figure and raw sample as JSON
    python benchmarks/bench_fsdp_detect.py --mesh 4   # 1-D FSDP over the 4 ranks instead of 2 x 2 HSDP
    python benchmarks/bench_fsdp_detect.py --micro 4  # gradient accumulation: 4 micro-batches per step

One job of 4 gloo ranks on this machine's CPUs (``certckpt.detect.launch.run_ranks``), one torch
thread per rank, ``torch.use_deterministic_algorithms(True)``. Mesh: 2 x 2 HSDP
(``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``), or with ``--mesh 4``
1-D FSDP. Every rank builds, once, four copies of the same MLP (identical initialisation), every
Linear ``fully_shard``-ed and then the root, each copy with its own optimizer (AdamW, or ``--opt sgd``):

    plain         plain FSDP2: forward, loss.backward(), opt.step(), opt.zero_grad(set_to_none=True)
    consensus/10  ShardedAuditSession(consensus_every=10), no loss_fn: the non-finite check of the
                  reduced gradient shards every step, the weight consensus across replicas every 10th
    audit/10      ShardedAuditSession(loss_fn=..., audit_every=10) (the consensus at audits only): the loop
                  calls begin_micro_batch(unit) before each forward; a full audit (ring replay,
                  non-finite, consensus) every 10th step, the non-finite check on the others
    audit/100     the same with audit_every=100
    audit/10 sentinels off
                  audit/10 with triggers=Triggers(enabled=False): against audit/10 (sentinels on, the
                  default), the cost of the per-step sentinels (a sum of squares of each layer's
                  local gradient at its reduce-scatter, the RNG state kept per micro-batch, float
                  rows instead of two int flags in the non-finite all-gather); the triggered replays
                  the sessions with sentinels ran are counted (each is a false trigger: nothing is
                  injected)

Events go to an in-memory ``MemorySink`` (no ledger). With ``--micro N`` (N > 1) every configuration
takes N micro-batches per optimizer step, ``set_requires_gradient_sync(k == N - 1)`` before each and
``loss / N`` backward, plain FSDP2 included, so the ratios compare the same loop shape.

Each configuration takes its untimed warm-up steps first (the session's first step runs its one-off
replay check there). Then, in every trial, each configuration runs the same number of steps (a
multiple of 100, so that audit/100 holds exactly one audit per trial and audit/10 one per 10 steps;
the replay audits are counted from the ``replay`` events in each session's sink, not assumed), in
slices of ``--slice`` steps (default 10) interleaved with the other configurations' slices in an
order that rotates every slice, so that they share the machine's noise. A timed slice is: barrier,
``perf_counter``, the steps, barrier, ``perf_counter``; the figure is rank 0's wall time over a
trial's slices divided by their steps. Batches (32 x widths[0] ``randn``, MSE loss against a seeded
random target, different on every rank and at every step, the same for every configuration) are
generated before each slice, untimed. The ratio to plain is the median of the per-trial ratios.

A last phase shows where the time goes: single steps, each between two barriers, interleaved step
by step (plain, consensus/10, audit/10) until a few audit steps are timed; during them the session's
parts are timed in place through ``certckpt.detect.timing`` (the library marks them itself; a
``timing.record()`` block in the rank processes turns the marks on, and a part with no recorded call
stops the run).

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a toy MLP, one trial of 10 steps, one audit
step timed alone: every code path in seconds, figures meaningless.

Targets (the issue's expectation, ratio to plain): audit/100 <= 1.05x, consensus/10 <= 1.10x. audit/10
has none; its theoretical floor is 1 + 1/10 (one more forward and backward per 10 steps, which under
FSDP cannot overlap the step: the replay all-gathers the weights, a collective). A miss is printed as
a miss. Nothing here is hard-coded: every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from certckpt.detect.timing import PARTS

HERE = os.path.dirname(os.path.abspath(__file__))

WORLD = 4
NO_SENTINELS = "audit/10 sentinels off"
CONFIGS = ("plain", "consensus/10", "audit/10", "audit/100", NO_SENTINELS)
LABELS = {
    "plain": "plain FSDP2",
    "consensus/10": "session, consensus every 10 (no replay)",
    "audit/10": "session, full audit every 10 steps",
    "audit/100": "session, full audit every 100 steps",
    NO_SENTINELS: "audit/10, sentinels off",
}
SENTINEL_GOAL = 1.01  # audit/10 (sentinels on) over audit/10 with them off, at most
TARGETS = {"consensus/10": 1.10, "audit/100": 1.05}  # ratio to plain FSDP2, at most
FLOORS = {"audit/10": 1 + 1 / 10, "audit/100": 1 + 1 / 100, NO_SENTINELS: 1 + 1 / 10}  # one more fwd + bwd per K
# the certckpt.detect.timing parts every audit step must record (with --mesh 4 also "update_audit")
# (update_audit: the optimizer-step replay, FSDP2 only)
AUDIT_PARTS = tuple(p for p in PARTS if p != "update_audit")

FULL = {"widths": [1024, 2048, 1536, 1024, 1024], "batch": 32, "trials": 2, "steps": 100, "warmup": 5, "reps": 2}
QUICK = {"widths": [512, 1024, 768, 512, 512], "batch": 32, "trials": 1, "steps": 100, "warmup": 5, "reps": 2}
# CERTCKPT_BENCH_TINY=1 (benchmarks/tinymode.py): every code path in seconds, figures meaningless
# (10 steps a trial: audit/100 audits in none of them, which only tiny mode allows)
TINY = {"widths": [32, 64, 48, 32, 32], "batch": 4, "trials": 1, "steps": 10, "warmup": 2, "reps": 1, "slice": 10}


def n_params(widths: list[int]) -> int:
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


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


def _shard(m, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in m:
        if hasattr(layer, "weight"):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _loss(model, unit):
    import torch.nn.functional as F

    x, y = unit
    return F.mse_loss(model(x), y)


def _item(rank: int, step: int, batch: int, widths: list[int], micro: int) -> list:
    """One optimizer step's micro-batches (``micro`` of them), seeded per (rank, step, micro-batch)."""
    import torch

    out = []
    for k in range(micro):
        g = torch.Generator().manual_seed(rank * 1_000_003 + step * 64 + k)
        out.append((torch.randn(batch, widths[0], generator=g), torch.randn(batch, widths[-1], generator=g)))
    return out


def _runner(model, opt, session, micro: int, replay: bool):
    """One optimizer step of the loop: plain FSDP2 when ``session`` is None."""

    def step(item: list) -> None:
        for k, unit in enumerate(item):
            if micro > 1:
                model.set_requires_gradient_sync(k == micro - 1)
            if replay:
                session.begin_micro_batch(unit)
            loss = _loss(model, unit)
            (loss / micro if micro > 1 else loss).backward()
        if session is None:
            opt.step()
        else:
            if session.before_update():
                opt.step()
            session.after_update()
        opt.zero_grad(set_to_none=True)

    return step


def _count(session, kind: str, outcome: str | None = None) -> int:
    """Events of ``kind``; ``"replay"`` counts the gradient replays, ``"update"`` the optimizer-step
    replays (``replay`` events with ``phase: update``, on meshes without replicas)."""
    if session is None:
        return 0
    phase = "update" if kind == "update" else None
    kind = "replay" if kind == "update" else kind
    return sum(
        1
        for e in session.sink.events
        if e.kind == kind
        and (outcome is None or e.outcome == outcome)
        and (kind != "replay" or e.details.get("phase") == phase)
    )


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from certckpt.detect import Triggers, timing
    from certckpt.detect.events import MemorySink
    from certckpt.detect.launch import ProgressLog
    from certckpt.detect.sharded import ShardedAuditSession

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    t_start = time.perf_counter()
    log = ProgressLog(args.get("progress"), rank=rank)
    widths, bsz, micro = args["widths"], args["batch"], int(args["micro"])
    if args["mesh"] == [2, 2]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))

    def make_opt(params):
        if args["opt"] == "sgd":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-4)

    models: dict[str, Any] = {}
    sessions: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    steps_done = dict.fromkeys(CONFIGS, 0)
    for name in CONFIGS:
        m = _shard(_mlp(widths, seed=0), mesh)  # identical init on every rank and for every configuration
        opt = make_opt(m.parameters())
        models[name] = (m, opt)
        session = None
        if name == "consensus/10":
            session = ShardedAuditSession(
                m, opt, run="bench-consensus", consensus_every=10, sink=MemorySink(), nonfinite_read=args["read"]
            )
        elif name.startswith("audit/"):
            session = ShardedAuditSession(
                m,
                opt,
                run=f"bench-{name}",
                loss_fn=_loss,
                audit_every=int(name.split("/")[1].split()[0]),
                sink=MemorySink(),
                nonfinite_read=args["read"],
                triggers=Triggers(enabled=name != NO_SENTINELS),
            )
        sessions[name] = session
        runners[name] = _runner(m, opt, session, micro, replay=name.startswith("audit/"))
    params = sum(p.numel() for p in models["plain"][0].parameters())
    log(f"built {len(CONFIGS)} FSDP2 copies of {params:,} parameters on mesh {args['mesh']}")

    def batches_for(name: str, n: int) -> list:
        first = steps_done[name] + 1
        return [_item(rank, s, bsz, widths, micro) for s in range(first, first + n)]

    def timed_block(name: str, n: int) -> dict[str, Any]:
        batches = batches_for(name, n)  # untimed
        sess = sessions[name]
        before = (_count(sess, "replay"), _count(sess, "consensus"))
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for b in batches:
            runners[name](b)
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        steps_done[name] += n
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "steps": n,
            "audits": _count(sess, "replay") - before[0],
            "consensus": _count(sess, "consensus") - before[1],
        }

    # --- warm-up (discarded) -----------------------------------------------------------------------
    warmup = {name: timed_block(name, args["warmup"]) for name in CONFIGS}
    log("warm-up done: " + ", ".join(f"{n} {w['wall_s'] / w['steps'] * 1e3:.0f} ms/step" for n, w in warmup.items()))

    # --- interleaved trials ------------------------------------------------------------------------
    trials: list[dict[str, Any]] = []
    slice_n = args["slice"]
    keys = ("wall_s", "cpu_s", "steps", "audits", "consensus")
    for t in range(args["trials"]):
        k = t % len(CONFIGS)
        order = list(CONFIGS[k:] + CONFIGS[:k])
        blocks = {name: dict.fromkeys(keys, 0) | {"first_step": steps_done[name] + 1} for name in CONFIGS}
        for j in range(args["steps"] // slice_n):
            r = j % len(order)
            for name in order[r:] + order[:r]:
                piece = timed_block(name, slice_n)
                for key in keys:
                    blocks[name][key] += piece[key]
        for name in CONFIGS:
            blocks[name]["last_step"] = steps_done[name]
        trials.append({"order": order, "blocks": blocks})
        log(
            f"trial {t + 1}/{args['trials']}: "
            + ", ".join(f"{n} {blocks[n]['wall_s'] / blocks[n]['steps'] * 1e3:.1f}" for n in CONFIGS)
            + " ms/step"
        )

    # --- where the time goes: single steps between barriers, parts timed in place -------------------
    # The sessions' parts are marked in the library itself (certckpt.detect.timing: a no-op unless a
    # recording is open; `rec`, used by the helpers below, is the one opened around the steps); a part
    # the library no longer marks shows up as missing below, not as a silent zero.
    bd: dict[str, list[float]] = {
        k: [] for k in ("plain", "consensus_other", "consensus_step", "nonaudit_step", "audit_step")
    }
    parts: dict[str, list[dict[str, float]]] = {"audit": [], "nonaudit": [], "consensus": [], "consensus_other": []}

    calls: dict[str, dict[str, int]] = {k: {} for k in parts}

    def single(name: str) -> tuple[float, dict[str, float], int, int]:
        b = batches_for(name, 1)[0]
        sess = sessions[name]
        n0 = (_count(sess, "replay"), _count(sess, "consensus"))
        rec.clear()
        dist.barrier()
        t0 = time.perf_counter()
        runners[name](b)
        dist.barrier()
        dt = time.perf_counter() - t0
        steps_done[name] += 1
        return dt, dict(rec.seconds), _count(sess, "replay") - n0[0], _count(sess, "consensus") - n0[1]

    def count_calls(kind: str) -> None:
        for k, n in rec.calls.items():
            calls[kind][k] = calls[kind].get(k, 0) + n

    # Steps are classified by their number (the same on every rank: the loop must end together);
    # rank 0, which holds the events, checks that classification against its sinks.
    mismatches: list[str] = []
    with timing.record() as rec:
        while len(bd["audit_step"]) < args["reps"]:
            dt, _, _, _ = single("plain")
            bd["plain"].append(dt)
            dt, a, _, nc = single("consensus/10")
            is_cons = sessions["consensus/10"].step % 10 == 0
            if rank == 0 and nc != int(is_cons):
                mismatches.append(f"consensus/10 step {sessions['consensus/10'].step}: {nc} consensus events")
            bd["consensus_step" if is_cons else "consensus_other"].append(dt)
            parts["consensus" if is_cons else "consensus_other"].append({**a, "step": dt})
            count_calls("consensus" if is_cons else "consensus_other")
            dt, a, na, _ = single("audit/10")
            is_audit = sessions["audit/10"].step % 10 == 0
            if rank == 0 and na != int(is_audit):
                mismatches.append(f"audit/10 step {sessions['audit/10'].step}: {na} replay events")
            bd["audit_step" if is_audit else "nonaudit_step"].append(dt)
            parts["audit" if is_audit else "nonaudit"].append({**a, "step": dt})
            count_calls("audit" if is_audit else "nonaudit")
    sentinels_on = sessions["audit/10"].sentinels.active  # off with --nonfinite-read deferred
    expected = {
        "audit": tuple(p for p in AUDIT_PARTS if sentinels_on or p != "sentinels")
        + (("update_audit",) if args["mesh"] == [WORLD] else ()),
        "nonaudit": ("nonfinite_flags", "nonfinite_check") + (("sentinels",) if sentinels_on else ()),
        "consensus": ("nonfinite_check", "consensus"),
        "consensus_other": ("nonfinite_check",),
    }
    missing = {kind: [k for k in want if not calls[kind].get(k)] for kind, want in expected.items() if parts[kind]}
    if any(missing.values()):
        raise RuntimeError(
            "certckpt.detect.timing recorded no call of these parts (did a refactor drop their marks?): "
            + "; ".join(f"{kind} steps: {', '.join(ks)}" for kind, ks in missing.items() if ks)
        )
    log(f"breakdown: {len(bd['audit_step'])} audit and {len(bd['nonaudit_step'])} non-audit steps timed one by one")

    for sess in sessions.values():
        if sess is not None:
            sess.close()
    events = {
        n: {
            "replay_pass": _count(s, "replay", "pass"),
            "replay_fail": _count(s, "replay", "fail"),
            "update_pass": _count(s, "update", "pass"),
            "update_fail": _count(s, "update", "fail"),
            "consensus_pass": _count(s, "consensus", "pass"),
            "consensus_fail": _count(s, "consensus", "fail"),
            "nonfinite_fail": _count(s, "nonfinite-post", "fail"),
            "triggered": _count(s, "triggered-replay"),
            "failures": sum(1 for e in s.sink.events if e.failed),
            "total": len(s.sink.events),
        }
        for n, s in sessions.items()
        if s is not None
    }
    log.close()
    return {
        "rank": rank,
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "params": params,
        "placements": [str(p) for p in models["plain"][0][0].weight.placements],
        "warmup": warmup,
        "trials": trials,
        "breakdown": bd,
        "parts": parts,
        "events": events,
        "breakdown_mismatches": mismatches,
        "steps_done": steps_done,
        "rank_elapsed_s": time.perf_counter() - t_start,
    }


# --------------------------------------------------------------------------------------------------
# the driver


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    tr = r0["trials"]
    ms = {n: [t["blocks"][n]["wall_s"] / t["blocks"][n]["steps"] * 1e3 for t in tr] for n in CONFIGS}
    cpu = {
        n: [
            sum(pr["trials"][i]["blocks"][n]["cpu_s"] for pr in per_rank) / tr[i]["blocks"][n]["steps"] * 1e3
            for i in range(len(tr))
        ]
        for n in CONFIGS
    }
    out: dict[str, Any] = {"step_ms": ms, "cpu_ms_per_step_all_ranks": cpu, "configs": {}}
    for n in CONFIGS:
        paired = [a / p for a, p in zip(ms[n], ms["plain"])]
        ratio = median(paired)
        out["configs"][n] = {
            "median_ms": median(ms[n]),
            "min_ms": min(ms[n]),
            "max_ms": max(ms[n]),
            "ratio": ratio,
            "ratio_min": min(paired),
            "ratio_max": max(paired),
            "ratio_of_medians": median(ms[n]) / median(ms["plain"]),
            "cpu_ms_median": median(cpu[n]),
            "audits_per_trial": [t["blocks"][n]["audits"] for t in tr],
            "consensus_per_trial": [t["blocks"][n]["consensus"] for t in tr],
            "verdict": None if n not in TARGETS else ("PASS" if ratio <= TARGETS[n] else "MISS"),
        }
    out["breakdown"] = {
        k: {"median_ms": median(v) * 1e3, "min_ms": min(v) * 1e3, "max_ms": max(v) * 1e3, "n": len(v)}
        for k, v in r0["breakdown"].items()
        if v
    }
    insitu: dict[str, dict[str, float]] = {}
    for kind, steps in r0["parts"].items():
        if not steps:
            continue
        keys = sorted({k for st in steps for k in st})
        insitu[kind] = {k: median([st.get(k, 0.0) for st in steps]) * 1e3 for k in keys}
        insitu[kind]["n"] = len(steps)
    out["insitu"] = insitu
    paired = [a / b for a, b in zip(ms["audit/10"], ms[NO_SENTINELS])]
    ev = r0["events"]
    on = [n for n in CONFIGS if n.startswith("audit/") and n != NO_SENTINELS]
    steps = sum(r0["steps_done"][n] for n in on)
    triggered = sum(ev[n]["triggered"] for n in on)
    ratio = median(ms["audit/10"]) / median(ms[NO_SENTINELS])
    out["sentinels"] = {
        "ratio": ratio,
        "paired_ratio_median": median(paired),
        "paired_ratio_min": min(paired),
        "paired_ratio_max": max(paired),
        "verdict": "PASS" if ratio <= SENTINEL_GOAL else "MISS",
        "clean_steps": steps,
        "triggered": triggered,
        "failures": sum(ev[n]["failures"] for n in on),
        "per_1000_steps": triggered / steps * 1000 if steps else None,
    }
    a = insitu.get("audit", {})
    out["insitu_audit_parts"] = {
        "signing the local gradients at the reduce-scatters (training)": a.get("train_signature", 0.0),
        "non-finite check (flag sums + all-gather)": a.get("nonfinite_check", 0.0) + a.get("nonfinite_flags", 0.0),
        "ring shift of the micro-batches + RNG state": a.get("replay_audit/ring_shift", 0.0),
        "replay forward + backward (all-gathers, no reduce-scatter)": a.get("replay_audit/replay", 0.0)
        - a.get("replay_signature", 0.0),
        "replay signing": a.get("replay_signature", 0.0),
        "digest all-gather + compare + event": a.get("replay_audit", 0.0)
        - a.get("replay_audit/replay", 0.0)
        - a.get("replay_audit/ring_shift", 0.0),
        "weight consensus (incl. its all-gather)": a.get("consensus", 0.0),
        "optimizer-step replay (no replicas: copy, ship, recompute, compare)": a.get("update_audit", 0.0),
    }
    return out


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    w = [max(len(r[i]) for r in [*rows, head]) for i in range(len(head))]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)).rstrip())
    print("  ".join("-" * x for x in w))
    for r in rows:
        print("  ".join(x.ljust(w[i]) for i, x in enumerate(r)).rstrip())


def print_report(R: dict[str, Any]) -> None:
    c, S = R["config"], R["summary"]
    mesh = "2 x 2 HSDP (replicate x shard)" if c["mesh"] == [2, 2] else "1-D FSDP over 4 ranks"
    print()
    print(
        f"certckpt FSDP2 detection-overhead benchmark ({c['mode']}): "
        f"{c['trials']} interleaved trial(s) x {c['steps']} steps per configuration in slices of {c['slice']}, "
        f"{c['warmup']} warm-up steps each (discarded)"
    )
    cores = "OVERSUBSCRIBED (ranks and gloo threads share cores)" if (c["cpus"] or 0) < WORLD else "one core per rank"
    print(
        f"torch {c['torch']}, python {c['python']}; {WORLD} gloo ranks x {c['rank_threads']} torch thread on "
        f"{c['cpus']} CPUs: {cores}; deterministic algorithms: {c['deterministic']}"
    )
    print(f"load average {c['loadavg_start']} at start, {c['loadavg_end']} at end (1/5/15 min)", end="")
    ob, oc = c.get("others_busy_cores_before"), c.get("others_cpu_s_during_run")
    if ob is not None and oc is not None:
        print(
            f"; CPU used outside the benchmark's processes: {ob:.2f} cores just before, {oc:.1f} CPU-s during the run"
        )
    else:
        print()
    print(
        f"mesh: {mesh}, placements {c['placements']}; model: MLP {'-'.join(map(str, c['widths']))} (GELU between"
        f" Linears, each fully_shard-ed, then the root), {c['params']:,} parameters; "
        f"{c['opt']}; batch {c['batch']} x {c['widths'][0]} per rank, MSE"
        + (f"; {c['micro']} micro-batches per step (set_requires_gradient_sync, loss / N)" if c["micro"] > 1 else "")
        + ("; non-finite flags read a step late (nonfinite_read='deferred')" if c.get("read") == "deferred" else "")
    )
    print(
        "figure: rank 0's wall time over a trial's slices (each barrier to barrier) / steps; ratio to plain: "
        "median of the per-trial ratios [min-max]"
    )
    print()
    head = (
        "configuration",
        "ms/step median [min-max]",
        "ratio to plain [min-max]",
        "target",
        "",
        "replay audits/trial",
        "consensus/trial",
        "CPU ms/step (4 ranks)",
    )
    rows = []
    for n in CONFIGS:
        s = S["configs"][n]
        if n in TARGETS:
            target = f"<= {TARGETS[n]:.2f}x"
        elif n in FLOORS:
            target = f"(floor {FLOORS[n]:.3f}x)"
        else:
            target = ""
        rows.append(
            (
                f"{n:<13} {LABELS[n]}",
                f"{s['median_ms']:.1f} [{s['min_ms']:.1f}-{s['max_ms']:.1f}]",
                "1" if n == "plain" else f"{s['ratio']:.3f}x [{s['ratio_min']:.3f}-{s['ratio_max']:.3f}]",
                target,
                s["verdict"] or "",
                ",".join(map(str, s["audits_per_trial"])),
                ",".join(map(str, s["consensus_per_trial"])),
                f"{s['cpu_ms_median']:.1f}",
            )
        )
    _table(head, rows)
    print(
        "(floor: 1 + 1/K, one more forward + backward per K steps; under FSDP the replay all-gathers the weights,"
        " a collective, so it cannot overlap the step)"
    )

    bd, ins, parts = S["breakdown"], S["insitu"], S["insitu_audit_parts"]
    m = {k: v["median_ms"] for k, v in bd.items()}

    def cell(key: str) -> str:
        v = bd.get(key)
        return "-" if v is None else f"{v['median_ms']:8.1f}  [{v['min_ms']:.1f}-{v['max_ms']:.1f}]  n={v['n']}"

    print()
    print("Where the time goes: rank 0, single steps each between two barriers, plain / consensus/10 / audit/10")
    print("interleaved step by step; ms, median [min-max]:")
    lines = [
        ("plain FSDP2 step", "plain", ""),
        ("consensus/10, step without consensus", "consensus_other", ("plain", "vs plain")),
        ("consensus/10, consensus step", "consensus_step", ("consensus_other", "vs its other steps")),
        ("audit/10, non-audit step", "nonaudit_step", ("plain", "vs plain")),
        ("audit/10, audit step", "audit_step", ("nonaudit_step", "vs non-audit step")),
    ]
    for label, key, ref in lines:
        note = ""
        if ref and key in m and ref[0] in m:
            note = f"{m[key] - m[ref[0]]:+.1f} {ref[1]}"
        print(f"   {label:<40} {cell(key):<36} {note}".rstrip())
    if "audit" in ins:
        extra = m.get("audit_step", 0.0) - m.get("nonaudit_step", 0.0)
        print("   inside the audit steps (rank 0's clock around the session's own calls, median per audit step;")
        print("   collective ones include waiting for the other ranks):")
        total = 0.0
        for label, v in parts.items():
            total += v
            share = f"{v / extra * 100:5.0f}% of the extra" if extra > 0 else ""
            print(f"     {label:<62} {v:8.2f}   {share}".rstrip())
        print(f"     {'sum':<62} {total:8.2f}   (measured extra over a non-audit step: {extra:.1f})")
        na, cs = ins.get("nonaudit", {}), ins.get("consensus", {})
        print(
            f"   in situ on non-audit steps: non-finite check {na.get('nonfinite_check', 0.0):.2f} ms;"
            f" on consensus/10's consensus steps: weight consensus {cs.get('consensus', 0.0):.2f} ms"
        )
        if "plain" in m and "nonaudit_step" in m:
            p = m["plain"]
            check = m["nonaudit_step"] - p
            replay = parts["replay forward + backward (all-gathers, no reduce-scatter)"]
            print(
                f"   predicted from these single steps: audit/10 {(p + check + extra / 10) / p:.3f}x, "
                f"audit/100 {(p + check + extra / 100) / p:.3f}x; the replay's forward + backward alone is "
                f"{replay / p:.2f} plain steps (floor at K=10: {1 + replay / 10 / p:.3f}x here)"
            )
    ev = R["per_rank"][0]["events"]
    print(
        "   events in rank 0's sinks at the end: "
        + "; ".join(
            f"{n}: {v['replay_pass']} replay pass / {v['replay_fail']} fail, {v['consensus_pass']} consensus pass /"
            f" {v['consensus_fail']} fail"
            + (f", {v['update_pass']} update replay pass / {v['update_fail']} fail" if v["update_pass"] else "")
            for n, v in ev.items()
        )
    )
    for line in R["per_rank"][0]["breakdown_mismatches"]:
        print(f"   ODD: a single step's events do not match its step number: {line}")
    sn = S["sentinels"]
    print()
    print(
        f"Sentinels: audit/10 with them on (the default) vs off, same loop, interleaved: {sn['ratio']:.4f}x"
        f" (goal <= {SENTINEL_GOAL:.2f}x: {sn['verdict']}; paired per trial {sn['paired_ratio_median']:.4f}"
        f" [{sn['paired_ratio_min']:.4f}-{sn['paired_ratio_max']:.4f}])"
    )
    na = S["insitu"].get("nonaudit", {})
    if "sentinels" in na and "nonaudit_step" in bd:
        print(
            f"   in situ on audit/10's non-audit steps: the sentinels' marks (sums of squares at the"
            f" reduce-scatters, packing the row) {na['sentinels']:.2f} ms of a {m['nonaudit_step']:.1f} ms step"
            f" ({na['sentinels'] / m['nonaudit_step'] * 100:.2f} %); the non-finite check with the rows"
            f" {na.get('nonfinite_check', 0.0):.2f} ms"
        )
    rate = "-" if sn["per_1000_steps"] is None else f"{sn['per_1000_steps']:.1f}"
    print(
        f"   false triggers on these clean runs: {sn['triggered']} triggered replay(s) in {sn['clean_steps']}"
        f" steps with sentinels on ({rate} per 1,000 steps), {sn['failures']} detection(s)"
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
    ap.add_argument("--quick", action="store_true", help="~2.0M-parameter MLP, 1 trial: a smoke run")
    ap.add_argument("--json", action="store_true", help="also print all results as JSON")
    ap.add_argument("--trials", type=int, default=None, help="interleaved trials (default 2, quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration per trial, a multiple of 100")
    ap.add_argument(
        "--slice", type=int, default=None, help="steps per interleaved slice, dividing --steps (default 10)"
    )
    ap.add_argument("--mesh", choices=("2x2", "4"), default="2x2", help="2 x 2 HSDP (default) or 1-D FSDP over 4")
    ap.add_argument("--opt", choices=("adamw", "sgd"), default="adamw", help="optimizer (default AdamW)")
    ap.add_argument("--batch", type=int, default=None, help="rows per rank and micro-batch (default 32)")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    ap.add_argument("--reps", type=int, default=None, help="audit steps timed one by one at the end (default 2)")
    ap.add_argument(
        "--nonfinite-read",
        choices=("immediate", "deferred"),
        default="immediate",
        help="when the sessions read the non-finite flags (deferred: an asynchronous all-gather, read a step later)",
    )
    args = ap.parse_args()

    from rankbench import Machine, progress_tail
    from tinymode import announce

    tiny = announce("bench_fsdp_detect")
    P: dict[str, Any] = {"slice": 10} | dict(TINY if tiny else QUICK if args.quick else FULL)
    for key in ("trials", "steps", "batch", "reps", "slice"):
        if getattr(args, key) is not None:
            P[key] = getattr(args, key)
    P.update(micro=args.micro, opt=args.opt, mesh=[2, 2] if args.mesh == "2x2" else [WORLD])
    P["read"] = args.nonfinite_read
    if args.micro < 1 or P["trials"] < 1 or P["reps"] < 1:
        ap.error("--micro, --trials and --reps must be >= 1")
    if (P["steps"] % 100 or P["steps"] < 100) and not tiny:
        ap.error("--steps must be a multiple of 100 (each trial of audit/100 must hold exactly one audit)")
    if P["slice"] < 1 or P["steps"] % P["slice"]:
        ap.error("--slice must divide --steps")

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
            **common,
        }
    }
    t0 = time.perf_counter()
    banner = (
        f"running {WORLD} ranks: {P['trials']} trials x {len(CONFIGS)} configurations x {P['steps']} steps "
        f"of a {n_params(P['widths']):,}-parameter MLP, mesh {P['mesh']}"
    )
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-fsdp-detect-") as d, progress_tail(d, banner) as prog:
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
    R["config"]["placements"] = per_rank[0]["placements"]
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
