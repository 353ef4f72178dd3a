"""The performance envelope: what the auditor costs per training step, across shapes and audit intervals.

Modules, one job each: :mod:`.stats` (the arithmetic, pure), :mod:`.models` (the model measured),
:mod:`.rank` (one rank's measurements; the only one that imports torch), :mod:`.sweep` (the
configuration, the rank job, the report) and :mod:`.output` (table, JSON, plot). This package
re-exports what the CLI and the tests use.

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
small causal transformer, :func:`.models.tiny_transformer`; ``--model MODULE:FACTORY`` plugs in
another) and wraps deep copies of it, so that every copy starts from the same weights and has the same
structure: one plain ``DistributedDataParallel`` copy (default comm hook) and, per K, one
``DistributedDataParallel`` copy driven by ``Auditor(audit_every=K)``. All copies train with AdamW.
The only difference between a plain and an audited copy is the auditor.

Per shape (L, B) the job runs interleaved trials; the first ``warmup`` trials (at least one) are
discarded, and the first shape gets one more (DDP rebuilds its buckets after the first step; the
auditor's first step runs its one-off determinism check). The first warm-up trial times single
steps and sizes the **block** m for the shape: about :data:`.sweep.BLOCK_S` seconds of plain steps,
at least 1 and at most ``min(K) - 1``. Each trial draws m batches, untimed, from
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
``consensus/K``    the auditor's weight consensus alone (``Auditor.weight_consensus``), m times
=================  ===========================================================================

Which step is an audit step depends only on the step number (``s % K == 0``), so the driver moves
the auditor's step counter forward (never back) to where the block it wants begins; the audited
work of each kind of step is exactly what training would do. Per trial, the non-audit step time
is ``nonaudit/K`` / m and the audit step time that plus ``cycle/K - nonaudit/K``: both blocks are m
steps long, so every figure carries the same share of barrier latency (with single steps between
barriers, that share alone made small steps look 25% slower here). Each figure is the **mean**
over the kept trials, trimmed: the :data:`.stats.TRIM` fraction at each end is dropped first
(:func:`trimmed_mean`; the untrimmed means are in the report too). A shape gets ``steps`` trials,
and more (up to :data:`.sweep.MAX_TRIALS`) while it has used less than ``min_shape_s`` seconds, so
that millisecond-sized shapes are not judged on a handful of samples.

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

from .models import resolve_model
from .output import format_table, plot, require_matplotlib, to_json
from .stats import exit_code, figures, over_budget, parse_int_list, premium_se, trimmed_mean
from .sweep import FULL, QUICK, EnvelopeConfig, build_report, run_envelope

__all__ = [
    "FULL",
    "QUICK",
    "EnvelopeConfig",
    "build_report",
    "exit_code",
    "figures",
    "format_table",
    "over_budget",
    "parse_int_list",
    "plot",
    "premium_se",
    "require_matplotlib",
    "resolve_model",
    "run_envelope",
    "to_json",
    "trimmed_mean",
]
