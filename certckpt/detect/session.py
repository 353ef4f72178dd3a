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
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import (
    AuditSetupError,
    CertckptError,
    ConfigurationError,
    FaultDetectedError,
    UnsupportedObjectError,
)
from certckpt.format.fingerprinting import as_words, finalize, raw_sum
from certckpt.format.record import state_fingerprint
from certckpt.format.signing import signing_key_for
from certckpt.format.writer import save_certified
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import Ledger, LedgerSink

from .agreement import all_gather_bytes, refuse_together, wire_device_for
from .attribution import arbitration_plan, attribute_replay, consensus_verdict, ring_pairs
from .digest import digests
from .events import AuditEvent, EventSink, MemorySink, make_event, publish, rank_inventory
from .exchange import RingShift, check_shippable, recv_payload, send_payload
from .hook import HookState, comm_hook, hand_over_possible, lazy_pre_possible, nonfinite_flag
from .inject import Injector
from .signature import Probes, matches, signature

__all__ = [
    "AuditSession",
    "CheckpointEvidence",
    "StepOutcome",
    "restore_rng",
    "unwrap_compiled",
    "consensus_buffers",
]


_MAX_LINEAGE = 100_000  # audit results kept for one checkpoint's lineage (a bound, not a design limit)


@dataclass(slots=True)
class StepOutcome:
    """What happened at one step (``auditor.last``)."""

    step: int
    applied: bool = True
    audited: bool = False
    events: list[AuditEvent] = field(default_factory=list)
    grad_norm: torch.Tensor | None = None  # the total norm before clipping, with clip_grad_norm


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointEvidence:
    """What a checkpoint taken at ``step`` carries (``AuditSession.checkpoint_evidence``).

    Attributes:
        step: the optimizer step the weights follow.
        run, branch, parent: the run's identity and the checkpoint this branch resumed from.
        step_range: the steps since the previous checkpoint, ``[first, step]``.
        lineage: the audits since the previous checkpoint (the record's ``lineage``).
        consensus_fp: the state fingerprint every replica agreed on at ``step`` (None: no agreement).
        known_fingerprints: tensor identity -> (name, fingerprint hex) of the agreed tensors, so that
            the writer does not fingerprint them again.
        tensor_fps: ``{name: fingerprint hex}`` of the agreed tensors under the names the checkpoint
            stores them (a sharded run's DCP names), so that a writer can name what differs.
    """

    step: int
    run: str
    branch: str
    parent: str | None
    step_range: list[int]
    lineage: dict[str, Any]
    consensus_fp: str | None
    known_fingerprints: dict[tuple, tuple[str, str]]
    tensor_fps: dict[str, str] = field(default_factory=dict)

    def save_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``certckpt.format.writer.save_certified`` for this checkpoint."""
        return {
            "step": self.step,
            "run": self.run,
            "branch": self.branch,
            "parent": self.parent,
            "step_range": list(self.step_range),
            "lineage": copy.deepcopy(self.lineage),  # the writer adds to it; each file gets its own
            "consensus_fp": self.consensus_fp,
            "known_fingerprints": self.known_fingerprints,
        }


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the RNG states a micro-batch was computed with (as ``Auditor._rng_state`` took them).

    The neighbour's states travel with its micro-batch and arrive on the wire device (CUDA under
    NCCL, the model's device under gloo); torch's setters accept only a CPU ByteTensor.
    """
    torch.set_rng_state(state["cpu"].to(device="cpu", dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].to(device="cpu", dtype=torch.uint8), device)


def unwrap_compiled(model: Any) -> tuple[bool, Any]:
    """``(compiled, ddp)``: ``torch.compile(DDP(m))`` is an ``OptimizedModule`` around the DDP model.

    The wrapper is recognised by name and its ``_orig_mod`` (torch's attribute for the module it
    compiles), so that this file need not import ``torch._dynamo``.
    """
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, DistributedDataParallel):
        return True, inner
    return False, model


_PER_RANK_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
)


def consensus_buffers(module: torch.nn.Module, *, broadcast: bool) -> tuple[list[str], list[torch.Tensor]]:
    """The floating-point buffers every replica must hold identically at a consensus step.

    With DDP's ``broadcast_buffers=True`` all of them (the auditor broadcasts rank 0's copy first,
    as DDP's next forward would). Without it, the running statistics of (non-synchronised) batch
    and instance norms are each rank's own by design, so they stay out; ``SyncBatchNorm``'s
    statistics are computed over all ranks and stay in, as do constant buffers.
    """
    per_rank: set[int] = set()
    if not broadcast:
        for m in module.modules():
            if isinstance(m, _PER_RANK_NORMS) and getattr(m, "track_running_stats", False):
                per_rank |= {id(m.running_mean), id(m.running_var)}
    named = [(n, b) for n, b in module.named_buffers() if b.is_floating_point() and id(b) not in per_rank]
    return [n for n, _ in named], [b for _, b in named]


def _option_problem(
    ddp: Any,
    *,
    mode: str,
    on_nonfinite: str,
    on_fault: str,
    exchange_flags: str,
    audit_every: int,
    consensus_every: int | None,
    clip_grad_norm: float | None,
    before_optimizer_step: Any,
    grad_scaler: Any,
    replay_micro_batches: int | None,
) -> str | None:
    """What is wrong with the Auditor's arguments on this rank (None: nothing)."""
    if not isinstance(ddp, DistributedDataParallel):
        return (
            f"model must be a DistributedDataParallel (or torch.compile of one), got {type(ddp).__name__};"
            " wrap it: Auditor(DDP(model), ...)"
        )
    if mode not in ("deterministic", "tolerance"):
        return f"mode must be 'deterministic' or 'tolerance', got {mode!r}"
    if on_nonfinite not in ("raise", "skip") or on_fault not in ("raise", "continue"):
        return "on_nonfinite must be 'raise' or 'skip'; on_fault 'raise' or 'continue'"
    if exchange_flags not in ("on-failure", "every-step"):
        return f"exchange_flags must be 'on-failure' or 'every-step', got {exchange_flags!r}"
    if audit_every < 1 or (consensus_every is not None and consensus_every < 1):
        return "audit_every and consensus_every must be >= 1"
    if clip_grad_norm is not None and not (isinstance(clip_grad_norm, (int, float)) and clip_grad_norm > 0):
        return f"clip_grad_norm must be a positive number (the max norm) or None, got {clip_grad_norm!r}"
    if before_optimizer_step is not None and not callable(before_optimizer_step):
        return "before_optimizer_step must be callable as fn(module, optimizer)"
    if grad_scaler is not None and not all(
        callable(getattr(grad_scaler, name, None)) for name in ("scale", "unscale_", "step", "update", "get_scale")
    ):
        return f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
    if replay_micro_batches is not None and not (isinstance(replay_micro_batches, int) and replay_micro_batches >= 1):
        return f"replay_micro_batches must be None (all) or an int >= 1, got {replay_micro_batches!r}"
    return None


class AuditSession:
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
        audit_every: K, the replay-audit interval in steps (full audit = replay + non-finite + consensus).
        consensus_every: also compare weights every N steps (None: at audits and checkpoints only).
        mode: ``"deterministic"`` (bit-exact fingerprints) or ``"tolerance"`` (norm and projection).
        rtol: relative tolerance in tolerance mode.
        on_nonfinite: ``"raise"`` or ``"skip"`` (drop the update: a contained detection).
        exchange_flags: ``"on-failure"`` (default: ranks exchange the non-finite flags only on a
            failing step) or ``"every-step"`` (one small all-reduce per step, so that a reduction
            delivering non-finite values to some ranks only is still a clean, contained detection).
        on_fault: ``"raise"`` or ``"continue"`` for replay and consensus failures (the failing step's
            update is dropped either way).
        clip_grad_norm: clip the reduced gradients to this total 2-norm before the optimizer step,
            as ``torch.nn.utils.clip_grad_norm_`` would after a plain DDP backward (every rank clips
            the same averaged gradients identically); the norm is in ``auditor.last.grad_norm``.
        before_optimizer_step: ``fn(module, optimizer)``, called on every rank after the checks
            passed and after clipping, just before ``optimizer.step()``: a gradient transform
            (clip by value, masking, ...). It sees the reduced gradients; it must treat them the
            same on every rank (the weight consensus catches replicas that diverge).
        replay_micro_batches: with ``train_step(micro_batches=...)``, replay at most this many
            micro-batches of an audited step (a contiguous block; successive audits tile the step)
            instead of all of them: an audit then costs k/n of a step's compute, and covers
            k/n of a one-time fault within the step (a persistent one still shows in every block),
            and not the accumulation of the micro-batches' gradients (see docs/detection.md).
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 autocast: the auditor scales the loss,
            unscales before clipping, steps and updates it. A non-finite step is replayed on the
            flagged ranks' neighbours: non-finite again, it is an overflow (skipped by the scaler,
            scale backed off, an ``overflow`` event); finite, a ``nonfinite-pre`` detection naming
            the rank.
        hand_over_grads: where DDP would copy each reduced bucket into ``.grad`` (gradient copies,
            its default), point ``.grad`` at the reduced bucket instead and skip that copy (default
            True; see ``hook.hand_over_possible``). ``p.grad`` is then a view of DDP's bucket after each
            step, as with ``gradient_as_bucket_view=True``; False keeps DDP's copy.
        sink: where events go (rank 0 emits them); default an in-memory sink (``auditor.sink.events``).
        injector_faults: synthetic faults for drills (see ``certckpt.detect.inject``).
        check_determinism: at the first step, replay the rank's own batch twice and refuse a model
            whose gradients differ (deterministic mode only); and, in either mode, at the first
            step with finite gradients, replay the step once and refuse when the replay does not
            reproduce what training computed (every rank refuses together).
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
        audit_every: int = 10,
        consensus_every: int | None = None,
        mode: str = "deterministic",
        rtol: float = 1e-3,
        on_nonfinite: str = "raise",
        exchange_flags: str = "on-failure",
        on_fault: str = "raise",
        hand_over_grads: bool = True,
        clip_grad_norm: float | None = None,
        before_optimizer_step: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None = None,
        grad_scaler: Any = None,
        replay_micro_batches: int | None = None,
        sink: EventSink | None = None,
        injector_faults: list | None = None,
        check_determinism: bool = True,
        start_step: int = 0,
        ledger: Any = None,
        parent: str | None = None,
        signing_key: Any = None,
        expect_consensus_fp: str | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            # No process group: nothing to agree with, and no rank can be waiting in a collective.
            raise AuditSetupError("torch.distributed is not initialized; call dist.init_process_group first")
        compiled, ddp = unwrap_compiled(model)
        group = ddp.process_group if isinstance(ddp, DistributedDataParallel) else dist.group.WORLD
        first = next((p for p in ddp.parameters()), None) if isinstance(ddp, torch.nn.Module) else None
        wire = wire_device_for(group, first.device if first is not None else torch.device("cpu"))
        # Every rank validates, then all decide together: a refusal on some ranks only would leave
        # the others waiting in the next collective.
        refuse_together(
            _option_problem(
                ddp,
                mode=mode,
                on_nonfinite=on_nonfinite,
                on_fault=on_fault,
                exchange_flags=exchange_flags,
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

    def _check_resumed_weights(self, expected: str) -> None:
        """Every replica's weights at ``start_step`` must be the checkpoint resumed from: they agree
        (a disagreement is a fault, as at any consensus) and their state fingerprint is ``expected``.
        Every rank computes the same agreed value, so every rank refuses together."""
        self.weight_consensus(self.step, found_by="resume", fingerprints=True)
        agreed = self._consensus[2] if self._consensus and self._consensus[0] == self.step else None
        if agreed != expected:
            raise AuditSetupError(
                f"the weights loaded for step {self.step} have consensus fingerprint {agreed}, but the checkpoint "
                f"resumed from ({self.parent or 'the parent'}) recorded {expected}: load that checkpoint's state "
                "(model and buffers) into every replica before creating the auditor"
            )

    # --- set-up checks ----------------------------------------------------------------------

    def _check_world_agrees(self) -> None:
        """Every rank must have the same parameters and the same audit configuration.

        Every rank raises the same message, naming the groups of ranks that agree with each other.
        """
        desc = json.dumps(
            [
                self.audit_every,
                self.consensus_every,
                self.mode,
                self.exchange_flags,
                self.clip_grad_norm,
                self.before_optimizer_step is not None,
                self.grad_scaler is not None,
                self.replay_micro_batches,
                [(n, list(p.shape), str(p.dtype)) for n, p in zip(self.param_names, self.params)],
                [(n, list(b.shape), str(b.dtype)) for n, b in zip(self.buffer_names, self.buffers)],
            ]
        ).encode()
        mine = torch.tensor(
            [xxhash.xxh3_64_intdigest(desc) & ((1 << 62) - 1)], dtype=torch.int64, device=self.wire_device
        )
        allv = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(allv, mine, group=self.group)
        values = [int(v) for v in allv]
        if len(set(values)) != 1:
            groups: dict[int, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            sides = " vs ".join(str(g) for g in sorted(groups.values()))
            raise AuditSetupError(
                f"the ranks disagree on parameters or audit settings (ranks {sides});"
                " every rank must build the same model and Auditor(audit_every=..., mode=..., clip_grad_norm=...)"
            )

    def _gather_inventory(self) -> dict[str, dict[str, Any]]:
        mine = json.dumps(rank_inventory(self.device)).encode()
        payloads = self._all_gather_bytes(mine)
        return {str(r): json.loads(b) for r, b in enumerate(payloads)}

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        return all_gather_bytes(data, group=self.group, wire_device=self.wire_device)

    # --- events -----------------------------------------------------------------------------

    def _event(self, kind: str, outcome: str, *, step: int, suspects=(), contained=False, **details) -> AuditEvent:
        ev = make_event(
            run=self.run,
            branch=self.branch,
            world=self.world,
            inventory=self.inventory,
            step=step,
            kind=kind,
            outcome=outcome,
            suspects=suspects,
            contained=contained,
            details=details,
        )
        if self.rank == 0:
            publish(ev, sink=self.sink, ledger=self.ledger)
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
        flags = self._read_flags()
        self.step = s  # the step is attempted from here on, applied or not
        if flags is not None:
            self._nonfinite_detected(s, flags)  # raises, or drops the gradients (skip)
            return False
        self._checked_since_audit += 1
        rng = rngs[0] if rngs else None
        if self._path_check_pending:
            self._check_replay_path(s, units, True, rng, n_total=n, rngs=rngs)
        if step["audit"]:
            self._audit_payload = {"units": units, "micro": True, "n": n, "rng": rng, "rngs": rngs}
            prev = RingShift(
                self._audit_payload, group=self.group, wire_device=self.wire_device, out_device=self.device
            ).finish()
            if not self._replay_audit(s, units, True, rng, prev):
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
        consensus_ok = self.weight_consensus(s) if due else True
        if step["audit"]:
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked_since_audit)
            self._checked_since_audit = 0
            if consensus_ok:
                self.last_clean_audit = s

    def _check_seal(self) -> None:
        """On the broadcast source: flag every buffer that changed since the last forward sealed it
        (device-side, no host synchronisation; the flags are read at the next consensus)."""
        if self._seal is None:
            return
        bad = digests(self.buffers) != self._seal
        self._seal_bad = bad if self._seal_bad is None else self._seal_bad | bad

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP's next synced forward would broadcast them.

        Done early at a consensus step, so that every replica holds the buffers the next step will
        use and their agreement (and the fingerprints a checkpoint reuses) can be checked.
        """
        src = dist.get_global_rank(self.group, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for same in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in same]).to(self.wire_device)
            dist.broadcast(flat, src, group=self.group)
            if self.rank != 0:
                with torch.no_grad():
                    offset = 0
                    for b in same:
                        b.copy_(flat[offset : offset + b.numel()].view_as(b))
                        offset += b.numel()

    def _first_step_checks(self, units: list[Any], micro: bool) -> None:
        """Refuse, on every rank together, a batch that cannot travel or a model that is not deterministic."""
        reason = None
        try:
            check_shippable(units if micro else units[0])
        except UnsupportedObjectError as e:
            reason = str(e)
        refuse_together(
            reason,
            group=self.group,
            wire_device=self.wire_device,
            what="the first step's batch",
            error=UnsupportedObjectError,
        )
        if self.check_determinism:
            self._check_deterministic(units, micro)

    def _read_flags(self) -> tuple[list[int], list[int]] | None:
        """None on a clean step; else per rank ``(pre-reduce flags, post-reduce flags)``.

        A non-finite value in any rank's local gradients survives the averaging (NaN and Inf
        propagate through a sum), so a post flag is set whenever any pre flag is; and it is equal on
        every rank whenever the reduction delivers the same values to all. So by default
        (``exchange_flags="on-failure"``) a clean step exchanges nothing: reading the post flags is
        the step's only host synchronisation, and only a failing step all-reduces the flags to learn
        which rank (if any) produced the bad values. A reduction that delivers non-finite values to
        some ranks only breaks that assumption: those ranks enter an exchange the others never join
        (gloo aborts on the mismatched collective, NCCL times out). ``exchange_flags="every-step"``
        pays one small all-reduce per step so that every rank always learns every rank's flags, and
        such a fault becomes a contained detection on all ranks.
        """
        hook = self._hook
        post_local = bool(torch.stack(hook.post).any()) if hook.post else False
        if not post_local and self.exchange_flags == "on-failure":
            return None
        flags = torch.zeros(2 * self.world, dtype=torch.int32, device=self.wire_device)
        if post_local:
            flags[self.world + self.rank] = 1
            if hook.pre:  # eager: every bucket's; lazy: those of the buckets that came back non-finite
                flags[self.rank] = torch.stack(hook.pre).any().to(self.wire_device)
        elif hook.pre:  # every-step exchange with eager pre-checks
            flags[self.rank] = torch.stack(hook.pre).any().to(self.wire_device)
        dist.all_reduce(flags, group=self.group)
        values = flags.tolist()
        if not any(values):
            return None
        return values[: self.world], values[self.world :]

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

    # --- check 1: non-finite ------------------------------------------------------------------

    def _scaler_nonfinite(
        self, s: int, flags: tuple[list[int], list[int]], units: list[Any], micro: bool, rng: dict[str, torch.Tensor]
    ) -> None:
        """A non-finite step under a gradient scaler: an overflow (the scaler's business) or a fault.

        Each rank whose local gradients were non-finite ships its micro-batches and RNG state to
        the next rank, which recomputes them with its own copy of the weights and the same scale.
        Non-finite again on every flagged rank's neighbour: the scale overflowed, as it does by
        design; the scaler skips the update and backs its scale off, and an ``overflow`` event
        (outcome pass) records it. Finite on a neighbour: that rank's own computation went wrong,
        a ``nonfinite-pre`` detection naming it, the update dropped and the scale left alone.
        Non-finite reduced gradients from finite local ones are a detection as without a scaler.
        """
        pre = [r for r, f in enumerate(flags[0]) if f]
        if not pre:
            self._nonfinite_detected(s, flags)
            return
        verdict = torch.zeros(self.world, dtype=torch.int64, device=self.wire_device)  # 1: finite on replay
        for origin in pre:
            replayer = (origin + 1) % self.world
            payload = {"units": units, "micro": micro, "rng": rng}
            if self.world == 1:
                got = payload  # one rank: the same device recomputes (a transient fault only shows)
            elif self.rank == origin:
                send_payload(
                    payload, dist.get_global_rank(self.group, replayer), group=self.group, wire_device=self.wire_device
                )
                continue
            elif self.rank == replayer:
                got = recv_payload(
                    dist.get_global_rank(self.group, origin),
                    group=self.group,
                    wire_device=self.wire_device,
                    out_device=self.device,
                )
            else:
                continue
            bad = self._replay(self.model.module, got["units"], bool(got["micro"]), got["rng"], s, finite=True)
            verdict[origin] = 0 if bool(bad) else 1
        dist.all_reduce(verdict, group=self.group)
        faulty = [r for r in pre if int(verdict[r])]
        if faulty:
            self._nonfinite_detected(s, flags, faulty=faulty, overflow_replayed=[r for r in pre if r not in faulty])
            return
        scale = float(self.grad_scaler.get_scale())
        self.grad_scaler.step(self.optimizer)  # finds the Inf/NaN itself and skips the update
        self.grad_scaler.update()
        self.last.applied = False
        self._overflows += 1
        self._event(
            "overflow",
            "pass",
            step=s,
            contained=True,
            pre_ranks=pre,
            replayed_by=[(r + 1) % self.world for r in pre],
            scale=scale,
            new_scale=float(self.grad_scaler.get_scale()),
        )

    def _nonfinite_detected(
        self, s: int, flags: tuple[list[int], list[int]], *, faulty: list[int] | None = None, **extra: Any
    ) -> None:
        """Record (and, by policy, raise) a non-finite detection; ``faulty``: with a gradient scaler,
        the flagged ranks whose micro-batches a neighbour recomputed finite (the others overflowed)."""
        self.last.applied = False
        pre = [r for r, f in enumerate(flags[0]) if f]
        post = [r for r, f in enumerate(flags[1]) if f]
        bad = [
            n for n, p in zip(self.param_names, self.params) if p.grad is not None and not torch.isfinite(p.grad).all()
        ]
        if pre:
            kind, suspects = "nonfinite-pre", pre if faulty is None else faulty
            msg = f"non-finite local gradients on rank(s) {suspects} before the all-reduce"
            if faulty is not None:
                msg += " (a neighbour recomputed the same micro-batches with finite gradients: not an overflow)"
        else:
            kind, suspects = "nonfinite-post", []
            msg = (
                f"gradients became non-finite in the all-reduce (seen on rank(s) {post}) while every rank's local"
                " gradients were finite: suspect the reduction (interconnect, or a rank's reduction arithmetic)"
            )
        ev = self._event(
            kind,
            "fail",
            step=s,
            suspects=suspects,
            contained=True,
            pre_ranks=pre,
            post_ranks=post,
            tensors=bad[:20],
            policy=self.on_nonfinite,
            **extra,
        )
        self._zero_grad()
        self._fail(ev, msg + "; the update was not applied", policy="raise" if self.on_nonfinite == "raise" else "skip")

    # --- check 2: ring replay -------------------------------------------------------------------

    def _replay(
        self,
        module: torch.nn.Module,
        units: list[Any],
        micro: bool,
        rng: dict[str, torch.Tensor],
        s: int,
        *,
        finite: bool = False,
        n_total: int | None = None,
        rngs: Sequence[dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Gradient signature of one step's micro-batches recomputed on this rank, leaving .grad and
        buffers alone.

        One batch: each parameter's gradient is signed by a tensor hook as soon as backward
        produces it, and the hook hands autograd a zero-stride placeholder instead, so the gradient
        is freed at once: only one parameter's gradient is alive at a time. Keeping all of them
        until the end (as ``autograd.grad`` would) means as much fresh memory as the model on every
        audit, which on CPU costs a page fault per 4 KiB (about 12 ms per 36 MiB here) because the
        allocator hands such a block back to the system after each audit.

        Several micro-batches: the hook adds each gradient into a per-parameter accumulator, in
        micro-batch order, as autograd accumulates ``.grad`` under ``no_sync`` (the same additions,
        so the same bits), and the accumulators are signed at the end: one model's worth of memory
        during the audit, one graph alive at a time.

        ``finite=True`` (a gradient scaler's overflow check) returns one flag instead: True when
        any recomputed gradient is non-finite. ``n_total``: the step's number of micro-batches when
        ``units`` is a sample of them (each loss is divided by the step's count, as in training).
        ``rngs``: the RNG state each micro-batch started with (a loop someone else runs may draw
        random numbers between micro-batches, e.g. in its data pipeline); default: ``rng`` once.
        """
        buffers = [b.detach().clone() for b in module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        n = len(units)
        scale_n = n_total or n
        rows: list[torch.Tensor | None] = [None] * len(self.params)
        acc: list[torch.Tensor | None] | None = [None] * len(self.params) if n > 1 else None

        def probes_of(i: int) -> Probes | None:
            return self._probes.subset([i]) if self._probes is not None else None

        def sign(i: int, g: torch.Tensor) -> torch.Tensor:
            if finite:
                return nonfinite_flag(g)
            return signature([g], mode=self.mode, probes=probes_of(i))[0]

        def signer(i: int):
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if acc is not None:
                    if acc[i] is None:
                        acc[i] = grad.detach().clone()
                    else:
                        acc[i].add_(grad.detach())
                else:
                    g = grad
                    if self.injector is not None:  # drills only: a persistent fault corrupts replays too
                        g = grad.detach().clone()
                        self.injector.on_local_grads([self.param_names[i]], [g])
                    rows[i] = sign(i, g.detach())
                return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

            return hook

        handles = [p.register_hook(signer(i)) for i, p in enumerate(self.params)]
        try:
            with torch.random.fork_rng(devices=devices):
                restore_rng(rng, self.device)
                if self.injector is not None:
                    self.injector.begin(s, "replay")
                for k, unit in enumerate(units):
                    if rngs is not None and k:
                        restore_rng(rngs[k], self.device)
                    loss = self.loss_fn(module, unit)
                    torch.autograd.grad(self._scaled(loss, n=scale_n, micro=micro), self.params, allow_unused=True)
                    del loss
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for b, saved in zip(module.buffers(), buffers):
                    b.copy_(saved)
            if self.injector is not None:
                self.injector.begin(s, "train")
        if acc is not None:
            if self.injector is not None:  # as in training: a backward fault hits the accumulated gradient
                self.injector.begin(s, "replay")
                present = [i for i, a in enumerate(acc) if a is not None]
                self.injector.on_local_grads([self.param_names[i] for i in present], [acc[i] for i in present])
                self.injector.begin(s, "train")
            for i, a in enumerate(acc):
                if a is not None:
                    rows[i] = sign(i, a)
                    acc[i] = None
        for i, p in enumerate(self.params):
            if rows[i] is None:  # unused in this forward: DDP's bucket holds zeros for it
                rows[i] = sign(i, torch.zeros_like(p))
        return torch.stack(rows).any() if finite else torch.stack(rows)

    def _check_deterministic(self, units: list[Any], micro: bool) -> None:
        """Replay the rank's own first step twice; refuse (on every rank together) if they differ."""
        rng = self._rng_state()
        module = self.model.module
        a, b = self._replay(module, units, micro, rng, 0), self._replay(module, units, micro, rng, 0)
        same = matches(a.cpu(), b.cpu(), mode="deterministic", rtol=0)
        reason = None
        if not all(same):
            names = [n for n, ok in zip(self.param_names, same) if not ok][:5]
            reason = f"gradients differ between two identical computations (e.g. {names})"
        refuse_together(
            reason,
            group=self.group,
            wire_device=self.wire_device,
            what="the determinism check (deterministic mode)",
            advice=(
                "the replay restores torch's RNG state only, so the likely causes are: randomness drawn outside"
                " torch inside the model or loss_fn (Python's random, numpy.random: draw from torch instead, e.g."
                " torch.rand), state that changes between calls (a counter, a cache), or non-deterministic kernels"
                " (enable torch.use_deterministic_algorithms(True)); Auditor(mode='tolerance') helps with the"
                " last cause only"
            ),
        )

    def _check_replay_path(
        self,
        s: int,
        units: list[Any],
        micro: bool,
        rng: dict[str, torch.Tensor],
        *,
        n_total: int | None = None,
        rngs: Sequence[dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Replay this rank's own step and compare with its training gradients (first clean step).

        This is the comparison every audit makes between two ranks, made on one rank with the same
        weights, so that a set-up the audits would always flag is refused at once, on every rank.
        """
        self._path_check_pending = False
        local = torch.stack([self._hook.local_sig[i] for i in range(len(self.params))])
        again = self._replay(self.model.module, units, micro, rng, s, n_total=n_total, rngs=rngs)
        same = matches(again.cpu(), local.cpu(), mode=self.mode, rtol=self.rtol)
        reason = None
        if not all(same):
            names = [n for n, ok in zip(self.param_names, same) if not ok][:5]
            reason = f"the replay of the first step gives other gradients than training did (e.g. {names})"
        refuse_together(
            reason,
            group=self.group,
            wire_device=self.wire_device,
            what="the replay check",
            advice=(
                "a replay calls loss_fn(model.module, batch) on the bare module, outside DDP and outside a"
                " torch.compile wrapped around DDP; likely causes: a loss_fn that treats the bare module"
                " differently, a compiler that changes the arithmetic (compile inside DDP instead,"
                " DDP(torch.compile(model)), or use Auditor(mode='tolerance')), a forward that reads the buffers"
                " it updates, or randomness drawn outside torch"
            ),
        )

    def _replay_audit(
        self, s: int, units: list[Any], micro: bool, rng: dict[str, torch.Tensor], prev: dict[str, Any]
    ) -> bool:
        """Run the ring replay of ``prev`` (the previous rank's micro-batches and RNG state); returns
        whether the update may be applied."""
        if self._sample_sig is not None:
            local = self._sample_sig
        else:
            local = torch.stack([self._hook.local_sig[i] for i in range(len(self.params))])
        replay = self._replay(
            self.model.module,
            prev["units"],
            bool(prev["micro"]),
            prev["rng"],
            s,
            n_total=int(prev["n"]),
            rngs=prev.get("rngs"),
        )
        gathered = self._gather_rows(torch.stack([local, replay]))  # [W, 2, P, ...]
        failed, mismatched = [], {}
        for origin, replayer in ring_pairs(self.world):
            ok = matches(gathered[replayer][1], gathered[origin][0], mode=self.mode, rtol=self.rtol)
            if not all(ok):
                failed.append((origin, replayer))
                mismatched[f"{origin}->{replayer}"] = [n for n, good in zip(self.param_names, ok) if not good][:10]
        if not failed:
            self._event(
                "replay",
                "pass",
                step=s,
                comparisons=len(ring_pairs(self.world)),
                mode=self.mode,
                micro_batches=len(units),
            )
            return True
        self.last.applied = False
        # A replay can only be trusted between replicas that hold the same weights: check first.
        if not self.weight_consensus(s - 1, found_by="replay precondition"):
            self._zero_grad()
            return False
        arbitration = self._arbitrate(s, failed, self._audit_payload, gathered)
        verdict = attribute_replay(self.world, failed, arbitration)
        ev = self._event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            contained=False,
            mode=self.mode,
            micro_batches=len(units),
            failed=[{"origin": o, "replayer": r} for o, r in failed],
            mismatched=mismatched,
            arbitration={f"{o}->{r}": v for (o, r), v in arbitration.items()},
            notes=list(verdict.notes),
        )
        self._zero_grad()
        who = f"rank(s) {list(verdict.suspects)}" if verdict.suspects else "no rank could be named"
        self._fail(ev, f"replay audit failed ({who}); the update was not applied", policy=self.on_fault)
        return False

    def _gather_rows(self, mine: torch.Tensor) -> list[torch.Tensor]:
        wire = mine.to(self.wire_device)
        out = [torch.empty_like(wire) for _ in range(self.world)]
        dist.all_gather(out, wire, group=self.group)
        return [o.cpu() for o in out]

    def _arbitrate(self, s, failed, payload, gathered) -> dict[tuple[int, int], str]:
        """For each failed comparison no persistent fault explains, a third rank replays the batch."""
        results: dict[tuple[int, int], str] = {}
        for origin, replayer, arbiter in arbitration_plan(self.world, failed):
            if self.rank == origin:
                send_payload(
                    payload,
                    dist.get_global_rank(self.group, arbiter),
                    group=self.group,
                    wire_device=self.wire_device,
                )
                sig = torch.zeros_like(gathered[origin][1])
            elif self.rank == arbiter:
                got = recv_payload(
                    dist.get_global_rank(self.group, origin),
                    group=self.group,
                    wire_device=self.wire_device,
                    out_device=self.device,
                )
                sig = self._replay(
                    self.model.module,
                    got["units"],
                    bool(got["micro"]),
                    got["rng"],
                    s,
                    n_total=int(got["n"]),
                    rngs=got.get("rngs"),
                ).cpu()
            else:
                sig = torch.zeros_like(gathered[origin][1])
            wire = sig.to(self.wire_device)
            dist.broadcast(wire, dist.get_global_rank(self.group, arbiter), group=self.group)
            arb = wire.cpu()
            with_origin = all(matches(arb, gathered[origin][0], mode=self.mode, rtol=self.rtol))
            with_replayer = all(matches(arb, gathered[replayer][1], mode=self.mode, rtol=self.rtol))
            results[(origin, replayer)] = "origin" if with_origin else "replayer" if with_replayer else "neither"
        return results

    # --- check 3: weight consensus ----------------------------------------------------------------

    def weight_consensus(self, s: int, *, found_by: str | None = None, fingerprints: bool = False) -> bool:
        """Compare every replica's weights; returns whether they agree.

        Audits compare 32-bit audit digests (``digest.py``). A checkpoint step (``fingerprints=True``)
        compares the 64-bit fingerprints instead, which the checkpoint writer then reuses, and its
        pass event carries the state fingerprint the certifier matches against the file.
        """
        state = [p.detach() for p in self.params]
        names = list(self.param_names)
        if self.buffers:
            if self._seal_source:
                self._check_seal()
            if self._bcast_buffers:
                self._broadcast_buffers()
            state += [b.detach() for b in self.buffers]
            names += self.buffer_names
        if not state:
            raw = torch.zeros(0, dtype=torch.int64)
        elif fingerprints:
            raw = torch.stack([raw_sum(as_words(t)) for t in state])
        else:
            raw = digests(state)
        columns = list(names)
        if self._bcast_buffers and self.buffers:
            # The broadcast source's seal flags vote too: only rank 0 can set them, so a broken seal
            # makes rank 0 the minority, naming the buffer that changed outside a forward.
            bad = self._seal_bad if self._seal_bad is not None else torch.zeros(len(self.buffers), dtype=torch.bool)
            raw = torch.cat([raw, bad.to(device=raw.device, dtype=torch.int64)])
            columns += [f"{n} (changed on the broadcast source outside a forward)" for n in self.buffer_names]
            self._seal_bad = None  # reported once; the seal restarts from the values held now
            if self._seal_source:
                self._seal = digests(self.buffers)
        rows = [r.tolist() for r in self._gather_rows(raw)]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            details: dict[str, Any] = {"params": len(self.params)}
            if self.buffers:
                details["buffers"] = len(self.buffers)
            if fingerprints:
                fps = {n: f"{finalize(r, t):016x}" for n, r, t in zip(names, rows[0], state)}
                details["fp"] = state_fingerprint(fps)
                self._consensus = (s, fps, details["fp"])
            if found_by is None:
                self._event("consensus", "pass", step=s, **details)
            return True
        names = [columns[j] for j in verdict.mismatched][:20]
        if self.last is not None and found_by is None:
            self.last.applied = False
        ev = self._event(
            "consensus",
            "fail",
            step=s,
            suspects=verdict.minority_ranks if verdict.majority is not None else (),
            contained=False,
            tensors=names,
            majority=verdict.majority is not None,
            **({"found_by": found_by} if found_by else {}),
            **({} if verdict.majority is not None else {"note": "no majority: every rank differs (or a tie)"}),
        )
        self._consensus = None
        minority = list(verdict.minority_ranks) if verdict.majority is not None else "no majority"
        self._fail(
            ev,
            f"weights differ across replicas after step {s} (minority: {minority}; tensors {names[:3]})",
            policy=self.on_fault,
        )
        return False

    # --- checkpoints --------------------------------------------------------------------------

    def consensus_fingerprints(self) -> dict[str, str] | None:
        """Per-parameter fingerprints every replica agreed on at the current step, if checked."""
        if self._consensus and self._consensus[0] == self.step:
            return dict(self._consensus[1])
        return None

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
        s = self.step
        if not (self._consensus and self._consensus[0] == s):
            self.weight_consensus(s, fingerprints=True)
        evidence = self._evidence(s)
        result, error = None, None
        if self.rank == 0:
            try:
                result = save_certified(obj, f, **evidence.save_kwargs(), **{"signing_key": self.signing_key, **kwargs})
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
        self._hook.kept = []
        if self.injector is not None:
            self.injector.remove()
        self.sink.flush()
