"""The audit session: the three detection checks of a DDP run, driven from any training loop.

``AuditSession`` holds everything the checks need (the communication hook, the replay, the weight
consensus, events, incidents and checkpoint evidence) and exposes it at the points every loop has:

- ``begin_micro_batch(unit)`` before each micro-batch's forward pass;
- ``before_update()`` after the step's last backward, before the optimizer steps: the
  non-finite checks and, every ``audit_every`` steps, the ring replay audit (returns whether the
  update may be applied; a refused update's gradients are dropped);
- ``after_update()`` after it: the weight consensus at audit and consensus steps (returns whether
  it agreed, as ``ShardedAuditSession.after_update`` does);
- ``checkpoint_evidence()`` where a checkpoint is taken (collective): the consensus on the weights'
  fingerprints and the lineage the checkpoint's record carries.

A framework that owns the loop (Lightning, the Hugging Face ``Trainer``) calls these from its
callbacks; its backward divides each micro-batch's loss by its accumulation count, so the hook
averages the reduced buckets over the ranks as DDP does. ``certckpt.detect.auditor.Auditor`` is
the loop certckpt runs itself (``train_step``), built on the same session.

The checks themselves are objects the session owns, one module each: ``setup_checks`` (the
set-up refusals, ``session.setup``), ``nonfinite`` (check 1, ``session.nonfinite``), ``replay``
(check 2, the ring replay, ``session.replay``) and ``consensus`` (check 3, the weight consensus,
``session.consensus``). Each is built on one ``context.CheckContext`` (what they share, fixed at
construction: the ``AuditOptions`` among it), whose ``DDPState`` is the one place the session's
mutable state lives; ``evidence`` holds what the session reports. What the session shares with the
sharded one (start-up, options agreed by every rank, ledger and sink, node inventory, fleet check,
step counters, lineage, ``flush``/``close``) is ``core.AuditSessionCore``, its base class. This
module is their public home: it re-exports the names callers import from it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import CertckptError, CheckpointExistsError, ConfigurationError
from certckpt.format.asyncsave import AsyncSaver, SaveFuture
from certckpt.format.record import RecordFields
from certckpt.format.writer import SaveResult, save_certified
from certckpt.storage import storage_of
from certckpt.trust.commit import commit_saved, name_taken

from .consensus import WeightConsensus, consensus_buffers
from .context import CheckContext, DDPState, StateField
from .core import AuditSessionCore
from .events import EventSink
from .evidence import CheckpointEvidence, StepOutcome
from .exchange import RingShift
from .hook import HookState, comm_hook, hand_over_possible, lazy_pre_possible
from .inject import Injector
from .letgo import released
from .nonfinite import NonFiniteCheck
from .options import SHARDED_ONLY, AuditOptions, Mode
from .replay import RingReplay, restore_rng
from .setup_checks import SetupChecks, option_problem
from .signature import Probes
from .trigger import SentinelCheck

__all__ = [
    "AuditSession",
    "CheckpointEvidence",
    "StepOutcome",
    "restore_rng",
    "unwrap_compiled",
    "consensus_buffers",
]


def unwrap_compiled(model: Any) -> tuple[bool, Any]:
    """``(compiled, ddp)``: ``torch.compile(DDP(m))`` is an ``OptimizedModule`` around the DDP model.

    The wrapper is recognised by name and its ``_orig_mod`` (torch's attribute for the module it
    compiles), so that this file need not import ``torch._dynamo``.
    """
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, DistributedDataParallel):
        return True, inner
    return False, model


class AuditSession(AuditSessionCore):
    """The checks of one DDP run, called at the hook points of a loop (see the module docstring).

    Every rank constructs one (a collective: the ranks agree on the set-up or all refuse together)
    after the DDP model exists and before its first backward. Per optimizer step, every rank calls
    ``begin_micro_batch(unit)`` before each micro-batch's forward, ``before_update()`` after
    the last backward and ``after_update()`` after the optimizer stepped;
    ``checkpoint_evidence()`` where a checkpoint is taken. ``loss_fn(module, unit)`` must recompute
    what the loop computed for ``unit`` (it is called on the bare module for replays). Example::

        session = AuditSession(ddp, opt, loss_fn=lambda m, u: F.mse_loss(m(u[0]), u[1]), ledger="ckpt",
                               hand_over_grads=False)
        for batch in loader:
            session.begin_micro_batch(batch)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ddp(batch[0]), batch[1]).backward()
            if session.before_update():
                opt.step()
            session.after_update()

    Pass ``hand_over_grads=False`` when the loop zeroes gradients itself (the hand-over relies on
    every step starting with ``zero_grad(set_to_none=True)``). ``certckpt.detect.Auditor`` is the
    same session running its own loop (``train_step``).

    Args:
        model: the ``DistributedDataParallel`` model (the hook is registered on it; register no other),
            or ``torch.compile`` of one (training runs through the compiled wrapper, replays through
            the eager module; ``DDP(torch.compile(m))`` replays through the compiled module).
        optimizer: its optimizer.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; called with the DDP model for training and
            with the bare module for replays. Must be a pure function of the weights, the batch and
            the RNG state (dropout is fine: the RNG state travels with the batch).
        run: run name recorded in events and checkpoints.
        branch: line of training (a new one after each rollback).
        options: an ``AuditOptions``: how the checks run (interval, mode, policies, clipping,
            scaler, ...); each of its fields may also be given as a keyword (``audit_every=10``),
            applied on top of ``options``.
        sink: where events go (rank 0 emits them); default an in-memory sink (``auditor.sink.events``).
        injector_faults: synthetic faults for drills (see ``certckpt.detect.inject``).
        start_step: the optimizer step count already done (when resuming).
        ledger: a ``certckpt.Ledger`` (or its store URL): rank 0 batches events into it and commits
            every checkpoint saved through the auditor (default sink then: the ledger).
        parent: the checkpoint id this branch resumed from (a rollback); recorded in the ledger and in
            every checkpoint's record.
        signing_key: sign every checkpoint file and ledger record written (``docs/signing.md``): a
            ``SigningKey`` or a private key file; default ``$CERTCKPT_SIGNING_KEY``, if set.
        expect_consensus_fp: when resuming, the consensus fingerprint of the checkpoint loaded
            (``certckpt.plan_resume(...).consensus_fp``): the replicas' weights (and buffers) are
            fingerprinted at the start and must agree on exactly it, else every rank refuses to
            start (a wrong, partial or damaged load).
    """

    STATE: ClassVar[type[DDPState]] = DDPState
    UNUSED = SHARDED_ONLY
    NAME = "the DDP auditor"
    SETUP = "Auditor set-up"
    state: DDPState

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        run: str = "run",
        branch: str = "main",
        options: AuditOptions | None = None,
        sink: EventSink | None = None,
        injector_faults: list | None = None,
        start_step: int = 0,
        ledger: Any = None,
        parent: str | None = None,
        signing_key: Any = None,
        expect_consensus_fp: str | None = None,
        **shorthand: Any,
    ):
        compiled, ddp = unwrap_compiled(model)
        super().__init__(
            ddp,
            optimizer,
            group=ddp.process_group if isinstance(ddp, DistributedDataParallel) else None,
            options=options,
            shorthand=shorthand,
            problem=lambda opts: option_problem(ddp, opts),
            run=run,
            branch=branch,
            parent=parent,
            sink=sink,
            ledger=ledger,
            signing_key=signing_key,
            start_step=start_step,
        )
        opts = self.options
        self.loss_fn = loss_fn
        # The object the user passed: ``torch.compile(DDP(m))`` trains through the compiled wrapper.
        self.train_model = model if compiled else ddp
        self._saver: AsyncSaver | None = None  # rank 0's background writer, made at the first async_save
        self._in_flight: CheckpointEvidence | None = None  # the evidence of the async_save in flight (every rank)
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # Buffers (see ``consensus_buffers``; the consensus seals the broadcast source's copy).
        broadcast = bool(getattr(ddp, "broadcast_buffers", False))
        self.buffer_names, self.buffers = consensus_buffers(ddp.module, broadcast=broadcast)
        self.injector = Injector(injector_faults or [], rank=self.rank) if injector_faults else None
        if self.injector is not None:
            self.injector.install(ddp.module)
        self._hand_over = opts.hand_over_grads and hand_over_possible(ddp)
        self._hook = HookState(
            names=self.param_names,
            index={id(p): i for i, p in enumerate(self.params)},
            mode=opts.mode.value,
            probes=Probes(self.params) if opts.mode is Mode.TOLERANCE else None,
            injector=self.injector,
            group=self.group,
            eager_pre=not lazy_pre_possible(ddp, self.device),
            hand_over=self._hand_over,
        )
        # At the first step whose gradients are finite, the rank replays its own step and compares
        # with what training computed: a replay path that computes differently from training
        # (torch.compile around DDP, a loss_fn that treats the bare module differently) is refused
        # then, on every rank, instead of raising a false alarm at every audit.
        self.state.path_check_pending = opts.check_determinism
        # A disabled scaler (GradScaler(enabled=False)) scales nothing and never overflows.
        scaler = opts.grad_scaler
        enabled = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
        self.ctx = CheckContext(
            **self.context_fields(),
            model=ddp,
            loss_fn=loss_fn,
            grad_scaler=scaler if enabled else None,
            param_names=self.param_names,
            params=self.params,
            not_in_optimizer=[p for p in self.params if id(p) not in owned],
            buffer_names=self.buffer_names,
            buffers=self.buffers,
            broadcast_buffers=broadcast,
            probes=self._hook.probes,
            hook=self._hook,
            injector=self.injector,
        )
        # The checks, each on the shared context; the session's methods below drive them.
        self.consensus = WeightConsensus(self.ctx)
        self.replay = RingReplay(self.ctx, consensus=self.consensus)
        self.sentinels = SentinelCheck(self.ctx, replay=self.replay)
        self.nonfinite = NonFiniteCheck(self.ctx, replay=self.replay, sentinels=self.sentinels)
        self.setup = SetupChecks(self.ctx, consensus=self.consensus, replay=self.replay)
        self.join(expect_consensus_fp=expect_consensus_fp)
        # recorded only once the resumed weights are known to be the parent's
        if self.ledger is not None and self.parent is not None and self.rank == 0:
            self.ledger.start_branch(self.branch, parent=self.parent)

    def agree(self) -> None:
        """The ranks agree on the parameters and settings (collective); then the hook goes in."""
        self.setup.check_world_agrees()
        self.model.register_comm_hook(self._hook, comm_hook)
        if self._hand_over:
            self.model.reducer._set_optimizer_in_backward()

    def prove_resumed(self, expected: str) -> None:
        self.setup.check_resumed_weights(expected, parent=self.parent)

    # --- the mutable state, kept in ``self.state`` (and the core's ``step``, ...) ----------------

    # what happened at the step under way or the last one (None before the first)
    last = StateField[StepOutcome | None]()

    # --- the step ---------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.options.audit_every == 0

    def weight_consensus(self, s: int, *, found_by: str | None = None, fingerprints: bool = False) -> bool:
        """Compare every replica's weights (collective); returns whether they agree.

        Audits compare 32-bit audit digests (``digest.py``). A checkpoint step (``fingerprints=True``)
        compares the 64-bit fingerprints instead, which the checkpoint writer then reuses, and its
        pass event carries the state fingerprint the certifier matches against the file.
        """
        self.nonfinite.settle_deferred()  # no consensus vouches for weights a pending non-finite step updated
        return self.consensus.check(s, found_by=found_by, fingerprints=fingerprints)

    def consensus_fingerprints(self) -> dict[str, str] | None:
        """Per-parameter fingerprints every replica agreed on at the current step, if checked."""
        agreed = self.state.agreed_at(self.state.step)
        return dict(agreed[0]) if agreed is not None else None

    # --- hook points for a loop someone else runs -------------------------------------------

    def begin_micro_batch(self, unit: Any, *, loss_averaged: bool = False) -> None:
        """Call on every rank before each micro-batch's forward pass (each of an optimizer step's).

        The first call of a step prepares it: the gradients of parameters the optimizer does not own
        are dropped (the loop's ``zero_grad`` leaves them to accumulate, and a replay recomputes one
        step), the hook is told whether to sign the local gradients (audit steps) and to average the
        reduced buckets over the ranks (the loop back-propagates its loss without dividing it by the
        world size, as with plain DDP), and the broadcast source's buffer seal is checked. Each call
        keeps ``unit`` (by reference: do not modify it in place) and, when the step will be replayed,
        the RNG state.

        Args:
            loss_averaged: the loop back-propagates this micro-batch's loss through
                ``hook.average_over_ranks`` (the averaging over the ranks is in the loss, and the hook
                leaves the reduced gradients as the all-reduce sums them); every micro-batch of a step
                says the same.

        Raises:
            ConfigurationError: the session has a ``grad_scaler``: telling an overflow from a fault
                is done by ``Auditor.train_step`` only (here a non-finite step would be a detection).
        """
        ctx, state = self.ctx, self.state
        if ctx.grad_scaler is not None:
            raise ConfigurationError(
                "grad_scaler is handled by Auditor.train_step only; at the hook points an overflow would read as a"
                " fault: construct the session without grad_scaler (fp16 with a scaler is not audited here)"
            )
        if state.open is None:
            s = state.step + 1
            audit = self.is_audit_step(s)
            state.last = StepOutcome(step=s, audited=audit)
            sign = audit or state.path_check_pending
            for p in ctx.not_in_optimizer:
                p.grad = None
            state.loss_averaged = loss_averaged
            average = 1.0 / ctx.world if ctx.world > 1 and not loss_averaged else None
            ctx.hook.reset(audit=sign, average=average)
            if ctx.injector is not None:
                ctx.injector.begin(s, "train")
            if self.consensus.seal_source:
                self.consensus.check_seal()  # before the forward, where DDP broadcasts rank 0's buffers
            # the RNG states at every step when a sentinel may have the step replayed
            keep_rng = audit or sign or state.first_step or self.sentinels.active
            state.open = {"s": s, "audit": audit, "units": [], "rngs": [], "rng": keep_rng}
        elif loss_averaged != state.loss_averaged:
            raise ConfigurationError(
                "the micro-batches of one step must all average their loss over the ranks, or none: compute every "
                "micro-batch's loss the same way (AcceleratorAudit: always through audit.loss, or always through "
                "audit.note and your own loss)"
            )
        state.open["units"].append(unit)
        if state.open["rng"]:
            state.open["rngs"].append(ctx.rng_state())

    def after_backward(self) -> None:
        """Optionally, on every rank right after the step's last backward (the one that reduced the
        gradients): the sentinels' exchange (the non-finite flags ride along) starts now, or with
        ``exchange_flags="every-step"`` the flags' alone, while the loop goes on to clip, and
        ``before_update`` reads it done (``NonFiniteCheck.exchange_early``).
        Call no collective that changes the gradients in between."""
        step = self.state.open
        if step is not None:
            self.nonfinite.exchange_early(step["s"])

    def before_update(self, *, loss_divisor: int | None = None) -> bool:
        """Call on every rank after the step's last backward, before the optimizer step.

        Runs the non-finite checks and, on audit steps, the ring replay audit of the step's
        micro-batches (with the weights before the update; ``.grad`` is left as it is). At the first
        step it also makes the set-up checks every rank decides together (the batch can travel to a
        neighbour; the model computes deterministically; a replay reproduces training).

        Args:
            loss_divisor: what the loop divided each micro-batch's loss by before its backward
                (Lightning: ``accumulate_grad_batches``, even for a shorter last window); default:
                the number of micro-batches.

        Returns:
            Whether the update may be applied. False (policies ``on_nonfinite="skip"``,
            ``on_fault="continue"``): every gradient was dropped (``.grad`` is None), so a
            ``torch.optim`` optimizer leaves the weights alone.

        Raises:
            FaultDetectedError: a check failed and the policy is to raise (gradients dropped).
            AuditSetupError, UnsupportedObjectError: a first-step check refused, on every rank.
            ConfigurationError: no ``begin_micro_batch`` since the last step.
        """
        ctx, state = self.ctx, self.state
        step = state.open
        if step is None:
            raise ConfigurationError("before_update without begin_micro_batch: call it before each forward")
        s, units, rngs = step["s"], step["units"], step["rngs"] or None
        n = loss_divisor or len(units)
        if self.consensus.seal_source:
            self.consensus.seal()
        if state.first_step:
            self.setup.first_step_checks(units, True)
            state.first_step = False
        failed = self.nonfinite.due(s, now=self.nonfinite.must_read_now(s, audit=step["audit"]))
        state.step = s  # the step is attempted from here on, applied or not
        if failed is not None:
            self.nonfinite.detected(*failed)  # raises, or drops the gradients (skip)
            return False
        state.checked_since_audit += 1
        rng = rngs[0] if rngs else None
        if state.path_check_pending:
            self.replay.check_path(s, units, True, rng, n_total=n, rngs=rngs)
        decision = self.sentinels.decide(s, self.nonfinite.table, replaying=step["audit"])
        payload = {"units": units, "micro": True, "n": n, "rng": rng, "rngs": rngs}
        if step["audit"]:
            t0 = time.perf_counter()
            prev = RingShift(payload, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
            passed = self.replay.audit(s, units, prev, payload=payload)
            state.audit_seconds = time.perf_counter() - t0
            if not passed:
                return False
        elif decision is not None and decision.replay:
            return self.sentinels.replay_now(s, units, payload, decision)
        return True

    def after_update(self) -> bool:
        """Call on every rank after the optimizer step (also when ``before_update`` refused
        the update): the weight consensus at audit steps and every ``consensus_every`` steps.

        Returns:
            Whether the weight consensus that ran here agreed: False when the replicas disagree and
            the policy is ``on_fault="continue"`` (with ``"raise"`` it raises). True when none ran
            (a step without a consensus, or an update refused, which changed no weight). The same
            for ``ShardedAuditSession.after_update``.

        Raises:
            FaultDetectedError: the replicas disagree (policy ``on_fault="raise"``).
        """
        ctx, state = self.ctx, self.state
        step, state.open = state.open, None
        if step is None or state.last is None or not state.last.applied:
            return True
        s = step["s"]
        if ctx.injector is not None:
            ctx.injector.after_optimizer(list(zip(ctx.param_names, ctx.params)))
            ctx.injector.after_optimizer_buffers(list(zip(ctx.buffer_names, ctx.buffers)))
        due = step["audit"] or (self.consensus_every is not None and s % self.consensus_every == 0)
        t0 = time.perf_counter()
        consensus_ok = self.weight_consensus(s) if due else True
        if step["audit"]:
            ctx.report.event("nonfinite", "pass", step=s, steps_checked=state.checked_since_audit)
            if consensus_ok:
                seconds = state.audit_seconds + time.perf_counter() - t0
                self.audit_passed(s, checked=state.checked_since_audit, seconds=seconds)
            state.checked_since_audit = 0
        return consensus_ok

    # --- checkpoints --------------------------------------------------------------------------

    def _evidence(self, s: int) -> CheckpointEvidence:
        """What a checkpoint at step s carries, from the consensus at s (run it first)."""
        agreed_at = self.state.agreed_at(s)
        fps, agreed = agreed_at if agreed_at is not None else ({}, None)
        # The tensors whose fingerprints every replica agreed on, by identity: the writer finds them
        # in the checkpoint's object (a state_dict's tensors share the parameters' storage) and
        # reuses their fingerprints instead of computing them again.
        known = {
            (p.data_ptr(), p.dtype, tuple(p.shape), p.stride(), str(p.device)): (n, fps[n])
            for n, p in zip(self.param_names + self.buffer_names, self.params + self.buffers)
            if n in fps
        }
        opts = self.options
        head = {"audit_every": opts.audit_every, "world": self.world, "mode": opts.mode.value}
        return self.evidence(s, head=head, consensus_fp=agreed, known_fingerprints=known)

    def _fingerprint_consensus(self) -> int:
        """Read a pending non-finite check, then run the fingerprint consensus at the current step
        unless it ran already; returns the step."""
        self.nonfinite.settle_deferred()
        s = self.state.step
        if self.state.agreed_at(s) is None:
            self.weight_consensus(s, fingerprints=True)
        return s

    def checkpoint_evidence(self) -> CheckpointEvidence:
        """The evidence a checkpoint taken now carries (collective: every rank calls it).

        Runs the weight consensus on the 64-bit fingerprints at the current step unless it ran
        already, and hands over the lineage since the previous checkpoint (the next one starts a
        new lineage). The caller writes the checkpoint on one rank (``save_certified(...,
        **evidence.save_kwargs())``), flushes the sink (``flush``) and then commits it.

        Raises:
            FaultDetectedError: the replicas disagree (policy ``on_fault="raise"``).
        """
        s = self._fingerprint_consensus()
        evidence = self._evidence(s)
        self.end_lineage(s)
        return evidence

    def save(self, obj: Any, f: Any, **kwargs: Any) -> SaveResult | None:
        """Save a checkpoint at the current step with its audit lineage (collective; rank 0 writes).

        Runs the weight consensus at this step if it has not run yet, and hands its fingerprints to
        the writer, which does not compute them again.

        Returns:
            ``SaveResult`` on rank 0, None elsewhere.
        """
        s = self._fingerprint_consensus()
        evidence = self._evidence(s)
        result, error = None, None
        previous = self._previous_save_failure()  # rank 0: an async_save still in flight ends first
        if self.rank == 0 and previous is None:
            try:
                result = self._write(obj, f, evidence, kwargs)
            except Exception as e:
                error = e
        self._agree_on_write(previous or error, f, s, previous_failed=previous is not None)
        self.end_lineage(s)
        return result

    def async_save(self, obj: Any, f: Any, **kwargs: Any) -> SaveFuture | None:
        """``save`` that returns once rank 0 has snapshotted ``obj`` (collective; rank 0 writes).

        The consensus, the evidence and the lineage are as ``save``'s, at this step; rank 0 then
        copies every tensor into staging memory it keeps between saves (``certckpt.AsyncSaver``,
        one save in flight: the next one first waits for this one) and a background thread writes,
        publishes and commits the file. A background failure is raised by the future's
        ``result()``, or on every rank by the next ``async_save``/``save``, or by ``close()`` on
        rank 0.

        Returns:
            A ``SaveFuture`` on rank 0 (``result()`` gives the ``SaveResult`` once the file is
            durable and committed), None elsewhere.
        """
        s = self._fingerprint_consensus()
        evidence = self._evidence(s)
        future, error = None, None
        previous = self._previous_save_failure()  # rank 0: one save in flight; the previous one ends first
        if self.rank == 0 and previous is None:
            try:
                future = self._write_async(obj, f, evidence, kwargs)
            except Exception as e:
                error = e
        self._agree_on_write(previous or error, f, s, previous_failed=previous is not None)
        self.end_lineage(s)
        self._in_flight = evidence  # every rank: reopened should its background save fail
        return future

    def _previous_save_failure(self) -> Exception | None:
        """Rank 0: wait for the ``async_save`` in flight and return its failure nobody has seen (None
        elsewhere, or when it committed)."""
        if self.rank != 0 or self._saver is None:
            return None
        try:
            self._saver.wait()
        except Exception as e:
            return e
        return None

    def _agree_on_write(self, error: Exception | None, f: Any, s: int, *, previous_failed: bool = False) -> None:
        """Every rank learns whether rank 0's write succeeded, so all raise (or go on) together
        instead of the others hanging in the next collective. When the ``async_save`` before it failed
        in the background, every rank reopens that checkpoint's lineage: it was never committed."""
        code = 2 if previous_failed else 0 if error is None else 1
        status = torch.tensor([code], dtype=torch.int64, device=self.wire_device)
        # often the last collective before the script ends: gloo's worker drops it first (letgo)
        with released(status):
            dist.broadcast(status, dist.get_global_rank(self.group, 0), group=self.group)
        in_flight, self._in_flight = self._in_flight, None  # settled either way: rank 0 waited for it
        if int(status) == 2 and in_flight is not None:
            self.reopen_lineage(in_flight)
        if error is not None:
            raise error
        if int(status) != 0:
            raise CertckptError(
                f"rank {self.rank}: rank 0 could not write checkpoint {f!s} at step {s}; see rank 0's error"
            )

    def _write_async(self, obj: Any, f: Any, evidence: CheckpointEvidence, kwargs: dict[str, Any]) -> SaveFuture:
        """Rank 0's part of ``async_save``: the events flushed now, the file and its commit record
        in the background (the record only once the file is published)."""
        if self._saver is None:
            self._saver = AsyncSaver()
        self.sink.flush()  # the events up to this checkpoint reach the ledger before its commit record
        if self.ledger is not None:
            storage, name = storage_of(str(f))
            if storage.exists(name):
                raise name_taken(str(f), self.ledger.store)
        fields = evidence.record_fields()

        def commit(result: SaveResult) -> None:
            self._commit(f, fields, result)  # the events are in the ledger already (above)

        options = {"signing_key": self.signing_key, "overwrite": False, **kwargs}
        return self._saver.save(
            obj, f, fields=fields, known_fingerprints=evidence.known_fingerprints, then=commit, **options
        )

    def _write(self, obj: Any, f: Any, evidence: CheckpointEvidence, kwargs: dict[str, Any]) -> SaveResult:
        """Rank 0's part of ``save``: the file, the events before it, its commit record."""
        fields = evidence.record_fields()
        options = {"signing_key": self.signing_key, **kwargs}
        try:
            result = save_certified(obj, f, fields=fields, known_fingerprints=evidence.known_fingerprints, **options)
        except CheckpointExistsError as e:
            if self.ledger is None:
                raise
            raise name_taken(str(f), self.ledger.store) from e
        # the events up to this checkpoint reach the ledger before its commit record
        self._commit(f, fields, result, flush=self.sink.flush)
        return result

    def _commit(
        self, f: Any, fields: RecordFields, result: SaveResult, *, flush: Callable[[], object] | None = None
    ) -> None:
        """The commit record of a checkpoint file just published, after ``flush`` (without a ledger,
        only the flush). The branch's start was recorded at start-up."""
        if self.ledger is None:
            if flush is not None:
                flush()
            return
        # the record names the file as the caller gave it, as it always has
        commit_saved(
            self.ledger, dataclasses.replace(result, location=str(f)), fields, flush=flush, branch_started=True
        )

    def release(self) -> None:
        """At ``close``: a pending deferred read forgotten, the hook's kept gradients dropped, a
        drill's injector removed."""
        self.nonfinite.discard_pending()
        self._hook.kept = []
        if self.injector is not None:
            self.injector.remove()

    def close(self) -> None:
        """End the session on this rank (``AuditSessionCore.close``: not a collective, never raises
        for a check). On rank 0 it then waits for an ``async_save`` still being written and frees its
        staging memory; a background failure nobody looked at is raised then (``AsyncSaveError``),
        after the rest."""
        super().close()
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()
