#!/usr/bin/env python
"""False triggers of the sentinels on real training: a GPT-2-small-shaped language model on CPU.

Run from the repository root:

    python benchmarks/bench_false_triggers.py            # 2 layers of GPT-2 small, 300 steps (~23 min on 2 busy cores)
    python benchmarks/bench_false_triggers.py --steps 600 --layers 4
    python benchmarks/bench_false_triggers.py --json     # also every step's loss, flags and scores as JSON

What trains, on 3 gloo ranks (``certckpt.detect.launch.run_ranks``), one torch thread each: the
envelope's causal transformer (``certckpt.tools.envelope.models.tiny_transformer``) at GPT-2 small's
width (768, 12 heads, MLP 4x, vocabulary 50,257, LM head tied to the embedding) with fewer layers
(default 2 of 12) and one short sequence per rank per step (64 tokens), so that a few hundred steps
fit in minutes on a CPU (the LM head over 50,257 tokens is most of the arithmetic). So few tokens
make each rank's gradient far noisier than a real batch's: a harsher test of the sentinels than
real training, not a gentler one. The text is real: the Python standard library's own source
(the first ``--corpus-mb`` MB of its ``.py`` files, sorted by path), cut into words and punctuation
and numbered by frequency (the 50,256 most frequent tokens, the rest one unknown id), not GPT-2's
byte-pair encoding. Each rank reads its own random windows. AdamW (lr 6e-4, betas 0.9/0.95, weight
decay 0.1), linear warm-up over 10 % of the steps then cosine decay to 10 %, gradient clipping at
1.0: the recipe GPT-2-style runs use, so the gradient norms move the way they do in real training
(fast at first, then settling).

The auditor runs as shipped (``Auditor``, ``audit_every=10``, the default ``Triggers()``): every
step's sentinels, every triggered replay, every audit. The report: triggered replays per 1,000 steps
(each one a false trigger: nothing is injected; a triggered replay that failed would be a false
detection and stops the run), the rate limit's suppressed flags, and the margin: the largest score
each test reached (``sentinel.scores``, recomputed from the exchanged tables, whose decisions must
match the ones the ranks took), against the thresholds of 8.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a 1-layer model of width 32, vocabulary 256,
30 steps: every code path in seconds, figures meaningless.

Nothing here is hard-coded: every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import sysconfig
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 3
FULL = {"layers": 2, "d_model": 768, "heads": 12, "vocab": 50257, "seq": 64, "batch": 1, "steps": 300, "corpus_mb": 4.0}
TINY = {"layers": 1, "d_model": 32, "heads": 2, "vocab": 256, "seq": 16, "batch": 2, "steps": 30, "corpus_mb": 0.2}
AUDIT_EVERY = 10
_TOKEN = re.compile(r"\w+|[^\w\s]")


def corpus_files() -> list[str]:
    """The standard library's ``.py`` files, sorted (the same text for one Python version)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__", "dist-packages"))
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return sorted(out)


def tokenize(limit_bytes: int, vocab: int) -> tuple[list[int], dict[str, Any]]:
    """The corpus as token ids: words and punctuation numbered by frequency, the rarest as one id."""
    words: list[str] = []
    read = 0
    for path in corpus_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        words.extend(_TOKEN.findall(text))
        read += len(text.encode("utf-8"))
        if read >= limit_bytes:
            break
    counts = collections.Counter(words)
    ranked = {w: i for i, (w, _) in enumerate(counts.most_common(vocab - 1))}
    unknown = vocab - 1
    ids = [ranked.get(w, unknown) for w in words]
    info = {"bytes": read, "tokens": len(ids), "distinct": len(counts), "unknown_share": ids.count(unknown) / len(ids)}
    return ids, info


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.detect import Triggers
    from certckpt.detect.auditor import Auditor, FaultDetectedError
    from certckpt.detect.launch import ProgressLog
    from certckpt.tools.envelope.models import tiny_transformer

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank = dist.get_rank()
    log = ProgressLog(args.get("progress"), rank=rank)
    data = torch.from_file(args["tokens"], shared=False, size=args["n_tokens"], dtype=torch.int32).long()
    model, _, loss_fn = tiny_transformer(
        vocab=args["vocab"], d_model=args["d_model"], heads=args["heads"], layers=args["layers"], tied=True
    )
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95)
    )
    steps, warm = args["steps"], max(1, args["steps"] // 10)

    def lr_at(i: int) -> float:  # i = optimizer steps taken so far
        if i < warm:
            return (i + 1) / warm
        t = (i - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    auditor = Auditor(
        ddp,
        opt,
        loss_fn=loss_fn,
        run="false-triggers",
        audit_every=AUDIT_EVERY,
        clip_grad_norm=1.0,
        triggers=Triggers(),
    )
    log(f"{params:,} parameters; sentinels: {auditor.sentinels.off or 'on'}")
    n, seq, batch = args["n_tokens"], args["seq"], args["batch"]
    per_step: list[dict[str, Any]] = []
    detection = None
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        g = torch.Generator().manual_seed(rank * 1_000_003 + s)
        starts = torch.randint(0, n - seq - 1, (batch,), generator=g).tolist()
        x = torch.stack([data[o : o + seq] for o in starts])
        y = torch.stack([data[o + 1 : o + seq + 1] for o in starts])
        try:
            loss = auditor.train_step((x, y))
        except FaultDetectedError as e:
            detection = {"kind": e.event.kind, "step": e.event.step, "suspects": list(e.event.suspect_ranks)}
            log(f"step {s}: DETECTION {detection}")
            break
        sched.step()
        last = auditor.last
        per_step.append(
            {
                "step": s,
                "loss": float(loss),
                "flagged": list(last.flagged) if last is not None else [],
                "triggered": bool(last.triggered) if last is not None else False,
                "table": auditor.nonfinite.table,
                "names": list(auditor.sentinels.names),  # DDP rebuilds its buckets after step 1: the groups change
            }
        )
        if s % 25 == 0 or s == steps:
            rate = (time.perf_counter() - t0) / s
            log(
                f"step {s}/{steps}: loss {float(loss):.3f}, {auditor.state.triggered_replays} triggered replay(s), "
                f"{rate:.2f} s/step"
            )
    seconds = time.perf_counter() - t0
    out = {
        "params": params,
        "names": list(auditor.sentinels.names),
        "off": auditor.sentinels.off,
        "steps": per_step,
        "triggered": auditor.state.triggered_replays,
        "suppressed": auditor.state.triggers_suppressed,
        "detection": detection,
        "seconds": seconds,
    }
    auditor.close()
    log.close()
    return out


def margins(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The decisions and the largest scores, recomputed from the exchanged tables (``sentinel``)."""
    from certckpt.detect.sentinel import SentinelState, Triggers, decide, scores

    triggers, state = Triggers(), SentinelState()
    top = {"peer": (0.0, None), "history": (0.0, None), "both": (0.0, None)}
    replayed, mismatched = [], []
    for rec in steps:
        s, table, names = rec["step"], rec["table"], rec["names"]
        if table is None:
            continue
        rows = [
            [math.sqrt(v) if k < len(names) - (names[-1] == "loss") else v for k, v in enumerate(r[2:])] for r in table
        ]
        sc = scores(rows, names, state, triggers=triggers)
        for r, per in enumerate(sc):
            for k, (peer, hist) in enumerate(per):
                where = f"step {s}, rank {r}, {names[k]}"
                for key, v in (("peer", peer), ("history", hist)):
                    if v is not None and v > top[key][0]:
                        top[key] = (v, where)
                if peer is not None and hist is not None and min(peer, hist) > top["both"][0]:
                    top["both"] = (min(peer, hist), where)
        d, state = decide(rows, names, state, step=s, triggers=triggers, replaying=s % AUDIT_EVERY == 0)
        if d.replay:
            replayed.append(s)
        if d.replay != rec["triggered"]:
            mismatched.append(s)
    return {
        "largest": {k: {"score": round(v, 2), "where": w} for k, (v, w) in top.items()},
        "replayed": replayed,
        "mismatched_steps": mismatched,
        "thresholds": {"mad_threshold": triggers.mad_threshold, "band": triggers.band},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 2; GPT-2 small has 12)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 64)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 1)")
    ap.add_argument("--corpus-mb", type=float, default=None, help="MB of standard-library source to read (default 4)")
    ap.add_argument("--json", action="store_true", help="also print every step's record as JSON")
    args = ap.parse_args()

    from rankbench import Machine, progress_tail
    from tinymode import announce

    tiny = announce("bench_false_triggers")
    P = dict(TINY if tiny else FULL)
    for k in ("steps", "layers", "seq", "batch", "corpus_mb"):
        if getattr(args, k) is not None:
            P[k] = getattr(args, k)
    if P["steps"] < 1 or P["layers"] < 1 or P["seq"] < 2 or P["batch"] < 1:
        ap.error("--steps, --layers and --batch must be >= 1, --seq >= 2")

    import torch

    from certckpt.detect.launch import run_ranks

    machine = Machine(tiny=tiny)
    common = machine.start()
    ids, corpus = tokenize(int(P["corpus_mb"] * 1e6), P["vocab"])
    R: dict[str, Any] = {
        "config": {
            **P,
            "mode": "tiny" if tiny else "full",
            "world": WORLD,
            "audit_every": AUDIT_EVERY,
            "corpus": corpus,
            **common,
        }
    }
    t0 = time.perf_counter()
    banner = (
        f"running {WORLD} ranks: {P['steps']} steps of a {P['layers']}-layer, width-{P['d_model']} model "
        f"(vocabulary {P['vocab']:,}), {P['batch']} x {P['seq']} tokens per rank per step"
    )
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-false-triggers-") as d:
        tokens = os.path.join(d, "tokens.i32")
        torch.tensor(ids, dtype=torch.int32).numpy().tofile(tokens)
        with progress_tail(d, banner) as prog:
            per_rank = run_ranks(
                f"{os.path.splitext(os.path.basename(__file__))[0]}:rank_main",
                WORLD,
                {**P, "tokens": tokens, "n_tokens": len(ids), "progress": prog},
                timeout=4 * 3600,
                threads=1,
                extra_path=HERE,
            )
    r0 = per_rank[0]
    R["elapsed_s"] = time.perf_counter() - t0
    R["config"].update(machine.end())
    R["config"]["params"] = r0["params"]
    done = len(r0["steps"])
    R["result"] = {
        "steps": done,
        "triggered": r0["triggered"],
        "per_1000_steps": 1000 * r0["triggered"] / done if done else None,
        "suppressed": r0["suppressed"],
        "detection": r0["detection"],
        "sentinels_off": r0["off"],
        "names": r0["names"],
        "first_loss": r0["steps"][0]["loss"] if done else None,
        "last_loss": r0["steps"][-1]["loss"] if done else None,
        "seconds_per_step": r0["seconds"] / max(done, 1),
        "margins": margins(r0["steps"]),
        # every rank took the same decision at every step (they must, to enter the same collectives)
        "agree": all([s["triggered"] for s in pr["steps"]] == [s["triggered"] for s in r0["steps"]] for pr in per_rank),
    }
    print_report(R)
    if args.json:
        print()
        print(json.dumps(R | {"per_step": r0["steps"]}, indent=2))
    if r0["detection"] is not None or R["result"]["margins"]["mismatched_steps"]:
        sys.exit(1)


def print_report(R: dict[str, Any]) -> None:
    c, r = R["config"], R["result"]
    m = r["margins"]
    print(
        f"# bench_false_triggers: {c['layers']}-layer model of width {c['d_model']}, {c['heads']} heads "
        f"({c['params']:,} parameters, vocabulary {c['vocab']:,}), {c['world']} gloo ranks on {c['cpus']} CPU(s), "
        f"{c['batch']} x {c['seq']} tokens per rank per step, audits every {c['audit_every']}; "
        f"python {c['python']}, torch {c['torch']}"
    )
    corpus = c["corpus"]
    print(
        f"# text: {corpus['bytes'] / 1e6:.1f} MB of the standard library's source, {corpus['tokens']:,} tokens "
        f"({corpus['unknown_share']:.1%} unknown); load average {c['loadavg_start']} -> {c['loadavg_end']}"
    )
    if r["sentinels_off"]:
        print(f"sentinels OFF: {r['sentinels_off']}")
    print(
        f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f} over {r['steps']} steps "
        f"({r['seconds_per_step']:.2f} s/step, {R['elapsed_s']:.0f} s in all)"
    )
    per = "-" if r["per_1000_steps"] is None else f"{r['per_1000_steps']:.1f}"
    print(
        f"false triggers per 1,000 steps: {per} ({r['triggered']} triggered replay(s) in {r['steps']} steps, "
        f"all clean; {r['suppressed']} more flag(s) held back by the rate limit)"
    )
    if r["detection"] is not None:
        print(f"FALSE DETECTION: {r['detection']}")
    print(f"largest clean score (flag above {m['thresholds']['mad_threshold']:g} on both tests):")
    for k, label in (("both", "both tests at once"), ("peer", "peers (median/MAD)"), ("history", "own history (EWMA)")):
        v = m["largest"][k]
        print(f"  {label:<22} {v['score']:6.2f}  ({v['where']})")
    if m["mismatched_steps"]:
        print(f"MISMATCH: the recomputed decisions differ from the ranks' at steps {m['mismatched_steps'][:10]}")
    if not r["agree"]:
        print("MISMATCH: the ranks took different decisions")


if __name__ == "__main__":
    main()
