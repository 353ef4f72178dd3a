"""The auditor: drives the three detection checks from inside a DDP training loop.

Per step, in this order:

1. non-finite check of the local gradients before the all-reduce and of the reduced ones after it,
   inside a DDP communication hook that performs the all-reduce itself (the averaging is folded into
   the loss); the flags stay on the device until one small read before ``optimizer.step()``. On CPU,
   where a flag can be read for free, the local gradients are checked only when their reduced bucket
   comes back non-finite (``_lazy_pre_possible``): a clean step pays one pass over the gradients.
   With DDP's gradient copies (any device) the callback then hands ``.grad`` its view of the reduced
   bucket, which saves DDP's copy back into ``.grad`` (``_hand_over_possible``);
2. every ``audit_every`` steps, the ring replay audit: rank r recomputes rank r-1's micro-batch with
   its own weights and compares gradient signatures with those r-1 computed before the all-reduce;
3. weight consensus after ``optimizer.step()`` at audit steps, checkpoint steps and every
   ``consensus_every`` steps: every rank's weight fingerprints, all-gathered and compared.

Usage (every rank)::

    auditor = Auditor(ddp_model, optimizer, loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
                      run="exp1", audit_every=10, sink=JsonlSink("events.jsonl"))
    for batch in loader:
        loss = auditor.train_step(batch)        # zero_grad, forward, backward, checks, step
        if auditor.step % 100 == 0:
            auditor.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                         f"ckpt/{auditor.step}.safetensors")
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import AuditSetupError, CertckptError, FaultDetectedError
from certckpt.format.fingerprinting import as_words, finalize, raw_sum
from certckpt.format.record import state_fingerprint
from certckpt.format.writer import save_certified
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import Ledger, LedgerSink
from certckpt.trust.runstore import open_incident

from .attribution import arbitration_plan, attribute_replay, consensus_verdict, ring_pairs
from .digest import digests
from .events import AuditEvent, EventSink, MemorySink, rank_inventory
from .exchange import RingShift, check_shippable, recv_payload, send_payload
from .inject import Injector
from .signature import Probes, matches, signature

__all__ = ["Auditor", "FaultDetectedError", "AuditSetupError", "StepOutcome"]


_MAX_LINEAGE = 100_000  # audit results kept for one checkpoint's lineage (a bound, not a design limit)


@dataclass(slots=True)
class StepOutcome:
    """What happened at one step (``auditor.last``)."""

    step: int
    applied: bool = True
    audited: bool = False
    events: list[AuditEvent] = field(default_factory=list)


class _HookState:
    """State shared with the communication hook: per-bucket device flags, the bucket views, the
    local gradients kept alive for the step and, on audit steps, their signatures."""

    def __init__(self, auditor: Auditor, *, eager_pre: bool, hand_over: bool):
        self.auditor = auditor
        # Eager: flag every bucket's local gradients before the all-reduce (device-side, no sync).
        # Lazy: flag them only when the reduced bucket is non-finite, from ``.grad``, which still
        # holds the local gradients when the callback runs (see ``_lazy_pre_possible``).
        self.eager_pre = eager_pre
        # Hand-over: the callback points ``.grad`` at the reduced bucket (see ``_hand_over_possible``).
        self.hand_over = hand_over
        self.pre: list[torch.Tensor] = []
        self.post: list[torch.Tensor] = []
        self.local_sig: dict[int, torch.Tensor] = {}
        self.audit = False
        self.views: dict[int, tuple[tuple[int, int], list[torch.Tensor], list[torch.Tensor]]] = {}
        self.kept: list[torch.Tensor] = []

    def reset(self, *, audit: bool) -> None:
        # Dropping the kept local gradients here, right after zero_grad, frees them when plain DDP
        # frees its .grad tensors: freed any earlier, the allocator hands the block back to the
        # system and the next backward pays a page fault per 4 KiB to get it again.
        self.pre, self.post, self.local_sig, self.audit, self.kept = [], [], {}, audit, []

    def bucket_views(self, bucket, buf: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The bucket's parameters and, for each, a view of its gradient in the bucket (cached).

        ``GradBucket.gradients()`` views every gradient row-major, but DDP lays a dense
        parameter's gradient out with the parameter's own strides (its "gradient layout
        contract"): for a channels_last weight the row-major view reads the right bytes in the
        wrong order. The views here follow DDP's layout, so they hold the gradient's true values.
        """
        key = (buf.data_ptr(), buf.numel())  # DDP rebuilds its buckets once, after the first step
        hit = self.views.get(bucket.index())
        if hit is not None and hit[0] == key:
            return hit[1], hit[2]
        params = list(bucket.parameters())
        views = []
        for p, g in zip(params, bucket.gradients()):
            if _dense(p) and not p.is_contiguous():
                g = buf.as_strided(p.size(), p.stride(), g.storage_offset())
            views.append(g)
        self.views[bucket.index()] = (key, params, views)
        return params, views

    def handed_over_intact(self) -> bool:
        """Does each bucket's first gradient still view the reduced bucket after backward?

        The hand-over relies on DDP leaving ``.grad`` alone once told an optimizer ran in backward
        (a private switch); were a torch release to reset or copy the gradients there instead, the
        optimizer would silently step on something else. One check per bucket per step catches it.
        """
        for _, params, views in self.views.values():
            for p, v in zip(params, views):
                if v.numel():
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                        return False
                    break
        return True


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the RNG states a micro-batch was computed with (as ``Auditor._rng_state`` took them).

    The neighbour's states travel with its micro-batch and arrive on the wire device (CUDA under
    NCCL, the model's device under gloo); torch's setters accept only a CPU ByteTensor.
    """
    torch.set_rng_state(state["cpu"].to(device="cpu", dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].to(device="cpu", dtype=torch.uint8), device)


def nonfinite_flag(buf: torch.Tensor) -> torch.Tensor:
    # One fused reduction instead of isfinite().all(): NaN and Inf propagate through a sum (a sum
    # that overflows to Inf is flagged too, and means the gradients are unusable anyway).
    return ~torch.isfinite(buf.sum(dtype=torch.float32))


def _local_grads_flag(params: list[torch.Tensor]) -> torch.Tensor:
    flags = [nonfinite_flag(p.grad) for p in params if p.grad is not None]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool)


def _lazy_pre_possible(model: DistributedDataParallel, device: torch.device) -> bool:
    """Can the pre-reduce check wait until the reduced bucket is known to be non-finite?

    Only where reading a flag on the host is free (CPU tensors) and the local gradients survive the
    all-reduce: DDP copies each gradient into its bucket and copies the reduced bucket back into
    ``.grad`` only after every bucket's future (callback included) has completed, unless the
    gradients *are* bucket views. A non-finite local gradient always makes the reduced bucket
    non-finite (NaN and Inf survive a sum), so a clean step then pays one pass over the gradients
    instead of two, and a failing step still learns which rank's local gradients were bad.
    """
    return device.type == "cpu" and not getattr(model, "gradient_as_bucket_view", False)


def _hand_over_possible(model: DistributedDataParallel) -> bool:
    """Can the callback hand the reduced bucket to ``.grad`` instead of DDP copying it there?

    With gradient copies, DDP copies every reduced bucket into ``.grad`` after the callbacks: a
    pass that reads and writes all the gradients, costing more than the non-finite check's own
    pass. Told that an optimizer ran in backward (``Reducer._set_optimizer_in_backward``), DDP
    leaves ``.grad`` alone, and the callback points each ``.grad`` at its gradient's view of the
    reduced bucket instead, as ``gradient_as_bucket_view=True`` would: the same values, no copy.
    Only where that is exactly what DDP would have produced: every parameter gets a gradient each
    step (no ``find_unused_parameters``, no static graph), the bucket has the parameters' dtype
    (no mixed precision), and gradients are not bucket views already. (Every view is dropped by the
    auditor's ``_zero_grad`` before the next backward, which would otherwise accumulate into it.)
    """
    reducer = getattr(model, "reducer", None)
    return (
        hasattr(reducer, "_set_optimizer_in_backward")
        and not getattr(model, "gradient_as_bucket_view", False)
        and not getattr(model, "find_unused_parameters", True)
        and not getattr(model, "static_graph", True)
        and getattr(model, "mixed_precision", None) is None
    )


def _dense(t: torch.Tensor) -> bool:
    """Is ``t`` non-overlapping and dense (some permutation of its dimensions is contiguous)?"""
    expected = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim())):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _comm_hook(state, bucket):
    # No annotations: DDP inspects them, and `from __future__ import annotations` turns them into
    # strings it rejects ("bucket annotation should be dist.GradBucket").
    aud = state.auditor
    buf = bucket.buffer()
    params, grads = state.bucket_views(bucket, buf)
    if state.audit or aud.injector is not None:
        idx = [aud._param_index[id(p)] for p in params]
        if aud.injector is not None:
            aud.injector.on_local_grads([aud.param_names[i] for i in idx], grads)
            # A real fault in backward corrupts .grad, which DDP copied into the bucket: mirror an
            # injected one there too, so that the lazy pre-reduce check sees what a real one would.
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if p.grad is not None and p.grad.data_ptr() != g.data_ptr():
                        p.grad.copy_(g)
    if state.eager_pre:
        state.pre.append(nonfinite_flag(buf))
    if state.audit:
        probes = aud._probes.subset(idx) if aud._probes is not None else None
        sig = signature(grads, mode=aud.mode, probes=probes)
        for i, row in zip(idx, sig):
            state.local_sig[i] = row
    # No division here: the auditor folds DDP's averaging into the loss (loss / world before
    # backward), so the sum this all-reduce computes is already the average. DDP's own hook fuses
    # its division into the copy into the bucket; a hook's ``div_`` would be one more full pass.
    fut = dist.all_reduce(buf, group=aud.group, async_op=True).get_future()

    def post(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        if aud.injector is not None:
            aud.injector.on_reduced(out)
        flag = nonfinite_flag(out)
        state.post.append(flag)
        if not state.eager_pre and bool(flag):  # a CPU flag: reading it costs no device sync
            state.pre.append(_local_grads_flag(params))
        if state.hand_over:  # after the lazy check, which reads the local gradients from .grad
            for p, g in zip(params, grads):
                if p.grad is not None:
                    state.kept.append(p.grad)
                p.grad = g
        return out

    return fut.then(post)


class Auditor:
    """Wraps a DDP model and its optimizer; call ``train_step(batch)`` once per optimizer step.

    Args:
        model: the ``DistributedDataParallel`` model (the hook is registered on it; register no other).
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
        hand_over_grads: where DDP would copy each reduced bucket into ``.grad`` (gradient copies,
            its default), point ``.grad`` at the reduced bucket instead and skip that copy (default
            True; see ``_hand_over_possible``). ``p.grad`` is then a view of DDP's bucket after each
            step, as with ``gradient_as_bucket_view=True``; False keeps DDP's copy.
        sink: where events go (rank 0 emits them); default an in-memory sink (``auditor.sink.events``).
        injector_faults: synthetic faults for drills (see ``certckpt.detect.inject``).
        check_determinism: at the first step, replay the rank's own batch twice and refuse a model
            whose gradients differ (deterministic mode only).
        start_step: the optimizer step count already done (when resuming).
        ledger: a ``certckpt.Ledger`` (or its store URL): rank 0 batches events into it and commits
            every checkpoint saved through the auditor (default sink then: the ledger).
        parent: the checkpoint id this branch resumed from (a rollback); recorded in the ledger and in
            every checkpoint's record.
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
        sink: EventSink | None = None,
        injector_faults: list | None = None,
        check_determinism: bool = True,
        start_step: int = 0,
        ledger: Any = None,
        parent: str | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise AuditSetupError("torch.distributed is not initialized; call dist.init_process_group first")
        if not isinstance(model, DistributedDataParallel):
            raise AuditSetupError(f"model must be a DistributedDataParallel, got {type(model).__name__}")
        if mode not in ("deterministic", "tolerance"):
            raise AuditSetupError(f"mode must be 'deterministic' or 'tolerance', got {mode!r}")
        if on_nonfinite not in ("raise", "skip") or on_fault not in ("raise", "continue"):
            raise AuditSetupError("on_nonfinite must be 'raise' or 'skip'; on_fault 'raise' or 'continue'")
        if exchange_flags not in ("on-failure", "every-step"):
            raise AuditSetupError(f"exchange_flags must be 'on-failure' or 'every-step', got {exchange_flags!r}")
        if audit_every < 1 or (consensus_every is not None and consensus_every < 1):
            raise AuditSetupError("audit_every and consensus_every must be >= 1")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.run, self.branch, self.mode, self.rtol = run, branch, mode, rtol
        self.audit_every, self.consensus_every = audit_every, consensus_every
        self.on_nonfinite, self.on_fault, self.exchange_flags = on_nonfinite, on_fault, exchange_flags
        self.group = model.process_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.step = start_step
        if isinstance(ledger, str):
            ledger = Ledger(ledger)
        self.ledger, self.parent = ledger, parent
        if sink is None and ledger is not None:
            sink = LedgerSink(ledger)
        self.sink = sink if sink is not None else MemorySink()
        self.check_determinism = check_determinism and mode == "deterministic"
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._not_in_optimizer = [p for p in self.params if id(p) not in owned]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.wire_device = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        self._probes = Probes(self.params) if mode == "tolerance" else None
        self.injector = Injector(injector_faults or [], rank=self.rank) if injector_faults else None
        if self.injector is not None:
            self.injector.install(model.module)
        self._check_world_agrees()
        hand_over = hand_over_grads and _hand_over_possible(model)
        self._hook = _HookState(self, eager_pre=not _lazy_pre_possible(model, self.device), hand_over=hand_over)
        model.register_comm_hook(self._hook, _comm_hook)
        if hand_over:
            model.reducer._set_optimizer_in_backward()
        if ledger is not None and parent is not None and self.rank == 0:
            ledger.start_branch(branch, parent=parent)
        self.inventory = self._gather_inventory()
        self._checked_since_audit = 0  # steps whose non-finite checks passed since the last audit
        self._events: list[tuple[int, str, str]] = []  # (step, kind, outcome) since the last checkpoint (lineage)
        self.last_clean_audit: int | None = start_step if start_step else None
        self.last_checkpoint_step: int | None = start_step if start_step else None
        self._consensus: tuple[int, dict[str, str], str] | None = None  # (step, {param: fp}, state fp)
        self._first = True
        self.last: StepOutcome | None = None

    # --- set-up checks ----------------------------------------------------------------------

    def _check_world_agrees(self) -> None:
        """Every rank must have the same parameters and the same audit configuration."""
        desc = json.dumps(
            [
                self.audit_every,
                self.consensus_every,
                self.mode,
                self.exchange_flags,
                [(n, list(p.shape), str(p.dtype)) for n, p in zip(self.param_names, self.params)],
            ]
        ).encode()
        mine = torch.tensor(
            [xxhash.xxh3_64_intdigest(desc) & ((1 << 62) - 1)], dtype=torch.int64, device=self.wire_device
        )
        allv = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(allv, mine, group=self.group)
        values = [int(v) for v in allv]
        if len(set(values)) != 1:
            odd = [r for r, v in enumerate(values) if v != values[self.rank]]
            raise AuditSetupError(
                f"rank {self.rank}: the ranks disagree on parameters or audit settings (differs from ranks {odd});"
                " every rank must build the same model and Auditor(audit_every=..., mode=...)"
            )

    def _gather_inventory(self) -> dict[str, dict[str, Any]]:
        mine = json.dumps(rank_inventory(self.device)).encode()
        payloads = self._all_gather_bytes(mine)
        return {str(r): json.loads(b) for r, b in enumerate(payloads)}

    def _all_gather_bytes(self, data: bytes) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64, device=self.wire_device)
        sizes = [torch.empty_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.wire_device)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        out = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf, group=self.group)
        return [bytes(o[: int(s)].cpu().tolist()) for o, s in zip(out, sizes)]

    # --- events -----------------------------------------------------------------------------

    def _event(self, kind: str, outcome: str, *, step: int, suspects=(), contained=False, **details) -> AuditEvent:
        ev = AuditEvent(
            run=self.run,
            branch=self.branch,
            step=step,
            kind=kind,
            outcome=outcome,
            ranks=list(range(self.world)),
            suspect_ranks=sorted(int(s) for s in suspects),
            contained=contained,
            details=details,
            inventory=self.inventory if outcome == "fail" else {},
        )
        if self.rank == 0:
            self.sink.emit(ev)
            if ev.failed:
                self.sink.flush()
                if not contained and self.ledger is not None and not details.get("found_by"):
                    self._open_incident(ev)
        if len(self._events) < _MAX_LINEAGE:
            self._events.append((ev.step, ev.kind, ev.outcome))
        if self.last is not None:
            self.last.events.append(ev)
        return ev

    def _open_incident(self, ev: AuditEvent) -> None:
        # Every uncontained detection opens an incident, written by rank 0 as soon as it is known;
        # a ledger that cannot be written must not hide the detection itself (status opens it later).
        try:
            open_incident(self.ledger, ev.to_dict())
        except (CertckptError, OSError) as e:
            print(f"certckpt: could not record the incident in {self.ledger.store}: {e}", file=sys.stderr)

    def _fail(self, ev: AuditEvent, message: str, *, policy: str) -> None:
        if policy == "raise":
            incident = None if ev.contained else incident_id_for(ev.to_dict())
            raise FaultDetectedError(f"step {ev.step}: {message}", ev, incident_id=incident)

    # --- the step ---------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.audit_every == 0

    def train_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step with the checks; returns the (local) loss.

        Raises:
            FaultDetectedError: a check failed and the policy is ``raise`` (the update was not applied).
        """
        if self._first:
            check_shippable(batch)
            if self.check_determinism:
                self._check_deterministic(batch)
            self._first = False
        s = self.step + 1
        audit = self.is_audit_step(s)
        self.last = StepOutcome(step=s, audited=audit)
        rng = self._rng_state() if audit else None
        # The neighbour's micro-batch travels while this rank computes its own step.
        shift = (
            RingShift(
                {"batch": batch, "rng": rng}, group=self.group, wire_device=self.wire_device, out_device=self.device
            )
            if audit
            else None
        )
        self._zero_grad()
        self._hook.reset(audit=audit)
        if self.injector is not None:
            self.injector.begin(s, "train")
        loss = self.loss_fn(self.model, batch)
        if shift is not None:
            shift.advance()
        self._scaled(loss).backward()
        if self._hook.hand_over and not self._hook.handed_over_intact():
            raise AuditSetupError(
                f"rank {self.rank}: after backward, .grad no longer views DDP's reduced bucket "
                f"(torch {torch.__version__}"
                " changed how DDP finalizes gradients); construct the Auditor with hand_over_grads=False"
            )
        flags = self._read_flags()
        self.step = s  # the step is attempted from here on, applied or not
        if flags is not None:  # the same on every rank: all drain the shift, so no message is left behind
            if shift is not None:
                shift.finish()
            self._nonfinite_detected(s, flags)
            return loss.detach()
        self._checked_since_audit += 1
        if audit and not self._replay_audit(s, batch, rng, shift.finish()):
            return loss.detach()
        self.optimizer.step()
        if self.injector is not None:
            self.injector.after_optimizer(list(zip(self.param_names, self.params)))
        due = audit or (self.consensus_every is not None and s % self.consensus_every == 0)
        consensus_ok = self.weight_consensus(s) if due else True
        if audit:
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked_since_audit)
            self._checked_since_audit = 0
            if consensus_ok:
                self.last_clean_audit = s
        return loss.detach()

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

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss whose gradients, summed over the ranks, are DDP's averaged gradients.

        Dividing the scalar loss by the world size costs nothing, where dividing the gradients in
        the hook costs a pass over them. Replays scale the same way, so that a replayed gradient is
        bit-for-bit the local one.
        """
        return loss / self.world if self.world > 1 else loss

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    # --- check 1: non-finite ------------------------------------------------------------------

    def _nonfinite_detected(self, s: int, flags: tuple[list[int], list[int]]) -> None:
        self.last.applied = False
        pre = [r for r, f in enumerate(flags[0]) if f]
        post = [r for r, f in enumerate(flags[1]) if f]
        bad = [
            n for n, p in zip(self.param_names, self.params) if p.grad is not None and not torch.isfinite(p.grad).all()
        ]
        if pre:
            kind, suspects = "nonfinite-pre", pre
            msg = f"non-finite local gradients on rank(s) {pre} before the all-reduce"
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
        )
        self._zero_grad()
        self._fail(ev, msg + "; the update was not applied", policy="raise" if self.on_nonfinite == "raise" else "skip")

    # --- check 2: ring replay -------------------------------------------------------------------

    def _replay(self, module: torch.nn.Module, batch: Any, rng: dict[str, torch.Tensor], s: int) -> torch.Tensor:
        """Gradient signature of ``batch`` recomputed on this rank, leaving .grad and buffers alone.

        Each parameter's gradient is signed by a tensor hook as soon as backward produces it, and
        the hook hands autograd a zero-stride placeholder instead, so the gradient is freed at once:
        only one parameter's gradient is alive at a time. Keeping all of them until the end (as
        ``autograd.grad`` would) means as much fresh memory as the model on every audit, which on
        CPU costs a page fault per 4 KiB (about 12 ms per 36 MiB here) because the allocator hands
        such a block back to the system after each audit.
        """
        buffers = [b.detach().clone() for b in module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        rows: list[torch.Tensor | None] = [None] * len(self.params)

        def signer(i: int):
            probes = self._probes.subset([i]) if self._probes is not None else None

            def hook(grad: torch.Tensor) -> torch.Tensor:
                g = grad
                if self.injector is not None:  # drills only: a persistent fault corrupts replays too
                    g = grad.detach().clone()
                    self.injector.on_local_grads([self.param_names[i]], [g])
                rows[i] = signature([g.detach()], mode=self.mode, probes=probes)[0]
                return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

            return hook

        handles = [p.register_hook(signer(i)) for i, p in enumerate(self.params)]
        try:
            with torch.random.fork_rng(devices=devices):
                restore_rng(rng, self.device)
                if self.injector is not None:
                    self.injector.begin(s, "replay")
                loss = self.loss_fn(module, batch)
                torch.autograd.grad(self._scaled(loss), self.params, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for b, saved in zip(module.buffers(), buffers):
                    b.copy_(saved)
            if self.injector is not None:
                self.injector.begin(s, "train")
        for i, p in enumerate(self.params):
            if rows[i] is None:  # unused in this forward: DDP's bucket holds zeros for it
                probes = self._probes.subset([i]) if self._probes is not None else None
                rows[i] = signature([torch.zeros_like(p)], mode=self.mode, probes=probes)[0]
        return torch.stack(rows)

    def _check_deterministic(self, batch: Any) -> None:
        rng = self._rng_state()
        module = self.model.module
        a, b = self._replay(module, batch, rng, 0), self._replay(module, batch, rng, 0)
        same = matches(a.cpu(), b.cpu(), mode="deterministic", rtol=0)
        if not all(same):
            names = [n for n, ok in zip(self.param_names, same) if not ok][:5]
            raise AuditSetupError(
                f"rank {self.rank}: the model's gradients differ between two identical computations (e.g. {names});"
                " enable torch.use_deterministic_algorithms(True) or use Auditor(mode='tolerance')"
            )

    def _replay_audit(self, s: int, batch: Any, rng: dict[str, torch.Tensor], prev: dict[str, Any]) -> bool:
        """Run the ring replay of ``prev`` (the previous rank's batch and RNG state); returns whether
        the update may be applied."""
        local = torch.stack([self._hook.local_sig[i] for i in range(len(self.params))])
        replay = self._replay(self.model.module, prev["batch"], prev["rng"], s)
        gathered = self._gather_rows(torch.stack([local, replay]))  # [W, 2, P, ...]
        failed, mismatched = [], {}
        for origin, replayer in ring_pairs(self.world):
            ok = matches(gathered[replayer][1], gathered[origin][0], mode=self.mode, rtol=self.rtol)
            if not all(ok):
                failed.append((origin, replayer))
                mismatched[f"{origin}->{replayer}"] = [n for n, good in zip(self.param_names, ok) if not good][:10]
        if not failed:
            self._event("replay", "pass", step=s, comparisons=len(ring_pairs(self.world)), mode=self.mode)
            return True
        self.last.applied = False
        # A replay can only be trusted between replicas that hold the same weights: check first.
        if not self.weight_consensus(s - 1, found_by="replay precondition"):
            self._zero_grad()
            return False
        arbitration = self._arbitrate(s, failed, batch, rng, gathered)
        verdict = attribute_replay(self.world, failed, arbitration)
        ev = self._event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            contained=False,
            mode=self.mode,
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

    def _arbitrate(self, s, failed, batch, rng, gathered) -> dict[tuple[int, int], str]:
        """For each failed comparison no persistent fault explains, a third rank replays the batch."""
        results: dict[tuple[int, int], str] = {}
        for origin, replayer, arbiter in arbitration_plan(self.world, failed):
            if self.rank == origin:
                send_payload(
                    {"batch": batch, "rng": rng},
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
                sig = self._replay(self.model.module, got["batch"], got["rng"], s).cpu()
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
        if not self.params:
            raw = torch.zeros(0, dtype=torch.int64)
        elif fingerprints:
            raw = torch.stack([raw_sum(as_words(p.detach())) for p in self.params])
        else:
            raw = digests([p.detach() for p in self.params])
        rows = [r.tolist() for r in self._gather_rows(raw)]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            details: dict[str, Any] = {"params": len(self.params)}
            if fingerprints:
                fps = {n: f"{finalize(r, p):016x}" for n, r, p in zip(self.param_names, rows[0], self.params)}
                details["fp"] = state_fingerprint(fps)
                self._consensus = (s, fps, details["fp"])
            if found_by is None:
                self._event("consensus", "pass", step=s, **details)
            return True
        names = [self.param_names[j] for j in verdict.mismatched][:20]
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
        first = (self.last_checkpoint_step or 0) + 1
        audits = [{"step": st, "kind": k, "outcome": o} for st, k, o in self._events]
        fps = self._consensus[1] if self._consensus else {}
        lineage = {
            "audit_every": self.audit_every,
            "world": self.world,
            "mode": self.mode,
            "audits": audits,
            "last_clean_audit": self.last_clean_audit,
            "consensus": {"step": s, "fp": self._consensus[2]} if self._consensus else None,
        }
        result, error = None, None
        if self.rank == 0:
            known = {
                (p.data_ptr(), p.dtype, tuple(p.shape), p.stride(), str(p.device)): (n, fps[n])
                for n, p in zip(self.param_names, self.params)
                if n in fps
            }
            try:
                result = save_certified(
                    obj,
                    f,
                    step=s,
                    run=self.run,
                    branch=self.branch,
                    parent=self.parent,
                    step_range=[first, s],
                    lineage=lineage,
                    consensus_fp=self._consensus[2] if self._consensus else None,
                    known_fingerprints=known,
                    **kwargs,
                )
                self.sink.flush()  # the events up to this checkpoint reach the ledger before its commit record
                if self.ledger is not None:
                    self.ledger.commit_checkpoint(
                        branch=self.branch,
                        step=s,
                        location=str(f),
                        run=self.run,
                        parent=self.parent,
                        consensus_fp=self._consensus[2] if self._consensus else None,
                        state_fp=result.state_fp,
                        header_digest=result.header_digest,
                        step_range=[first, s],
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
