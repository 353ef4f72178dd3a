"""``ZeroAudit``: the weight consensus and a cross-rank replay audit in a DeepSpeed ZeRO-1/2 loop.

DeepSpeed owns the gradient reduction (no DDP model, so no certckpt communication hook): ZeRO-2
reduce-scatters each gradient inside its own backward hooks and ZeRO-1 reduces them in its step,
consuming the local gradients. What is cleanly possible from the loop, through the public engine:

- **weight consensus** after ``engine.step()``: under ZeRO-1/2 every rank holds the full weights
  (the module's parameters, refreshed from the fp32 partitions after each step) and buffers. Every
  rank fingerprints them (``certckpt.fingerprint_many``), the rows are all-gathered, and a strict
  majority outvotes the others, who are named (>= 3 ranks; with 2, a disagreement names both).
- **cross-rank replay** before ``engine.step()`` at audit steps: every rank recomputes the gradients
  of its own micro-batches and of its ring predecessor's (shipped as safetensors bytes with their
  RNG state) on the bare module with ``torch.autograd.grad`` (DeepSpeed's gradient hooks and
  ``.grad`` untouched), with the weights before the update. The predecessor's own recomputation
  and the replay must be bit-equal; a failed comparison is first checked against the weight
  consensus (the replicas must hold the same weights), then arbitrated by a third rank, and
  ``certckpt.detect.attribute_replay`` names the rank. It compares recomputations: a fault that
  repeats on a unit (persistent) is caught and named; a one-time fault inside DeepSpeed's own
  backward is not (training's local gradients are never seen).

- **non-finite gradients** after ``engine.step()``, every step: the global norm of the reduced
  gradients that DeepSpeed's ZeRO optimizer computes (``engine.get_global_grad_norm()``, the same on
  every rank) must be finite; at audit steps, every rank's recomputation of its own micro-batches
  too (a non-finite one names that rank). DeepSpeed skips a step whose reduced gradients are not
  finite (fp32; fp16's loss scaler): such a detection is contained. Under fp16 a skipped step is
  the loss scaler's overflow, recorded as such (no detection).

- **the resume proof** after a certified ``engine.load_checkpoint``: before the first update (at the
  audit's construction when it is built after the load, else at the next ``begin_micro_batch``),
  the consensus runs on the loaded weights and its state fingerprint must be the ``consensus_fp``
  the loaded checkpoint's record carries (a checkpoint saved with a ``ZeroAudit``): a wrong,
  partial or damaged load, or weights changed after it, is refused on every rank (the DDP
  session's ``expect_consensus_fp``).

The events go where the DDP session's go, through the same machinery (``context.EventLog``,
``events.emit_event``): rank 0 publishes them to the run store's ledger (the certified engine's:
``certify_engine(engine, ledger=DIR)``, else the directory of the first ``load_checkpoint`` or
``save_checkpoint``; kept in memory until then), a failure that reached the weights opens an
incident naming the ranks, and every rank raises ``FaultDetectedError`` together. A checkpoint that
``certify_engine``'s save commits runs the fingerprint consensus at its step (unless it ran there
already), checks that the module weights written are the ones agreed on, and carries the consensus
fingerprint, the step range and the audit lineage in its record: with passing audits it becomes
``trusted`` (docs/trust.md).

ZeRO-3 partitions the weights (each piece has one holder: nothing to compare) and gathers them in
forward hooks that are collectives, so the checks are refused there (docs/detection.md,
"DeepSpeed"): its checkpoints reach ``verified``.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from certckpt.detect.agreement import all_gather_bytes, refuse_together, wire_device_for
from certckpt.detect.attribution import arbitration_plan, attribute_replay, consensus_verdict, ring_pairs
from certckpt.detect.context import EventLog, SessionState
from certckpt.detect.core import lineage_evidence
from certckpt.detect.events import AuditEvent, log_audit_pass, rank_inventory
from certckpt.detect.evidence import CheckpointEvidence
from certckpt.detect.inject import Fault, Injector
from certckpt.errors import AuditSetupError
from certckpt.format.fingerprinting import fingerprint_many
from certckpt.format.record import state_fingerprint
from certckpt.trust.ledger import Ledger, LedgerSink

from .engine import CertifiedCheckpointEngine, Resumed

__all__ = ["ZeroAudit"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]

# What a failed consensus says, by the check that asked for it.
_CONSENSUS_LEAD = {
    "resume": "the weights loaded differ across replicas (checked before the first update)",
    "replay precondition": "the replay failed, and the weights it ran on differ across replicas",
}


class StoreSink:
    """Rank 0's event sink of a ``ZeroAudit``: the run store's ``LedgerSink`` once the store is known
    (``bind``), the events kept in memory until then (at most ``max_pending``)."""

    def __init__(self, max_pending: int = 100_000) -> None:
        self.target: LedgerSink | None = None
        self.pending: collections.deque[AuditEvent] = collections.deque(maxlen=max_pending)

    def emit(self, event: AuditEvent) -> None:
        if self.target is not None:
            self.target.emit(event)
        else:
            self.pending.append(event)

    def flush(self) -> None:
        if self.target is not None:
            self.target.flush()

    def bind(self, ledger: Ledger) -> bool:
        """Send the events to ``ledger`` from now on (those kept so far first); False when bound to
        that store already."""
        if self.target is not None and self.target.ledger.store == ledger.store:
            return False
        if self.target is not None:
            self.target.flush()
        self.target = LedgerSink(ledger)
        while self.pending:
            self.target.emit(self.pending.popleft())
        return True


class ZeroAudit:
    """The checks of a ZeRO-1/2 run; every rank builds one (collective) after ``deepspeed.initialize``,
    after ``certify_engine(engine)`` and its ``load_checkpoint`` when resuming.

    Args:
        engine: the ``DeepSpeedEngine``.
        loss_fn: ``loss_fn(module, batch) -> loss``: what the loop computes for one micro-batch,
            called on the bare module for replays.
        audit_every: replay every N optimizer steps (and run the consensus then).
        consensus_every: also run the consensus every N steps (default: audit steps only).
        injector_faults: synthetic faults for tests and drills (``certckpt.detect.Fault``).

    Example:
        >>> certify_engine(engine)
        >>> audit = ZeroAudit(engine, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), audit_every=10)
        >>> for batch in loader:
        ...     audit.begin_micro_batch(batch)
        ...     engine.backward(loss_fn(engine, batch))
        ...     audit.before_update()        # at audit steps: the replay (before the weights change)
        ...     engine.step()
        ...     audit.after_update()         # the non-finite check, the weight consensus
        >>> audit.close()                    # the last events to the ledger
    """

    def __init__(
        self,
        engine: Any,
        *,
        loss_fn: LossFn,
        audit_every: int = 10,
        consensus_every: int | None = None,
        injector_faults: Sequence[Fault] | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise AuditSetupError("torch.distributed is not initialized: deepspeed.init_distributed() first")
        self.engine, self.loss_fn = engine, loss_fn
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.wire = wire_device_for(self.group, torch.device(engine.device))
        self.audit_every, self.consensus_every = int(audit_every), consensus_every
        self.stage = stage = int(engine.zero_optimization_stage())
        problem = None
        if stage >= 3:
            problem = (
                "ZeRO-3 partitions the weights (one holder per piece: no replica to compare) and gathers them in "
                "collective forward hooks (no bare-module replay); checkpoints are certified (verified), not audited"
            )
        elif self.world < 2:
            problem = "one rank: nothing to compare with"
        elif self.audit_every < 1 or (consensus_every is not None and consensus_every < 1):
            problem = "audit_every and consensus_every must be >= 1"
        refuse_together(problem, group=self.group, wire_device=self.wire, what="ZeroAudit set-up")
        self.module: torch.nn.Module = engine.module
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.injector = Injector(injector_faults, rank=self.rank) if injector_faults else None
        if self.injector is not None:
            self.injector.install(self.module)
        self.fp16 = bool(engine.fp16_enabled())
        start = int(engine.global_steps)  # optimizer steps done
        self.state = SessionState(step=start, last_clean_audit=start or None, last_checkpoint_step=start or None)
        self.units: list[tuple[Any, torch.Tensor]] = []  # this step's micro-batches and their RNG states
        self.passed: list[tuple[str, int]] = []  # (check, step) that ran and passed
        self._checked = 0  # steps whose reduced gradients were checked finite since the last audit
        self._replayed: tuple[int, list[int]] | None = None  # (step, ranks whose own recomputation was not finite)
        self._agreed: tuple[int, dict[str, str], str] | None = None  # (step, {tensor: fp}, state fp)
        self._seconds = 0.0  # the last replay's time (the audit's log line)
        self._resume: Resumed | None = None  # a load whose weights are still to be proven the saved ones
        self.sink = StoreSink()
        ce = self._certified()
        self.report = EventLog(
            run=(ce.run if ce is not None else None) or "run",
            branch=ce.branch if ce is not None else "main",
            rank=self.rank,
            world=self.world,
            group=self.group,
            wire_device=self.wire,
            sink=self.sink,
            ledger=None,
            state=self.state,
        )
        mine = json.dumps(rank_inventory(torch.device(engine.device), rank=self.rank)).encode()
        rows = all_gather_bytes(mine, group=self.group, wire_device=self.wire)
        self.report.inventory = {str(r): json.loads(b) for r, b in enumerate(rows)}
        if ce is not None:
            ce.attach(self)
            if ce.resumed is not None and ce.resumed.step == start:  # built after the resuming load
                self._resume = ce.resumed
        self._prove_resumed()  # the start of the session: before any step

    # --- where the events go --------------------------------------------------------------------

    def _certified(self) -> CertifiedCheckpointEngine | None:
        ce = getattr(self.engine, "checkpoint_engine", None)
        return ce if isinstance(ce, CertifiedCheckpointEngine) else None

    @property
    def step(self) -> int:
        """Optimizer steps done (``engine.global_steps`` at the last ``after_update``)."""
        return self.state.step

    @property
    def branch(self) -> str:
        return self.report.branch

    def bind(self, ledger: Ledger, *, run: str) -> None:
        """The run store the checkpoints are committed to receives the events (rank 0 writes them);
        called by the certified checkpoint engine when it learns where that is."""
        self.report.run = run
        if self.rank == 0:
            self.sink.bind(ledger)
            self.report.ledger = ledger

    def restart(self, step: int, *, branch: str, resumed: Resumed | None = None) -> None:
        """A checkpoint was loaded: the audits go on from ``step`` on ``branch`` (a new lineage).
        ``resumed``'s weights are proven at the next hook point (``begin_micro_batch``), before the
        first forward: whatever changes them after the load is caught too."""
        self.flush()
        self.report.branch = branch
        self.state.step = step
        self.state.lineage = []
        self.state.last_clean_audit = self.state.last_checkpoint_step = step or None
        self.units, self._replayed, self._agreed, self._checked = [], None, None, 0
        self._resume = resumed

    def _prove_resumed(self) -> None:
        """After a resuming load, before the first update (collective): every replica holds exactly
        the weights of the checkpoint loaded. The replicas must agree (a disagreement is a fault, as
        at any consensus, naming the odd ranks) and their state fingerprint must be the consensus
        fingerprint the checkpoint's record carries (else every rank refuses: every rank computes the
        same agreed value). Stays pending until it passes: a caught refusal is refused again."""
        r = self._resume
        if r is None or r.consensus_fp is None:
            self._resume = None
            return
        _, agreed = self.consensus(r.step, found_by="resume")
        if agreed != r.consensus_fp:
            raise AuditSetupError(
                f"the weights loaded for step {r.step} have consensus fingerprint {agreed}, but the checkpoint "
                f"loaded ({r.parent or r.directory}) recorded {r.consensus_fp}: every rank must hold exactly the "
                "weights engine.load_checkpoint loaded (nothing was updated); load it again before training"
            )
        self._resume = None

    def _follow(self) -> None:
        """Events carry the branch the checkpoints go on (a resume starts a new one)."""
        ce = self._certified()
        if ce is not None:
            self.report.branch = ce.branch

    def flush(self) -> None:
        """Write the events so far to the ledger (rank 0; before a checkpoint's commit, at audits)."""
        if self.rank == 0:
            self.sink.flush()

    def close(self) -> None:
        """The last events to the ledger and a drill's injector removed (not a collective)."""
        self.flush()
        if self.injector is not None:
            self.injector.remove()

    # --- the hook points ------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.audit_every == 0

    def begin_micro_batch(self, batch: Any) -> None:
        """Before each micro-batch's forward: keep it (and the RNG state it starts from) at audit steps."""
        if self._resume is not None:
            self._prove_resumed()
        s = self.state.step + 1
        if self.injector is not None:
            self.injector.begin(s, "train")
        if self.is_audit_step(s):
            self.units.append((batch, torch.get_rng_state()))

    def before_update(self) -> None:
        """After the step's last backward, before ``engine.step()``: the replay at audit steps.

        Raises:
            FaultDetectedError: on every rank, when the replay names a rank (or cannot tell which),
                or the replicas' weights before the update differ (checked first when it fails).
        """
        if self._resume is not None:
            self._prove_resumed()
        s = self.state.step + 1
        if not self.is_audit_step(s):
            return
        self._follow()
        t0 = time.perf_counter()
        units, self.units = self.units, []
        payloads = all_gather_bytes(_pack(units), group=self.group, wire_device=self.wire)
        steps = [_unpack(p) for p in payloads]
        origin = (self.rank - 1) % self.world
        own, own_finite = self._replay(steps[self.rank], s)
        prev, _ = self._replay(steps[origin], s)
        mine = [own, prev, own_finite]
        rows = [
            json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), group=self.group, wire_device=self.wire)
        ]
        self._replayed = (s, [r for r, row in enumerate(rows) if not row[2]])
        failed = [(o, r) for o, r in ring_pairs(self.world) if rows[o][0] != rows[r][1]]
        if not failed:
            self.report.event(
                "replay",
                "pass",
                step=s,
                comparisons=len(ring_pairs(self.world)),
                mode="exact",
                micro_batches=len(units),
                replayed_micro_batches=len(steps[origin]),
            )
            self.passed.append(("replay", s))
            self._seconds = time.perf_counter() - t0
            return
        # A replay can only be trusted between replicas that hold the same weights (the ones before
        # this update): check first, as the DDP session does; a disagreement names the odd ranks.
        self.consensus(s - 1, found_by="replay precondition")
        plan = arbitration_plan(self.world, failed)
        asked = {(o, r): self._replay(steps[o], s)[0] for o, r, a in plan if a == self.rank}
        said = json.dumps([[o, r, v] for (o, r), v in asked.items()]).encode()
        outcome: dict[tuple[int, int], str] = {}
        for blob in all_gather_bytes(said, group=self.group, wire_device=self.wire):
            for o, r, v in json.loads(blob):
                outcome[(o, r)] = "origin" if v == rows[o][0] else "replayer" if v == rows[r][1] else "neither"
        verdict = attribute_replay(self.world, failed, outcome)
        ev = self.report.event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            contained=False,
            mode="exact",
            micro_batches=len(units),
            replayed_micro_batches=len(steps[origin]),
            failed=[{"origin": o, "replayer": r} for o, r in failed],
            arbitration={f"{o}->{r}": v for (o, r), v in outcome.items()},
            notes=list(verdict.notes),
        )
        who = f"suspect rank(s) {list(verdict.suspects)}" if verdict.suspects else "no rank could be named"
        notes = f" ({'; '.join(verdict.notes)})" if verdict.notes else ""
        self.report.fail(ev, f"replay audit failed: {who}{notes}", policy="raise")

    def after_update(self) -> None:
        """After ``engine.step()``: the non-finite check, and the weight consensus at audit (and
        ``consensus_every``) steps.

        Raises:
            FaultDetectedError: on every rank: non-finite gradients, or the ranks the majority outvoted.
        """
        s = int(self.engine.global_steps)
        if s == self.state.step:
            return  # no optimizer step since the last call (a gradient accumulation boundary not reached)
        self.state.step = s
        self._follow()
        t0 = time.perf_counter()
        if self.injector is not None:
            self.injector.begin(s, "train")
            self.injector.after_optimizer(list(zip(self.names, self.params)))
        self._check_finite(s)
        audit = self.is_audit_step(s)
        if audit or (self.consensus_every is not None and s % self.consensus_every == 0):
            self.consensus(s)
        if audit:
            self.report.event("nonfinite", "pass", step=s, steps_checked=self._checked)
            if self._replayed is not None and self._replayed[0] == s:  # replay, non-finite checks, consensus
                self.state.last_clean_audit = s
                if self.rank == 0:
                    seconds = self._seconds + time.perf_counter() - t0
                    log_audit_pass(step=s, branch=self.branch, ranks=self.world, checked=self._checked, seconds=seconds)
            self._checked = 0
            self.flush()  # the audit's events reach the ledger now: a checkpoint before it is trusted from here on

    def _check_finite(self, s: int) -> None:
        """The reduced gradients of step s were finite (DeepSpeed's global gradient norm), and at an
        audit step every rank's recomputation of its own micro-batches."""
        norm = self.engine.get_global_grad_norm()
        value = None if norm is None else float(norm)
        local = self._replayed[1] if self._replayed is not None and self._replayed[0] == s else []
        if not local and (value is None or math.isfinite(value)):
            self._checked += value is not None  # no norm (compute_grad_norm off): nothing checked
            return
        applied = bool(self.engine.was_step_applied())
        if self.fp16 and not applied and not local:
            # the loss scaler's overflow: DeepSpeed skipped the update by design
            self.report.event("overflow", "pass", step=s, contained=True, scale=float(self.engine.optimizer.loss_scale))
            return
        kind = "nonfinite-pre" if local else "nonfinite-post"
        ev = self.report.event(
            kind,
            "fail",
            step=s,
            suspects=local,
            contained=not applied,
            grad_norm=str(value),
            applied=applied,
            pre_ranks=local,
        )
        if local:
            msg = f"non-finite gradients recomputed from rank(s) {local}'s own micro-batches"
        else:
            msg = f"the reduced gradients' norm is {value}: suspect the reduction or a rank's backward"
        msg += "; DeepSpeed skipped the update" if not applied else "; the update was applied"
        self.report.fail(ev, msg, policy="raise")

    def consensus(self, s: int, *, found_by: str | None = None) -> tuple[dict[str, str], str]:
        """Every rank's fingerprints of the full weights and floating-point buffers, compared;
        returns ``({tensor: fingerprint}, state fingerprint)`` they agree on. ``found_by``: the check
        that asked for it (``"resume"``, ``"replay precondition"``): a pass is then no event of its
        own, a failure carries it.

        Raises:
            FaultDetectedError: on every rank, naming the ranks the majority outvoted.
        """
        buffers = [(n, b) for n, b in self.module.named_buffers() if b.is_floating_point()]
        tensors = [p.detach() for p in self.params] + [b for _, b in buffers]
        names = self.names + [n for n, _ in buffers]
        row = fingerprint_many(tensors)
        rows = [
            json.loads(b) for b in all_gather_bytes(json.dumps(row).encode(), group=self.group, wire_device=self.wire)
        ]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            fps = {n: f"{fp:016x}" for n, fp in zip(names, row)}
            fp = state_fingerprint(fps)
            self._agreed = (s, fps, fp)
            if found_by is None:
                self.report.event("consensus", "pass", step=s, params=len(self.params), buffers=len(buffers), fp=fp)
                self.passed.append(("consensus", s))
            return fps, fp
        self._agreed = None
        where = [names[i] for i in verdict.mismatched][:20]
        minority = list(verdict.minority_ranks) if verdict.majority is not None else []
        ev = self.report.event(
            "consensus",
            "fail",
            step=s,
            suspects=minority,
            contained=False,
            tensors=where,
            majority=verdict.majority is not None,
            **({"found_by": found_by} if found_by else {}),
            **({} if verdict.majority is not None else {"note": "no majority: every rank differs (or a tie)"}),
        )
        lead = _CONSENSUS_LEAD.get(found_by or "", "weight consensus failed")
        self.report.fail(
            ev,
            f"{lead}: rank(s) {minority or 'no majority'} hold other weights than the majority (tensors {where[:5]})",
            policy="raise",
        )
        raise AssertionError("unreachable: EventLog.fail raises")  # pragma: no cover

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_evidence(self, s: int) -> CheckpointEvidence:
        """What a checkpoint at step s carries (collective: the certified engine's save calls it on
        every rank): the fingerprint consensus at s unless it ran there already, and the lineage since
        the previous checkpoint. ``tensor_fps`` are the agreed fingerprints by module name.

        Raises:
            FaultDetectedError: on every rank, the replicas disagree.
        """
        self._follow()
        if self._resume is not None:
            self._prove_resumed()  # a save right after the load: its weights are the loaded ones first
        if self._agreed is not None and self._agreed[0] == s:
            fps, fp = self._agreed[1], self._agreed[2]
        else:
            fps, fp = self.consensus(s)
        ce = self._certified()
        head = {
            "integration": "deepspeed",
            "zero_stage": self.stage,
            "audit_every": self.audit_every,
            "world": self.world,
            "mode": "exact",
        }
        return lineage_evidence(
            self.state,
            s,
            run=self.report.run,
            branch=self.report.branch,
            parent=ce.parent if ce is not None else None,
            head=head,
            consensus_fp=fp,
            tensor_fps=fps,
        )

    def end_lineage(self, s: int) -> None:
        """A checkpoint at step s was committed: the next one's lineage starts after it."""
        self.state.last_checkpoint_step = s
        self.state.lineage = []

    # --- the replay -----------------------------------------------------------------------------

    def _replay(self, units: list[tuple[Any, torch.Tensor]], s: int) -> tuple[list[int], bool]:
        """Fingerprints of the gradients of ``units`` (averaged as DeepSpeed averages them over its
        accumulation), computed on the bare module, and whether they are all finite; ``.grad`` and
        the RNG state are left as found."""
        if self.injector is not None:
            self.injector.begin(s, "replay")
        saved = torch.get_rng_state()
        try:
            total: list[torch.Tensor] | None = None
            for batch, rng in units:
                torch.set_rng_state(rng)
                loss = self.loss_fn(self.module, batch) / max(len(units), 1)
                grads = torch.autograd.grad(loss, self.params, allow_unused=True)
                got = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.params)]
                total = got if total is None else [a + b for a, b in zip(total, got)]
            total = total or []
            finite = all(bool(torch.isfinite(g).all()) for g in total)
            return fingerprint_many(total), finite
        finally:
            torch.set_rng_state(saved)
            if self.injector is not None:
                self.injector.begin(s, "train")


def _pack(units: list[tuple[Any, torch.Tensor]]) -> bytes:
    """This step's micro-batches as safetensors bytes (no pickle): tensors or tuples/lists of tensors."""
    tensors: dict[str, torch.Tensor] = {}
    shape: list[int] = []
    for i, (batch, rng) in enumerate(units):
        parts = [batch] if isinstance(batch, torch.Tensor) else list(batch)
        if not all(isinstance(t, torch.Tensor) for t in parts):
            raise AuditSetupError("ZeroAudit replays batches that are a tensor or a tuple/list of tensors")
        shape.append(-1 if isinstance(batch, torch.Tensor) else len(parts))
        for j, t in enumerate(parts):
            tensors[f"{i}.{j}"] = t.detach().cpu().contiguous()
        tensors[f"{i}.rng"] = rng
    return st_save(tensors, metadata={"shape": json.dumps(shape)})


def _unpack(blob: bytes) -> list[tuple[Any, torch.Tensor]]:
    tensors = st_load(blob)
    n = int.from_bytes(blob[:8], "little")  # safetensors: u64 header length, then the JSON header
    shape = json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["shape"])
    out = []
    for i, k in enumerate(shape):
        parts = [tensors[f"{i}.{j}"] for j in range(max(k, 1))]
        out.append((parts[0] if k == -1 else tuple(parts), tensors[f"{i}.rng"]))
    return out
