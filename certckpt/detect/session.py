"""The audit session: the three detection checks of a DDP run, driven from any training loop.

``AuditSession`` holds everything the checks need (the communication hook, the replay, the weight
consensus, events, incidents and checkpoint evidence) and exposes it at the points every loop has:

- ``begin_micro_batch(unit)`` before each micro-batch's forward pass;
- ``before_update()`` after the step's last backward, before the optimizer steps: the
  non-finite checks and, every ``audit_every`` steps, the ring replay audit (returns whether the
  update may be applied; a refused update's gradients are dropped);
- ``after_update()`` after it: the weight consensus at audit and consensus steps;
- ``checkpoint_evidence()`` where a checkpoint is taken (collective): the consensus on the weights'
  fingerprints and the lineage the checkpoint's record carries.

A framework that owns the loop (Lightning, the Hugging Face ``Trainer``) calls these from its
callbacks; its backward divides each micro-batch's loss by its accumulation count, so the hook
averages the reduced buckets over the ranks as DDP does. ``certckpt.detect.auditor.Auditor`` is
the loop certckpt runs itself (``train_step``), built on the same session.

The checks themselves are mixins the session inherits, one module each: ``setup_checks``
(the set-up refusals), ``nonfinite`` (check 1), ``replay`` (check 2, the ring replay) and
``consensus`` (check 3, the weight consensus); ``evidence`` holds what the session reports.
This module is their public home: it re-exports the names callers import from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import (
    AuditSetupError,
    CertckptError,
    CheckpointExistsError,
    ConfigurationError,
    FaultDetectedError,
)
from certckpt.format.signing import signing_key_for
from certckpt.format.writer import save_certified
from certckpt.trust.commit import name_taken
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import Ledger, LedgerSink

from .agreement import all_gather_bytes, refuse_together, wire_device_for
from .consensus import WeightConsensus, consensus_buffers
from .digest import digests
from .events import AuditEvent, EventSink, MemorySink, emit_event, log_audit_pass, rank_inventory
from .evidence import CheckpointEvidence, StepOutcome
from .exchange import RingShift
from .hook import HookState, comm_hook, hand_over_possible, lazy_pre_possible
from .inject import Injector
from .nonfinite import NonFiniteCheck
from .options import SHARDED_ONLY, AuditOptions, session_options
from .replay import RingReplay, restore_rng
from .setup_checks import SetupChecks, option_problem
from .signature import Probes

__all__ = [
    "AuditSession",
    "CheckpointEvidence",
    "StepOutcome",
    "restore_rng",
    "unwrap_compiled",
    "consensus_buffers",
]


_MAX_LINEAGE = 100_000  # audit results kept for one checkpoint's lineage (a bound, not a design limit)


def unwrap_compiled(model: Any) -> tuple[bool, Any]:
    """``(compiled, ddp)``: ``torch.compile(DDP(m))`` is an ``OptimizedModule`` around the DDP model.

    The wrapper is recognised by name and its ``_orig_mod`` (torch's attribute for the module it
    compiles), so that this file need not import ``torch._dynamo``.
    """
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, DistributedDataParallel):
        return True, inner
    return False, model


class AuditSession(SetupChecks, NonFiniteCheck, RingReplay, WeightConsensus):
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
        if not dist.is_available() or not dist.is_initialized():
            # No process group: nothing to agree with, and no rank can be waiting in a collective.
            raise AuditSetupError("torch.distributed is not initialized; call dist.init_process_group first")
        compiled, ddp = unwrap_compiled(model)
        group = ddp.process_group if isinstance(ddp, DistributedDataParallel) else dist.group.WORLD
        first = next((p for p in ddp.parameters()), None) if isinstance(ddp, torch.nn.Module) else None
        wire = wire_device_for(group, first.device if first is not None else torch.device("cpu"))
        opts, bad = session_options(options, shorthand, unused=SHARDED_ONLY, where="the DDP auditor")
        self.options = opts
        # plain values below (the enums are str: events and records hold the same text)
        audit_every, consensus_every, rtol = opts.audit_every, opts.consensus_every, opts.rtol
        mode, on_nonfinite, on_fault = opts.mode.value, opts.on_nonfinite.value, opts.on_fault.value
        exchange_flags, nonfinite_read = opts.exchange_flags.value, opts.nonfinite_read.value
        hand_over_grads, clip_grad_norm = opts.hand_over_grads, opts.clip_grad_norm
        before_optimizer_step, grad_scaler = opts.before_optimizer_step, opts.grad_scaler
        replay_micro_batches, check_determinism = opts.replay_micro_batches, opts.check_determinism
        # Every rank validates, then all decide together: a refusal on some ranks only would leave
        # the others waiting in the next collective.
        refuse_together(
            bad
            or option_problem(
                ddp,
                mode=mode,
                on_nonfinite=on_nonfinite,
                on_fault=on_fault,
                exchange_flags=exchange_flags,
                nonfinite_read=nonfinite_read,
                audit_every=audit_every,
                consensus_every=consensus_every,
                clip_grad_norm=clip_grad_norm,
                before_optimizer_step=before_optimizer_step,
                grad_scaler=grad_scaler,
                replay_micro_batches=replay_micro_batches,
            ),
            group=group,
            wire_device=wire,
            what="Auditor set-up",
        )
        self.model, self.optimizer, self.loss_fn = ddp, optimizer, loss_fn
        # The object the user passed: ``torch.compile(DDP(m))`` trains through the compiled wrapper.
        self.train_model = model if compiled else ddp
        self.run, self.branch, self.mode, self.rtol = run, branch, mode, rtol
        self.audit_every, self.consensus_every = audit_every, consensus_every
        self.on_nonfinite, self.on_fault, self.exchange_flags = on_nonfinite, on_fault, exchange_flags
        self.nonfinite_read = nonfinite_read
        self._pending_flags: tuple[int, Any] | None = None  # a deferred read's step and its sums on the way
        self.clip_grad_norm, self.before_optimizer_step = clip_grad_norm, before_optimizer_step
        # A disabled scaler (GradScaler(enabled=False)) scales nothing and never overflows.
        enabled = grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)()
        self.grad_scaler = grad_scaler if enabled else None
        self._overflows = 0  # overflow steps since the last audit
        self.replay_micro_batches = replay_micro_batches
        self._sample_sig: torch.Tensor | None = None  # local signature of an audit's sampled micro-batches
        self._audit_payload: dict[str, Any] = {}
        self.group = group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.step = start_step
        self.signing_key = signing_key_for(signing_key)  # a bad key file is refused before any step
        if isinstance(ledger, str):
            ledger = Ledger(ledger, signing_key=self.signing_key)
        self.ledger, self.parent = ledger, parent
        if sink is None and ledger is not None:
            sink = LedgerSink(ledger)
        self.sink = sink if sink is not None else MemorySink()
        self.check_determinism = check_determinism and mode == "deterministic"
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._not_in_optimizer = [p for p in self.params if id(p) not in owned]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.wire_device = wire
        # Buffers (see ``consensus_buffers``): with DDP's broadcast_buffers, every forward starts
        # from rank 0's copy, so rank 0 seals its buffers after each forward and checks the seal
        # before the next one: a change in between (stored state corrupted) would be broadcast to
        # every replica and into the checkpoints, and is reported at the next consensus instead.
        self._bcast_buffers = bool(getattr(ddp, "broadcast_buffers", False))
        self.buffer_names, self.buffers = consensus_buffers(ddp.module, broadcast=self._bcast_buffers)
        self._seal_source = self._bcast_buffers and bool(self.buffers) and self.rank == 0
        self._seal: torch.Tensor | None = None
        self._seal_bad: torch.Tensor | None = None
        self._probes = Probes(self.params) if mode == "tolerance" else None
        self.injector = Injector(injector_faults or [], rank=self.rank) if injector_faults else None
        if self.injector is not None:
            self.injector.install(ddp.module)
        self._check_world_agrees()
        hand_over = hand_over_grads and hand_over_possible(ddp)
        self._hook = HookState(
            names=self.param_names,
            index=self._param_index,
            mode=mode,
            probes=self._probes,
            injector=self.injector,
            group=self.group,
            eager_pre=not lazy_pre_possible(ddp, self.device),
            hand_over=hand_over,
        )
        ddp.register_comm_hook(self._hook, comm_hook)
        if hand_over:
            ddp.reducer._set_optimizer_in_backward()
        self.inventory = self._gather_inventory()
        self._checked_since_audit = 0  # steps whose non-finite checks passed since the last audit
        self._audit_seconds = 0.0  # the last replay audit's time (its log line)
        self._events: list[tuple[int, str, str]] = []  # (step, kind, outcome) since the last checkpoint (lineage)
        self.last_clean_audit: int | None = start_step if start_step else None
        self.last_checkpoint_step: int | None = start_step if start_step else None
        self._consensus: tuple[int, dict[str, str], str] | None = None  # (step, {param: fp}, state fp)
        self._first = True
        # At the first step whose gradients are finite, the rank replays its own step and compares
        # with what training computed: a replay path that computes differently from training
        # (torch.compile around DDP, a loss_fn that treats the bare module differently) is refused
        # then, on every rank, instead of raising a false alarm at every audit.
        self._path_check_pending = check_determinism
        self.last: StepOutcome | None = None
        # A step run by someone else's loop (the hook points below): its micro-batches and the RNG
        # state each started with, collected until ``before_update``.
        self._open: dict[str, Any] | None = None
        if expect_consensus_fp is not None:
            self._check_resumed_weights(expect_consensus_fp)
        # recorded only once the resumed weights are known to be the parent's
        if ledger is not None and parent is not None and self.rank == 0:
            ledger.start_branch(branch, parent=parent)

    # --- gathering from every rank ----------------------------------------------------------

    def _gather_inventory(self) -> dict[str, dict[str, Any]]:
        mine = json.dumps(rank_inventory(self.device)).encode()
        payloads = self._all_gather_bytes(mine)
        return {str(r): json.loads(b) for r, b in enumerate(payloads)}

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        return all_gather_bytes(data, group=self.group, wire_device=self.wire_device)

    def _gather_rows(self, mine: torch.Tensor) -> list[torch.Tensor]:
        wire = mine.to(self.wire_device)
        out = [torch.empty_like(wire) for _ in range(self.world)]
        dist.all_gather(out, wire, group=self.group)
        return [o.cpu() for o in out]

    # --- events -----------------------------------------------------------------------------

    def _event(self, kind: str, outcome: str, *, step: int, suspects=(), contained=False, **details) -> AuditEvent:
        ev = emit_event(self, kind, outcome, step=step, suspects=suspects, contained=contained, details=details)
        if len(self._events) < _MAX_LINEAGE:
            self._events.append((ev.step, ev.kind, ev.outcome))
        if self.last is not None:
            self.last.events.append(ev)
        return ev

    def _fail(self, ev: AuditEvent, message: str, *, policy: str) -> None:
        if policy == "raise":
            incident = None if ev.contained else incident_id_for(ev.to_dict())
            if self.world > 1:
                # Every rank fails here together, and rank 0 has just written the event and the
                # incident (``_event``). No rank leaves before that is done: a launcher (torchrun,
                # Lightning's) stops the other ranks as soon as one exits, and a rank 0 stopped in the
                # middle of its write would leave a detection without its incident record.
                done = torch.zeros(1, dtype=torch.int64, device=self.wire_device)
                dist.all_reduce(done, group=self.group)
            raise FaultDetectedError(f"step {ev.step}: {message}", ev, incident_id=incident)

    # --- the step ---------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.audit_every == 0

    # --- hook points for a loop someone else runs -------------------------------------------

    def begin_micro_batch(self, unit: Any) -> None:
        """Call on every rank before each micro-batch's forward pass (each of an optimizer step's).

        The first call of a step prepares it: the gradients of parameters the optimizer does not own
        are dropped (the loop's ``zero_grad`` leaves them to accumulate, and a replay recomputes one
        step), the hook is told whether to sign the local gradients (audit steps) and to average the
        reduced buckets over the ranks (the loop back-propagates its loss without dividing it by the
        world size, as with plain DDP), and the broadcast source's buffer seal is checked. Each call
        keeps ``unit`` (by reference: do not modify it in place) and, when the step will be replayed,
        the RNG state.

        Raises:
            ConfigurationError: the session has a ``grad_scaler``: telling an overflow from a fault
                is done by ``Auditor.train_step`` only (here a non-finite step would be a detection).
        """
        if self.grad_scaler is not None:
            raise ConfigurationError(
                "grad_scaler is handled by Auditor.train_step only; at the hook points an overflow would read as a"
                " fault: construct the session without grad_scaler (fp16 with a scaler is not audited here)"
            )
        if self._open is None:
            s = self.step + 1
            audit = self.is_audit_step(s)
            self.last = StepOutcome(step=s, audited=audit)
            sign = audit or self._path_check_pending
            for p in self._not_in_optimizer:
                p.grad = None
            self._hook.reset(audit=sign, average=1.0 / self.world if self.world > 1 else None)
            if self.injector is not None:
                self.injector.begin(s, "train")
            if self._seal_source:
                self._check_seal()  # before the forward, where DDP broadcasts rank 0's buffers
            self._open = {"s": s, "audit": audit, "units": [], "rngs": [], "rng": audit or sign or self._first}
        self._open["units"].append(unit)
        if self._open["rng"]:
            self._open["rngs"].append(self._rng_state())

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
        step = self._open
        if step is None:
            raise ConfigurationError("before_update without begin_micro_batch: call it before each forward")
        s, units, rngs = step["s"], step["units"], step["rngs"] or None
        n = loss_divisor or len(units)
        if self._seal_source:
            self._seal = digests(self.buffers)
        if self._first:
            self._first_step_checks(units, True)
            self._first = False
        failed = self._nonfinite_due(s, now=self._must_read_now(s, step["audit"]))
        self.step = s  # the step is attempted from here on, applied or not
        if failed is not None:
            self._nonfinite_detected(*failed)  # raises, or drops the gradients (skip)
            return False
        self._checked_since_audit += 1
        rng = rngs[0] if rngs else None
        if self._path_check_pending:
            self._check_replay_path(s, units, True, rng, n_total=n, rngs=rngs)
        if step["audit"]:
            t0 = time.perf_counter()
            self._audit_payload = {"units": units, "micro": True, "n": n, "rng": rng, "rngs": rngs}
            prev = RingShift(
                self._audit_payload, group=self.group, wire_device=self.wire_device, out_device=self.device
            ).finish()
            passed = self._replay_audit(s, units, True, rng, prev)
            self._audit_seconds = time.perf_counter() - t0
            if not passed:
                return False
        return True

    def after_update(self) -> None:
        """Call on every rank after the optimizer step (also when ``before_update`` refused
        the update): the weight consensus at audit steps and every ``consensus_every`` steps."""
        step, self._open = self._open, None
        if step is None or self.last is None or not self.last.applied:
            return
        s = step["s"]
        if self.injector is not None:
            self.injector.after_optimizer(list(zip(self.param_names, self.params)))
            self.injector.after_optimizer_buffers(list(zip(self.buffer_names, self.buffers)))
        due = step["audit"] or (self.consensus_every is not None and s % self.consensus_every == 0)
        t0 = time.perf_counter()
        consensus_ok = self.weight_consensus(s) if due else True
        if step["audit"]:
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked_since_audit)
            if consensus_ok:
                self.last_clean_audit = s
                if self.rank == 0:
                    log_audit_pass(
                        step=s,
                        branch=self.branch,
                        ranks=self.world,
                        checked=self._checked_since_audit,
                        seconds=self._audit_seconds + time.perf_counter() - t0,
                    )
            self._checked_since_audit = 0

    def _must_read_now(self, s: int, audit: bool) -> bool:
        """Steps whose non-finite flags are read before their update even when reads are deferred:
        audits and consensus steps (their evidence covers the step) and the replay-path check."""
        due = self.consensus_every is not None and s % self.consensus_every == 0
        return audit or due or self._path_check_pending

    def _zero_grad(self) -> None:
        """Drop every trained parameter's gradient, the optimizer's and any it does not own.

        A step's local gradients must be that step's alone: the replay recomputes one step's
        gradient, so a parameter whose ``.grad`` accumulated across steps (trained by DDP but
        outside this optimizer) would be a false alarm at every audit.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._not_in_optimizer:
            p.grad = None

    def _scaled(self, loss: torch.Tensor, *, n: int = 1, micro: bool = False) -> torch.Tensor:
        """The loss to back-propagate, so that the reduced gradients are DDP's averaged ones.

        One batch: the loss divided by the world size, and the hook's all-reduce sums. Dividing
        the scalar loss costs nothing, where dividing the gradients in the hook costs a pass over
        them. Micro-batches: ``loss / n``, as plain DDP users accumulate, and the hook multiplies
        the accumulated bucket by ``1 / world`` before the all-reduce, as DDP does: one pass per
        optimizer step (amortised over n backward passes) buys weights bit-equal to plain DDP's.
        Replays scale the same way, so that a replayed gradient is bit-for-bit the local one.
        """
        if micro:
            out = loss / n if n > 1 else loss
        else:
            out = loss / self.world if self.world > 1 else loss
        # As plain AMP code writes it: ``scaler.scale(loss / n).backward()``.
        return self.grad_scaler.scale(out) if self.grad_scaler is not None else out

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    # --- checkpoints --------------------------------------------------------------------------

    def _evidence(self, s: int) -> CheckpointEvidence:
        """What a checkpoint at step s carries, from the consensus at s (run it first)."""
        fps = self._consensus[1] if self._consensus and self._consensus[0] == s else {}
        agreed = self._consensus[2] if self._consensus and self._consensus[0] == s else None
        first = (self.last_checkpoint_step or 0) + 1
        lineage = {
            "audit_every": self.audit_every,
            "world": self.world,
            "mode": self.mode,
            "audits": [{"step": st, "kind": k, "outcome": o} for st, k, o in self._events],
            "last_clean_audit": self.last_clean_audit,
            "consensus": {"step": s, "fp": agreed} if agreed else None,
        }
        # The tensors whose fingerprints every replica agreed on, by identity: the writer finds them
        # in the checkpoint's object (a state_dict's tensors share the parameters' storage) and
        # reuses their fingerprints instead of computing them again.
        known = {
            (p.data_ptr(), p.dtype, tuple(p.shape), p.stride(), str(p.device)): (n, fps[n])
            for n, p in zip(self.param_names + self.buffer_names, self.params + self.buffers)
            if n in fps
        }
        return CheckpointEvidence(
            step=s,
            run=self.run,
            branch=self.branch,
            parent=self.parent,
            step_range=[first, s],
            lineage=lineage,
            consensus_fp=agreed,
            known_fingerprints=known,
        )

    def checkpoint_evidence(self) -> CheckpointEvidence:
        """The evidence a checkpoint taken now carries (collective: every rank calls it).

        Runs the weight consensus on the 64-bit fingerprints at the current step unless it ran
        already, and hands over the lineage since the previous checkpoint (the next one starts a
        new lineage). The caller writes the checkpoint on one rank (``CheckpointEvidence.save_kwargs``
        for ``save_certified``), flushes the sink (``flush``) and then commits it.

        Raises:
            FaultDetectedError: the replicas disagree (policy ``on_fault="raise"``).
        """
        self._settle_deferred()
        s = self.step
        if not (self._consensus and self._consensus[0] == s):
            self.weight_consensus(s, fingerprints=True)
        evidence = self._evidence(s)
        self.last_checkpoint_step = s
        self._events = []
        return evidence

    def flush(self) -> None:
        """Write the events emitted so far to the sink (rank 0; the ledger's events before a commit)."""
        if self.rank == 0:
            self.sink.flush()

    def save(self, obj: Any, f: Any, **kwargs: Any):
        """Save a checkpoint at the current step with its audit lineage (collective; rank 0 writes).

        Runs the weight consensus at this step if it has not run yet, and hands its fingerprints to
        the writer, which does not compute them again.

        Returns:
            ``SaveResult`` on rank 0, None elsewhere.
        """
        self._settle_deferred()
        s = self.step
        if not (self._consensus and self._consensus[0] == s):
            self.weight_consensus(s, fingerprints=True)
        evidence = self._evidence(s)
        result, error = None, None
        if self.rank == 0:
            try:
                try:
                    result = save_certified(
                        obj, f, **evidence.save_kwargs(), **{"signing_key": self.signing_key, **kwargs}
                    )
                except CheckpointExistsError as e:
                    if self.ledger is None:
                        raise
                    raise name_taken(str(f), self.ledger.store) from e
                self.sink.flush()  # the events up to this checkpoint reach the ledger before its commit record
                if self.ledger is not None:
                    self.ledger.commit_checkpoint(
                        branch=self.branch,
                        step=s,
                        location=str(f),
                        run=self.run,
                        parent=self.parent,
                        consensus_fp=evidence.consensus_fp,
                        state_fp=result.state_fp,
                        header_digest=result.header_digest,
                        step_range=evidence.step_range,
                        nbytes=result.nbytes,
                    )
            except Exception as e:
                error = e
        # Every rank learns whether rank 0's write succeeded, so all raise (or go on) together
        # instead of the others hanging in the next collective.
        status = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self.wire_device)
        dist.broadcast(status, dist.get_global_rank(self.group, 0), group=self.group)
        if error is not None:
            raise error
        if int(status) != 0:
            raise CertckptError(
                f"rank {self.rank}: rank 0 could not write checkpoint {f!s} at step {s}; see rank 0's error"
            )
        self.last_checkpoint_step = s
        self._events = []
        return result

    def close(self) -> None:
        """End the session on this rank: the hook's kept gradients dropped, a drill's injector removed,
        the events flushed. Not a collective and never raises for a check: it also runs in exception
        handlers (Lightning's ``on_exception``, ``stop_on_fault``), where another rank may never
        join one. A deferred read still pending is left unread: no checkpoint covers that step
        (``save`` and ``checkpoint_evidence`` read it first)."""
        self._pending_flags = None
        self._hook.kept = []
        if self.injector is not None:
            self.injector.remove()
        self.sink.flush()
