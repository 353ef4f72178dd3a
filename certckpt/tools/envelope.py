"""The performance envelope: what the auditor costs per training step, across shapes and audit intervals.

``certckpt envelope`` is the front end. For every combination of sequence length L, micro-batch B
(sequences per rank per step) and audit interval K it reports plain DDP's step time, the audited
step time, the **premium** ``(audited - plain) / plain``, where the premium comes from (replay,
consensus, non-finite checks) and the **replay floor**, and gates on a largest acceptable premium.
The JSON report is what ``certckpt plan --from FILE`` reads (its largest premium becomes the
planner's audit overhead X).

How it is measured
------------------
One job of ``ranks`` real ``torch.distributed`` processes (``certckpt.detect.launch.run_ranks``:
gloo on 127.0.0.1, one torch thread per rank). Every rank builds the model once (the default is a
small causal transformer, :func:`tiny_transformer`; ``--model MODULE:FACTORY`` plugs in another)
and wraps deep copies of it, so that every copy starts from the same weights and has the same
structure: one plain ``DistributedDataParallel`` copy (default comm hook) and, per K, one
``DistributedDataParallel`` copy driven by ``Auditor(audit_every=K)``. All copies train with AdamW.
The only difference between a plain and an audited copy is the auditor.

Per shape (L, B) the job runs interleaved trials; the first ``warmup`` trials (at least one) are
discarded, and the first shape gets one more (DDP rebuilds its buckets after the first step; the
auditor's first step runs its one-off determinism check). The first warm-up trial times single
steps and sizes the **block** m for the shape: about :data:`BLOCK_S` seconds of plain steps, at
least 1 and at most ``min(K) - 1``. Each trial draws m batches, untimed, from
``batch_fn(rank, step, L, B)`` (every measurement of the trial uses the same ones) and takes these
measurements, in an order that rotates every trial, each a block timed between two barriers
(rank 0's wall time):

=================  ===========================================================================
``plain``          m plain DDP steps: zero_grad, loss, backward (with the all-reduce), optimizer step
``fb``             m forwards + backwards alone on the bare module (``torch.autograd.grad``, no
                   all-reduce, no optimizer): the computation a replay must repeat
``nonaudit/K``     m audited steps, none of them an audit step (non-finite checks only)
``cycle/K``        m audited steps, the last one an audit step (non-finite checks, ring replay,
                   consensus)
``consensus/K``    the auditor's weight consensus alone (``Auditor._weight_consensus``), m times
=================  ===========================================================================

Which step is an audit step depends only on the step number (``s % K == 0``), so the driver moves
the auditor's step counter forward (never back) to where the block it wants begins; the audited
work of each kind of step is exactly what training would do. Per trial, the non-audit step time
is ``nonaudit/K`` / m and the audit step time that plus ``cycle/K - nonaudit/K``: both blocks are m
steps long, so every figure carries the same share of barrier latency (with single steps between
barriers, that share alone made small steps look 25% slower here). Each figure is the **mean**
over the kept trials, trimmed: the :data:`TRIM` fraction at each end is dropped first
(:func:`trimmed_mean`; the untrimmed means are in the report too). A shape gets ``steps`` trials, and more (up to :data:`MAX_TRIALS`) while it
has used less than ``min_shape_s`` seconds, so that millisecond-sized shapes are not judged on a
handful of samples.

The arithmetic (:func:`figures`), with means ``P`` (plain), ``N`` (non-audit step), ``A`` (audit
step), ``C`` (consensus alone) and ``F`` (forward + backward alone):

- audited step time, the mean over one K-step cycle: ``T = N + (A - N) / K`` (K-1 non-audit
  steps and one audit step). It is computed from the two kinds of step rather than timed over
  whole cycles: a K of 100 would otherwise need hundreds of steps per trial;
- premium ``(T - P) / P``; it splits exactly into three parts, each a fraction of P:
  ``nonfinite = (N - P) / P`` (the comm hook's flags and their exchange, paid on every step),
  ``consensus = C / K / P`` (the consensus alone, once per audit), and
  ``replay = (A - N - C) / K / P`` (everything else an audit adds: the hook's gradient signatures,
  the ring shift of the batch, the replay's forward + backward and its signature, the signature
  all-gather and comparison, the events). ``shares`` are these parts divided by the premium (they
  add up to 1); they are ``None`` when the premium is not positive, where they mean nothing (a
  premium at or below zero is measurement noise). ``premium_parts`` gives the parts themselves;
- replay floor ``F / P / K``: the premium a replay of one micro-batch every K steps cannot go
  below on this machine, since it repeats the forward and backward. ``replay`` well above the
  floor points at the audit's other work; near it, only a larger K lowers it.

Noise. Blocks on an oversubscribed machine (more ranks than cores, as 3 ranks on 2 cores, and
other jobs beside them) scatter by 10-30% around their mean, mostly slow drift that every
measurement of a trial shares. ``premium_se`` is the premium's standard error from the per-trial
differences audited - plain, paired by trial (:func:`premium_se`); a premium within one or two
standard errors of the budget is not a verdict either way. The gate itself compares the premium
alone.

The report
----------
:func:`run_envelope` returns (and ``--json`` prints) ``{"ranks", "model", "max_premium",
"combinations": [{"seq_len", "micro_batch", "audit_every", "plain_s", "audited_s", "premium",
"premium_se", "premium_parts", "shares": {"replay", "consensus", "nonfinite"}, "replay_floor",
"over_budget", "trials"}], "over_budget": [{"seq_len", "micro_batch", "audit_every", "premium"}],
...}`` plus the set-up (params, mode, backend, device, threads, load average) and the per-shape
means of every measurement. Times are seconds, premiums and shares fractions.

Determinism
-----------
``mode="deterministic"`` (the default) runs every rank with ``torch.use_deterministic_algorithms(True)``
and the auditor compares bit-exact gradient fingerprints: the default model's ops (embedding,
layer norm, ``scaled_dot_product_attention`` with ``is_causal=True``, GELU, cross-entropy) are
deterministic on CPU with one thread, and the auditor's first-step check proves it on every run.
``mode="tolerance"`` leaves the algorithms alone and compares norms and projections within a
relative tolerance: use it for a model or device (CUDA attention backward) without deterministic
kernels.

Backends
--------
``backend="gloo"`` with ``device="cpu"`` is the default and the only combination tested here.
``backend="nccl"`` needs ``device="cuda"``: the launcher's default group stays gloo (barriers and
the driver's bookkeeping) and the DDP copies use a NCCL group over ``cuda:(rank % device_count)``
with ``torch.cuda.synchronize`` before every barrier. Use as many ranks as GPUs.
"""

from __future__ import annotations

import copy
import importlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import MissingDependencyError
from certckpt.format.storage import write_atomic

__all__ = [
    "BUILTIN_MODEL",
    "EnvelopeConfig",
    "FULL",
    "QUICK",
    "figures",
    "premium_se",
    "trimmed_mean",
    "over_budget",
    "exit_code",
    "parse_int_list",
    "resolve_model",
    "run_envelope",
    "format_table",
    "require_matplotlib",
    "plot",
    "tiny_transformer",
]

BUILTIN_MODEL = "tiny-transformer"

FULL: dict[str, Any] = {"seq_lens": (128, 512, 2048), "micro_batches": (1, 4, 16), "audit_every": (10, 100), "steps": 5, "min_shape_s": 30.0}
QUICK: dict[str, Any] = {"seq_lens": (64, 256), "micro_batches": (1, 4), "audit_every": (10, 100), "steps": 10, "min_shape_s": 15.0}
"""Default sweeps. ``steps``: trials per shape at least; more while the shape has used less than
``min_shape_s`` seconds, up to :data:`MAX_TRIALS`."""

MAX_TRIALS = 200

TRIM = 0.1
"""Each figure is the mean of its trials after dropping this fraction at each end (see :func:`trimmed_mean`)."""

BLOCK_S = 0.1
"""Each measurement times a block of consecutive steps of about this many seconds (at least one
step; for each K at most K-1, so that a block can be free of audit steps)."""


# --------------------------------------------------------------------------------------------------
# the arithmetic (pure)


def figures(*, plain_s: float, nonaudit_s: float, audit_s: float, consensus_s: float, fb_s: float, audit_every: int) -> dict[str, Any]:
    """The reported figures of one combination from its measured mean times (see the module docstring).

    Args:
        plain_s: P, mean plain DDP step.
        nonaudit_s: N, mean audited step that is not an audit step.
        audit_s: A, mean audit step.
        consensus_s: C, mean weight consensus alone.
        fb_s: F, mean forward + backward alone.
        audit_every: K.

    Returns:
        ``{"plain_s", "audited_s", "premium", "premium_parts": {replay, consensus, nonfinite},
        "shares": {replay, consensus, nonfinite} (None when premium <= 0; the sweep also drops them
        when the premium is within two standard errors of zero), "replay_floor"}``.
    """
    if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1:
        raise ValueError(f"audit_every must be an integer >= 1, got {audit_every!r}")
    for name, v in (("plain_s", plain_s), ("nonaudit_s", nonaudit_s), ("audit_s", audit_s), ("consensus_s", consensus_s), ("fb_s", fb_s)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite time >= 0, got {v!r}")
    if plain_s <= 0:
        raise ValueError(f"plain_s must be > 0, got {plain_s!r}")
    k = audit_every
    audited = nonaudit_s + (audit_s - nonaudit_s) / k
    premium = (audited - plain_s) / plain_s
    parts = {
        "replay": (audit_s - nonaudit_s - consensus_s) / k / plain_s,
        "consensus": consensus_s / k / plain_s,
        "nonfinite": (nonaudit_s - plain_s) / plain_s,
    }
    shares = {n: v / premium for n, v in parts.items()} if premium > 0 else None
    return {
        "plain_s": plain_s,
        "audited_s": audited,
        "premium": premium,
        "premium_parts": parts,
        "shares": shares,
        "replay_floor": fb_s / plain_s / k,
    }


def trimmed_mean(xs: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``xs`` without its ``floor(trim * n)`` smallest and largest values.

    Other jobs on a shared machine put rare, huge outliers into single trials (a 45 ms step timed
    at 450 ms); dropping a tenth at each end keeps them from deciding a premium. With fewer than
    ``1 / trim`` values nothing is dropped: the plain mean.
    """
    if not xs:
        raise ValueError("trimmed_mean of no values")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    v = sorted(xs)
    cut = int(math.floor(trim * len(v) + 1e-9))
    return statistics.fmean(v[cut: len(v) - cut] if cut else v)


def premium_se(*, plain: Sequence[float], nonaudit: Sequence[float], audit: Sequence[float], audit_every: int) -> float | None:
    """Standard error of the premium from per-trial samples, paired by trial (index i of each list
    was measured in trial i, under the same machine load).

    Per trial ``D_i = (1 - 1/K) N_i + A_i / K - P_i`` (audited minus plain); the premium is
    ``mean(D) / mean(P)`` and its standard error ``stdev(D) / sqrt(n) / mean(P)`` (the uncertainty
    of the denominator is second order). None with fewer than two trials.
    """
    n = len(plain)
    if n < 2 or len(nonaudit) != n or len(audit) != n:
        return None
    k = audit_every
    d = [(1 - 1 / k) * x + a / k - p for p, x, a in zip(plain, nonaudit, audit)]
    return statistics.stdev(d) / math.sqrt(n) / statistics.fmean(plain)


def over_budget(combinations: Iterable[Mapping[str, Any]], max_premium: float) -> list[dict[str, Any]]:
    """The combinations whose premium exceeds ``max_premium`` (strictly), named by their shape and K."""
    return [
        {"seq_len": c["seq_len"], "micro_batch": c["micro_batch"], "audit_every": c["audit_every"], "premium": c["premium"]}
        for c in combinations
        if c["premium"] > max_premium
    ]


def exit_code(report: Mapping[str, Any]) -> int:
    """The gate: 1 when any combination is over budget, else 0."""
    return 1 if report["over_budget"] else 0


def describe(c: Mapping[str, Any]) -> str:
    """``seq 128 x mb 4, K 10`` for one combination."""
    return f"seq {c['seq_len']} x mb {c['micro_batch']}, K {c['audit_every']}"


def parse_int_list(text: str, name: str, *, low: int = 1) -> tuple[int, ...]:
    """``"128,512"`` -> ``(128, 512)``: distinct integers >= ``low``, in the order given; ValueError otherwise."""
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(t == "" for t in items):
        raise ValueError(f"{name}: expected a comma-separated list of integers, got {text!r}")
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"{name}: expected a comma-separated list of integers, got {text!r}") from None
    bad = [v for v in values if v < low]
    if bad:
        raise ValueError(f"{name}: every value must be >= {low}, got {bad[0]}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name}: a value is repeated in {text!r}")
    return tuple(values)


# --------------------------------------------------------------------------------------------------
# the default model


def tiny_transformer(*, vocab: int = 256, d_model: int = 64, heads: int = 4, layers: int = 2, mlp_ratio: int = 4):
    """The default model: a small causal language model, so that sequence length matters.

    Token embedding plus fixed sinusoidal positions (no parameter, any length), ``layers`` pre-norm
    blocks (causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``,
    then a GELU MLP), a final layer norm and an LM head; next-token cross-entropy on uniform random
    tokens. About 133k parameters at the defaults.

    Returns:
        ``(model, batch_fn, loss_fn)``: ``batch_fn(rank, step, seq_len, micro_batch)`` gives
        ``(tokens, targets)``, int64 ``[micro_batch, seq_len]`` each, seeded by (rank, step);
        ``loss_fn(model, batch)`` the mean cross-entropy.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
            self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        @staticmethod
        def positions(n: int, device, dtype):
            pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
            inv = torch.exp(torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d_model))
            pe = torch.zeros(n, d_model, device=device, dtype=torch.float32)
            pe[:, 0::2] = torch.sin(pos * inv)
            pe[:, 1::2] = torch.cos(pos * inv)
            return pe.to(dtype)

        def forward(self, tokens):
            x = self.embed(tokens)
            x = x + self.positions(tokens.shape[1], x.device, x.dtype)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = TinyTransformer()

    def batch_fn(rank: int, step: int, seq_len: int, micro_batch: int):
        g = torch.Generator().manual_seed(rank * 1_000_003 + step)
        t = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def loss_fn(m, batch):
        tokens, targets = batch
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, batch_fn, loss_fn


def resolve_model(spec: str) -> tuple[str, str | None]:
    """Check ``--model`` in the driver: ``tiny-transformer`` or an importable ``MODULE:FACTORY``.

    Returns:
        ``(spec, extra_path)``: the directory the rank processes need on their path to import the
        module (None for the built-in model or an installed module).

    Raises:
        ValueError: malformed, not importable, or not callable (a usage error).
    """
    if spec == BUILTIN_MODEL:
        return spec, None
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name or ":" in fn_name:
        raise ValueError(f"--model: expected {BUILTIN_MODEL!r} or MODULE:FACTORY, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` gives the rank processes
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import {mod_name!r} ({e})") from None
    if not callable(getattr(mod, fn_name, None)):
        raise ValueError(f"--model {spec}: {mod_name!r} has no callable {fn_name!r}")
    path = getattr(mod, "__file__", None)
    extra = None
    if path:
        root = os.path.dirname(os.path.abspath(path))
        depth = mod_name.count(".") + (1 if os.path.basename(path) == "__init__.py" else 0)
        for _ in range(depth):
            root = os.path.dirname(root)
        extra = root
    return spec, extra


def _load_factory(spec: str) -> Callable[[], tuple[Any, Callable, Callable]]:
    if spec == BUILTIN_MODEL:
        return tiny_transformer
    mod_name, _, fn_name = spec.partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)


# --------------------------------------------------------------------------------------------------
# the per-rank side (run through certckpt.detect.launch.run_ranks)


def _to_device(obj: Any, device) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of the sweep (``args``: see :func:`run_envelope`). Rank 0's timings are the ones reported."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.detect.auditor import Auditor
    from certckpt.detect.events import MemorySink
    from certckpt.detect.launch import ProgressLog

    rank, world = dist.get_rank(), dist.get_world_size()
    mode, backend, device_kind = args["mode"], args["backend"], args["device"]
    if mode == "deterministic":
        torch.use_deterministic_algorithms(True)
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = dist.new_group(backend=backend) if backend != "gloo" else None
    t_start = time.perf_counter()
    log = ProgressLog(args.get("progress"), rank=rank)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    def timed(fn: Callable[[], Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    model, batch_fn, loss_fn = _load_factory(args["model"])()
    model = model.to(device)
    ddp_kw: dict[str, Any] = {"process_group": group}
    if device.type == "cuda":
        ddp_kw["device_ids"] = [device.index]

    def make_copy():
        m = copy.deepcopy(model)
        ddp = DDP(m, **ddp_kw)
        return ddp, torch.optim.AdamW(m.parameters(), lr=1e-4)

    plain, plain_opt = make_copy()
    bare = plain.module
    params = [p for p in bare.parameters() if p.requires_grad]
    auditors: dict[int, Auditor] = {}
    for k in args["audit_every"]:
        ddp, opt = make_copy()
        auditors[k] = Auditor(ddp, opt, loss_fn=loss_fn, run="envelope", audit_every=k, mode=mode, sink=MemorySink())
    n_params = sum(p.numel() for p in params)
    log(f"built {1 + len(auditors)} DDP copies of {n_params:,} parameters on {world} rank(s) ({backend}, {device})")

    def plain_block(batches) -> None:
        for b in batches:
            plain_opt.zero_grad(set_to_none=True)
            loss_fn(plain, b).backward()
            plain_opt.step()

    def fb_block(batches) -> None:
        for b in batches:
            torch.autograd.grad(loss_fn(bare, b), params, allow_unused=True)

    def audited_block(aud: Auditor, batches, *, with_audit: bool) -> None:
        # Move the step counter forward (never back) so that the block's len(batches) steps hold no
        # audit step, or exactly one, its last: needs len(batches) <= K - 1, resp. <= K.
        k, m = aud.audit_every, len(batches)
        if with_audit:
            aud.step = -(-(aud.step + m) // k) * k - m  # the block ends on the first multiple of K it can
        else:
            aud.step = -(-aud.step // k) * k  # the block starts right after a multiple of K
        for b in batches:
            aud.train_step(b)
        assert aud.last.audited == with_audit

    def consensus_block(aud: Auditor, m: int) -> None:
        for _ in range(m):
            aud._weight_consensus(aud.step)

    ks = list(auditors)
    names = ["plain", "fb"] + [f"{kind}/{k}" for k in ks for kind in ("nonaudit", "cycle", "consensus")]
    flag = torch.zeros(1, dtype=torch.int64)
    shapes_out = []
    data_step = 0
    n_combos = len(args["shapes"]) * len(auditors)
    done_combos = 0
    for si, (seq_len, micro_batch) in enumerate(args["shapes"]):
        raw: dict[str, list[float]] = {n: [] for n in names}
        warmup = args["warmup"] + (1 if si == 0 else 0)
        shape_t0 = time.perf_counter()
        trial, block = 0, 1  # the first trial (a warm-up) is timed in single steps to size the blocks
        min_trials, max_trials = args["steps"], max(args["steps"], MAX_TRIALS)
        while True:
            batches = []
            for _ in range(block):
                data_step += 1
                batches.append(_to_device(batch_fn(rank, data_step, seq_len, micro_batch), device))
            shift = trial % len(names)
            got: dict[str, float] = {}
            for n in names[shift:] + names[:shift]:
                if n == "plain":
                    got[n] = timed(lambda: plain_block(batches)) / block
                elif n == "fb":
                    got[n] = timed(lambda: fb_block(batches)) / block
                else:
                    kind, k = n.split("/")
                    aud = auditors[int(k)]
                    if kind == "consensus":
                        got[n] = timed(lambda aud=aud: consensus_block(aud, block)) / block
                    else:
                        got[n] = timed(lambda aud=aud, kind=kind: audited_block(aud, batches, with_audit=kind == "cycle"))
            if trial == 0:
                if rank == 0:  # blocks of about BLOCK_S seconds, each K's non-audit block free of audits
                    flag.fill_(max(1, min(min(ks) - 1, round(args["block_s"] / max(got["plain"], 1e-6)))))
                dist.broadcast(flag, 0)
                block = int(flag)
            trial += 1
            if trial > warmup:
                for n, v in got.items():
                    raw[n].append(v)
            kept = trial - warmup
            if rank == 0:
                more = kept < min_trials or (kept < max_trials and time.perf_counter() - shape_t0 < args["min_shape_s"])
                flag.fill_(1 if more else 0)
            dist.broadcast(flag, 0)  # rank 0 decides, every rank follows (default gloo group)
            if not int(flag):
                break
        # Per trial: N = non-audit block / m; the audit step A = N + (cycle block - non-audit block),
        # both blocks m steps long, so that the barriers' share is the same in every figure.
        samples: dict[str, list[float]] = {"plain": raw["plain"], "fb": raw["fb"]}
        for k in ks:
            na, cy = raw[f"nonaudit/{k}"], raw[f"cycle/{k}"]
            samples[f"nonaudit/{k}"] = [x / block for x in na]
            samples[f"audit/{k}"] = [x / block + (c - x) for x, c in zip(na, cy)]
            samples[f"consensus/{k}"] = raw[f"consensus/{k}"]
        mean = {n: trimmed_mean(v) for n, v in samples.items()}
        raw_mean = {n: statistics.fmean(v) for n, v in samples.items()}
        combos = []
        for k in ks:
            f = figures(plain_s=mean["plain"], nonaudit_s=mean[f"nonaudit/{k}"], audit_s=mean[f"audit/{k}"],
                        consensus_s=mean[f"consensus/{k}"], fb_s=mean["fb"], audit_every=k)
            f["premium_se"] = premium_se(plain=samples["plain"], nonaudit=samples[f"nonaudit/{k}"], audit=samples[f"audit/{k}"], audit_every=k)
            if f["premium_se"] is not None and f["premium"] <= 2 * f["premium_se"]:
                f["shares"] = None  # a premium within noise has no meaningful split (shares would exceed 100%)
            combos.append({"seq_len": seq_len, "micro_batch": micro_batch, "audit_every": k, **f})
            done_combos += 1
            log(f"{done_combos}/{n_combos}  {describe(combos[-1])}: plain {f['plain_s'] * 1e3:.2f} ms, audited "
                f"{f['audited_s'] * 1e3:.2f} ms, premium {f['premium']:+.1%}{_se(f['premium_se'])} "
                f"({kept} trials of {block}-step blocks, {warmup} warm-up)")
        shapes_out.append({"seq_len": seq_len, "micro_batch": micro_batch, "trials": kept, "warmup": warmup, "block": block,
                           "seconds": time.perf_counter() - shape_t0, "mean_s": mean, "untrimmed_mean_s": raw_mean,
                           "samples_s": samples, "combinations": combos})
    log.close()
    return {
        "rank": rank,
        "params": n_params,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "shapes": shapes_out,
        "events": {k: len(a.sink.events) for k, a in auditors.items()},
        "rank_elapsed_s": time.perf_counter() - t_start,
    }


# --------------------------------------------------------------------------------------------------
# the driver


@dataclass(frozen=True, kw_only=True)
class EnvelopeConfig:
    """One sweep. ``steps``: timed trials per shape, at least; ``warmup``: discarded trials per shape."""

    seq_lens: tuple[int, ...] = FULL["seq_lens"]
    micro_batches: tuple[int, ...] = FULL["micro_batches"]
    audit_every: tuple[int, ...] = FULL["audit_every"]
    ranks: int = 3
    model: str = BUILTIN_MODEL
    max_premium: float = 0.05
    steps: int = FULL["steps"]
    warmup: int = 1
    min_shape_s: float = FULL["min_shape_s"]
    mode: str = "deterministic"
    backend: str = "gloo"
    device: str = "cpu"
    timeout_s: float = 4 * 3600
    extra_path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("seq_lens", "micro_batches", "audit_every"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ValueError(f"{name}: expected positive integers, got {vals!r}")
        if any(k < 2 for k in self.audit_every):
            raise ValueError("audit_every: every K must be >= 2 (with K = 1 every step is an audit step; there is no"
                             " non-audit step to separate the non-finite checks' share)")
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError("steps and warmup must be >= 1 (the first warm-up trial sizes the blocks)")
        if not math.isfinite(self.max_premium):
            raise ValueError(f"max_premium must be a finite number, got {self.max_premium!r}")
        if self.mode not in ("deterministic", "tolerance"):
            raise ValueError(f"mode must be 'deterministic' or 'tolerance', got {self.mode!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend nccl needs device cuda")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return [(s, b) for s in self.seq_lens for b in self.micro_batches]


def run_envelope(config: EnvelopeConfig, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sweep on ``config.ranks`` local processes and return the report (the ``--json`` document).

    Raises:
        certckpt.detect.launch.RanksFailedError: a rank failed (its output tail is in the message).
    """
    from certckpt.detect.launch import follow, run_ranks

    t0 = time.perf_counter()
    load0 = _loadavg()
    with tempfile.TemporaryDirectory(prefix="certckpt-envelope-") as d:
        prog = os.path.join(d, "progress.log")
        open(prog, "w").close()  # noqa: SIM115
        stop = threading.Event()
        tail = threading.Thread(target=follow, args=(prog, stop, progress), daemon=True) if progress else None
        if tail:
            tail.start()
        args = {
            "shapes": config.shapes,
            "audit_every": list(config.audit_every),
            "model": config.model,
            "steps": config.steps,
            "warmup": config.warmup,
            "min_shape_s": config.min_shape_s,
            "block_s": BLOCK_S,
            "mode": config.mode,
            "backend": config.backend,
            "device": config.device,
            "progress": prog,
        }
        try:
            per_rank = run_ranks("certckpt.tools.envelope:rank_main", config.ranks, args, timeout=config.timeout_s, extra_path=config.extra_path)
        finally:
            stop.set()
            if tail:
                tail.join(timeout=5)
    elapsed = time.perf_counter() - t0
    report = build_report(config, per_rank[0], elapsed_s=elapsed)
    report["loadavg_start"], report["loadavg_end"] = load0, _loadavg()
    return report


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def build_report(config: EnvelopeConfig, r0: Mapping[str, Any], *, elapsed_s: float) -> dict[str, Any]:
    """The JSON document from rank 0's result (pure)."""
    combos = []
    for shape in r0["shapes"]:
        for c in shape["combinations"]:
            c = dict(c)
            c["over_budget"] = c["premium"] > config.max_premium
            c["trials"] = shape["trials"]
            combos.append(c)
    means = [{"seq_len": s["seq_len"], "micro_batch": s["micro_batch"], "trials": s["trials"], "warmup": s["warmup"],
              "block": s["block"], "mean_s": s["mean_s"], "untrimmed_mean_s": s["untrimmed_mean_s"]} for s in r0["shapes"]]
    return {
        "ranks": config.ranks,
        "model": config.model,
        "max_premium": config.max_premium,
        "combinations": combos,
        "over_budget": over_budget(combos, config.max_premium),
        "params": r0["params"],
        "mode": config.mode,
        "backend": config.backend,
        "device": config.device,
        "deterministic_algorithms": r0["deterministic"],
        "torch": r0["torch"],
        "threads_per_rank": r0["torch_threads"],
        "cpus": os.cpu_count(),
        "steps": config.steps,
        "warmup": config.warmup,
        "trim": TRIM,
        "measurements": means,
        "elapsed_s": elapsed_s,
    }


def _se(v: float | None) -> str:
    return "" if v is None else f" ±{v * 100:.1f}"


def _load(v: Sequence[float] | None) -> str:
    return "?" if not v else "/".join(f"{x:.1f}" for x in v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f}%"


def format_table(report: Mapping[str, Any]) -> str:
    """The report for people: a header and one row per combination."""
    lines = [
        f"performance envelope: {report['model']} ({report['params']:,} parameters), {report['ranks']} rank(s), "
        f"{report['backend']} on {report['device']}, {report['threads_per_rank']} torch thread(s) per rank, {report['cpus']} CPUs, "
        f"{report['mode']} audits",
        f"load average {_load(report.get('loadavg_start'))} at start, {_load(report.get('loadavg_end'))} at end "
        f"({report['cpus']} CPUs; other jobs on the machine make every figure noisier)",
        f"plain/audited: mean step time, {report.get('trim', TRIM):.0%} trimmed at each end (audited: one K-step cycle, "
        "K-1 non-audit steps + 1 audit step); premium = (audited - plain) / plain;",
        "± one standard error; shares of the premium: replay / consensus / non-finite checks;",
        "replay floor = forward+backward share of a plain step / K",
        "",
    ]
    head = ("seq", "mb", "K", "trials", "plain ms", "audited ms", "premium", "replay", "consensus", "nonfinite", "floor", "")
    rows = []
    for c in report["combinations"]:
        sh = c["shares"] or {}
        rows.append((
            str(c["seq_len"]), str(c["micro_batch"]), str(c["audit_every"]), str(c.get("trials", "")),
            f"{c['plain_s'] * 1e3:.2f}", f"{c['audited_s'] * 1e3:.2f}", _pct(c["premium"]) + _se(c.get("premium_se")),
            *(f"{sh[n]:.0%}" if n in sh else "-" for n in ("replay", "consensus", "nonfinite")),
            _pct(c["replay_floor"]), "OVER" if c["over_budget"] else "",
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    right = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
    fmt = lambda r: "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))).rstrip()  # noqa: E731
    lines.append(fmt(head))
    lines.extend(fmt(r) for r in rows)
    lines.append("")
    if any(c["shares"] is None for c in report["combinations"]):
        lines.append("shares '-': premium at or below zero (within measurement noise)")
    ob = report["over_budget"]
    if ob:
        lines.append(f"OVER BUDGET (premium > {report['max_premium']:.1%}): " + "; ".join(f"{describe(c)} ({_pct(c['premium'])})" for c in ob))
    else:
        lines.append(f"every premium within {report['max_premium']:.1%}")
    lines.append(f"measured in {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the plot


def require_matplotlib() -> None:
    """Raise MissingDependencyError now (before a long sweep) when matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'certckpt[report]'")


def plot(report: Mapping[str, Any], out_path: str | os.PathLike) -> str:
    """Draw premium against K, one line per (seq_len, micro_batch) shape with one-standard-error bars,
    the budget as a dashed line; PNG.

    Raises:
        ValueError: ``out_path`` does not end in ``.png``. MissingDependencyError: no matplotlib.
    """
    path = os.fspath(out_path)
    if os.path.splitext(path)[1].lower() != ".png":
        raise ValueError(f"{path}: --plot writes PNG; give a path ending in .png")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(f"--plot needs matplotlib: pip install 'certckpt[report]' ({e})") from e

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shapes: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for c in report["combinations"]:
        se = c.get("premium_se")
        shapes.setdefault((c["seq_len"], c["micro_batch"]), []).append((c["audit_every"], c["premium"], se if se is not None else 0.0))
    ks = sorted({c["audit_every"] for c in report["combinations"]})
    for (s, b), pts in shapes.items():
        pts.sort()
        ax.errorbar([k for k, _, _ in pts], [p * 100 for _, p, _ in pts], yerr=[e * 100 for _, _, e in pts],
                    marker="o", capsize=3, label=f"seq {s} x mb {b}")
    ax.axhline(report["max_premium"] * 100, color="red", linestyle="--", linewidth=1, label=f"budget {report['max_premium']:.1%}")
    ax.axhline(0, color="grey", linewidth=0.5)
    if ks and ks[-1] / max(ks[0], 1) >= 10:
        ax.set_xscale("log")
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("audit every K steps")
    ax.set_ylabel("premium over plain DDP (%)")
    ax.set_title(f"audit premium: {report['model']}, {report['ranks']} rank(s), {report['backend']}/{report['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    write_atomic(path, buf.getvalue())
    return path


def to_json(report: Mapping[str, Any]) -> str:
    return json.dumps(report, indent=2)

