"""Detection under FSDP2 / HSDP: weight consensus per shard, non-finite reduced gradients, ring replay.

Under FSDP2 (``fully_shard``) every rank holds a shard of each parameter as a ``DTensor``; under HSDP
(a 2-D mesh, replicate x shard) each shard is held by one rank per replica group, and those replicas
must hold identical values after every optimizer step. ``ShardedAuditSession`` checks that, and the
gradients the optimizer is about to use, from any loop::

    session = ShardedAuditSession(model, opt, run="exp1", ledger="runs/exp1")
    for batch in loader:
        loss_fn(model, batch).backward()
        if session.before_update():        # non-finite reduced gradients, agreed by every rank
            opt.step()
        session.after_update()             # weight consensus across replicas, per shard
        opt.zero_grad(set_to_none=True)
        if session.step % 100 == 0:
            state = {"model": model.state_dict()}
            dcp.save(state, storage_writer=CertifiedWriter(url, evidence=session.checkpoint_evidence(state),
                                                           ledger="runs/exp1"))

The consensus uses the sharding-independent fingerprint of ``docs/format.md`` ("Sharded checkpoints
(DCP)"): each rank computes the *contribution* of every piece it holds (a DTensor's local shard at its
global offsets, a plain tensor as a whole copy). Ranks holding the same region must produce the same
contribution (a vote names the minority; two replicas that disagree are a tie that names both as
candidates but neither as suspect); the agreed contributions of the regions that partition a tensor
compose to its full-tensor fingerprint, and those to the whole-state fingerprint that
``certckpt.dcp.CertifiedWriter``'s manifest records for the same state. Events are the DDP auditor's
kinds (``replay``, ``nonfinite``, ``nonfinite-post``, ``consensus``), so the certifier reads them
unchanged.

With ``loss_fn`` the session also runs the ring replay audit every ``audit_every`` steps
(``sharded_replay.py``: each layer's local gradient is signed at its reduce-scatter, and every rank
recomputes its predecessor's micro-batches through the sharded model); the loop then calls
``begin_micro_batch(unit)`` before each micro-batch's forward. An audit step is a full audit (replay,
non-finite, consensus), so DCP checkpoints of such a run become ``trusted`` once the next audit
passes (see ``docs/detection.md``, "Sharded training: FSDP2 and HSDP"). Between audits, per-layer
sentinels replay the step they doubt, before its update (``sharded_trigger.py``).

What the session shares with DDP's ``AuditSession`` (start-up, options agreed by every rank, ledger,
sink and signing key, node inventory, fleet check, step counters, lineage, ``flush``/``close``) is
``core.AuditSessionCore``, its base class; its checks report through the same ``context.EventLog``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.tensor import DTensor

from certckpt.errors import AuditSetupError, ConfigurationError
from certckpt.format.sharded.regions import local_regions
from certckpt.format.signing import SigningKey
from certckpt.trust.ledger import Ledger

from .agreement import all_gather_bytes
from .core import AuditSessionCore
from .events import EventSink
from .evidence import CheckpointEvidence
from .exchange import refuse_unshippable
from .inject import Fault, Injector
from .options import DDP_ONLY, AuditOptions
from .setup_checks import nonfinite_read_problem
from .sharded_audit import ShardedReplayAudit
from .sharded_consensus import ShardConsensus, decide_consensus
from .sharded_context import ShardedContext, ShardedState
from .sharded_nonfinite import ShardedNonFiniteCheck
from .sharded_replay import (
    GradientRecorder,
    shard_group_size,
    update_inputs,
)
from .sharded_trigger import ShardedSentinels
from .timing import timed

# The drill's fault kinds this session can plant: in a module's forward, or in a layer's local
# gradient at its reduce-scatter (the others act on DDP's buckets or on replicated weights).
SHARDED_FAULTS = ("forward", "backward", "non-finite")

__all__ = ["ShardedAuditSession", "ShardConsensus", "local_regions"]


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _faults_problem(faults: list[Any], *, replays: bool) -> str | None:
    """Why a drill's faults cannot be planted in this session (None: they can)."""
    if not replays:
        return "injector_faults needs loss_fn: faults are planted at the replay's reduce-scatter"
    odd = sorted({f.kind for f in faults if not isinstance(f, Fault) or f.kind not in SHARDED_FAULTS})
    if odd or not all(isinstance(f, Fault) for f in faults):
        return f"ShardedAuditSession plants only {', '.join(SHARDED_FAULTS)} faults, got {odd}"
    return None


def _replay_problem(model: torch.nn.Module, loss_fn: Any, audit_every: Any) -> str | None:
    """Why the replay audit cannot run on this model (None: it can)."""
    from torch.distributed.fsdp import FSDPModule

    if not callable(loss_fn):
        return "loss_fn must be callable as loss_fn(model, unit) -> scalar loss"
    if type(audit_every) is not int or audit_every < 1:
        return f"audit_every must be an int >= 1, got {audit_every!r}"
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return "the replay signs gradients at FSDP2's reduce-scatter: no module was fully_shard-ed"
    if shard_group_size(model) < 2:
        return (
            "the parameters are not sharded over 2 or more ranks (a mesh's shard dimension of size 1 has no"
            " reduce-scatter to sign at): that is plain data parallelism; audit it with DDP and AuditSession"
        )
    return None


class ShardedAuditSession(AuditSessionCore):
    """The checks of an FSDP2 / HSDP run (see the module docstring).

    Every rank constructs one after ``fully_shard`` and before the first backward (a collective: the
    ranks agree on the set-up or all refuse together), and calls ``before_update()`` after the step's
    last backward (FSDP has reduce-scattered the gradients, and all-reduced them across replicas under
    HSDP), ``after_update()`` after the optimizer step (whether it ran or not), and
    ``checkpoint_evidence(state)`` where a checkpoint is taken. With ``loss_fn`` (the replay audit),
    also ``begin_micro_batch(unit)`` before each micro-batch's forward::

        session = ShardedAuditSession(model, opt, loss_fn=lambda m, u: F.mse_loss(m(u[0]), u[1]),
                                      audit_every=10, ledger="runs/exp1")
        for batch in loader:
            session.begin_micro_batch(batch)
            F.mse_loss(model(batch[0]), batch[1]).backward()
            if session.before_update():
                opt.step()
            session.after_update()
            opt.zero_grad(set_to_none=True)

    Args:
        model: the ``fully_shard``-ed module (its parameters are DTensors).
        optimizer: its optimizer (its gradients are dropped when an update is refused).
        run, branch, parent: the run's identity, recorded in events and checkpoints.
        loss_fn: ``loss_fn(model, unit) -> scalar loss``, what the loop back-propagates for one
            micro-batch (before dividing by the accumulation count): enables the ring replay audit.
            Called on the sharded model itself; it must be a pure function of the weights, the
            batch and the RNG state. None: no replay (checkpoints reach ``verified`` at most).
        options: a ``certckpt.detect.AuditOptions`` (or its fields as keywords): ``audit_every``,
            ``consensus_every`` (default None: at audit steps and checkpoints; every step costs
            1.36-1.48x plain FSDP2 in a 4-rank CPU run, every 10th 1.11-1.19x), ``on_nonfinite``,
            ``on_fault``, ``nonfinite_read`` (deferred: the flags are exchanged by an asynchronous
            all-gather and read at the next step), ``check_determinism`` (refuse, at the first step,
            a replay that does not reproduce what training reduce-scattered) and ``audit_updates``
            (recompute each rank's optimizer step at audits: on by default on a 1-D mesh; needs
            ``loss_fn``; the loop must not change the gradients between ``before_update()`` and
            ``opt.step()`` other than by clipping) and ``state_fn`` (what the per-step consensus
            covers, as a DCP state dict; default ``{"model": model.state_dict()}``: parameters and
            buffers) and ``triggers`` (with ``loss_fn``: per-layer sentinels at each reduce-scatter
            replay a step they doubt before its update, ``sharded_trigger.py``; on by default).
            The DDP-only options are refused.
        group: the process group of every rank of the mesh (default: the default group).
        sink: where rank 0 emits events (default: the ledger's, else in memory).
        ledger: a ``certckpt.Ledger`` or run store URL: events and incidents go there.
        signing_key: sign every ledger record the session writes (events, incidents, the placement
            of a fleet run; ``docs/signing.md``): a ``SigningKey`` or a private key file; default
            ``$CERTCKPT_SIGNING_KEY``, if set. The DCP writer signs the checkpoint's files itself.
        start_step: optimizer steps already done (when resuming).
        expect_consensus_fp: when resuming, the consensus fingerprint the parent checkpoint recorded
            (``certckpt.plan_resume(...).consensus_fp``): a consensus over ``resume_state`` runs at
            construction and every rank refuses together (``AuditSetupError``) unless the replicas
            agree on exactly that state, so a run cannot resume from weights other than the
            checkpoint's.
        resume_state: the state that checkpoint was taken of, as loaded (the dict given to
            ``checkpoint_evidence`` and ``dcp.load``); default ``state_fn()``.
    """

    STATE: ClassVar[type[ShardedState]] = ShardedState
    UNUSED = DDP_ONLY
    NAME = "ShardedAuditSession"
    SETUP = "sharded audit set-up"
    state: ShardedState

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run: str = "run",
        branch: str = "main",
        parent: str | None = None,
        group: Any = None,
        sink: EventSink | None = None,
        ledger: Ledger | str | None = None,
        signing_key: SigningKey | str | None = None,
        start_step: int = 0,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        options: AuditOptions | None = None,
        expect_consensus_fp: str | None = None,
        resume_state: dict[str, Any] | None = None,
        **shorthand: Any,
    ) -> None:
        self.loss_fn = loss_fn
        self.params: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.audit_updates = False
        self._recorder: GradientRecorder | None = None
        super().__init__(
            model,
            optimizer,
            group=group,
            options=options,
            shorthand=shorthand,
            problem=self._setup_problem,
            run=run,
            branch=branch,
            parent=parent,
            sink=sink,
            ledger=ledger,
            signing_key=signing_key,
            start_step=start_step,
        )
        self.state_fn = self.options.state_fn or (lambda: {"model": model.state_dict()})
        self.state.path_check_pending = loss_fn is not None and self.options.check_determinism
        self._resume_state = resume_state
        self.last_consensus: ShardConsensus | None = None
        self.ctx = ShardedContext(
            **self.context_fields(),
            model=model,
            loss_fn=loss_fn,
            params=self.params,
            names_by_id={id(p): n for n, p in self.params},
            not_replayed=[n for n, p in self.params if not isinstance(p, DTensor)],
            recorder=self._recorder,
        )
        # The checks, each on the shared context; the session's methods below drive them.
        self.replay = ShardedReplayAudit(self.ctx, consensus=self.weight_consensus)
        self.sentinels = ShardedSentinels(self.ctx, replay=self.replay)
        self.nonfinite = ShardedNonFiniteCheck(self.ctx, sentinels=self.sentinels)
        self.join(expect_consensus_fp=expect_consensus_fp)

    def _setup_problem(self, opts: AuditOptions) -> str | None:
        """What this rank objects to (None: nothing); settles ``audit_updates`` and, with
        ``loss_fn``, installs the replay's gradient recorder on the model."""
        model, loss_fn = self.model, self.loss_fn
        problem = nonfinite_read_problem(opts.nonfinite_read, on_nonfinite=opts.on_nonfinite)
        if problem is not None:
            pass  # (reported by every rank together)
        elif not any(isinstance(p, DTensor) for _, p in self.params):
            problem = "no parameter is a DTensor: apply fully_shard (FSDP2) to the model first"
        elif loss_fn is not None:
            problem = _replay_problem(model, loss_fn, opts.audit_every)
        elif opts.audit_updates:
            problem = "audit_updates=True needs loss_fn: the optimizer step is recomputed at the replay's audit steps"
        audit_updates = opts.audit_updates
        if audit_updates is None:  # no replicas: nothing else checks the optimizer step
            audit_updates = loss_fn is not None and problem is None and shard_group_size(model) == self.world
        self.audit_updates = bool(audit_updates) and loss_fn is not None
        if problem is None and loss_fn is not None:
            try:
                self._recorder = GradientRecorder(model)
            except ValueError as e:  # FSDP refuses a custom reduce-scatter with several param groups
                problem = f"the replay cannot sign the local gradients: {e}"
        return problem

    def inject_faults(self, faults: list[Fault]) -> None:
        """Plant synthetic faults for drills and tests (``certckpt.detect.inject``); call on every rank
        right after construction, with the same list. Forward faults perturb a module's output;
        backward and non-finite faults the local gradient of a ``fully_shard``-ed module at its
        reduce-scatter (``Fault.target``: the module's path, default the first one that owns
        parameters), before the sentinels, the signatures and the flags read it.

        Raises:
            ConfigurationError: a kind this session has no place for, or no ``loss_fn``.
        """
        recorder = self.ctx.recorder
        problem = _faults_problem(faults, replays=recorder is not None)
        if problem is not None:
            raise ConfigurationError(problem)
        assert recorder is not None
        injector = Injector(faults, rank=self.rank)
        injector.install(self.model)  # forward faults: hooks on the modules
        injector.default_param = recorder.layers[0] if recorder.layers else None
        recorder.injector = injector

    def agree(self) -> None:
        """Every rank must have the same options and trained parameters (one all-gather)."""
        opts = self.options
        setup = json.dumps(
            [
                opts.consensus_every,
                opts.on_nonfinite.value,
                opts.on_fault.value,
                self.loss_fn is not None,
                opts.audit_every,
                self.audit_updates,
                opts.nonfinite_read.value,
                repr(opts.triggers),
                self.sentinels.active,  # every rank exchanges the sentinels' rows, or none does
                [n for n, _ in self.params],
            ]
        )
        texts = all_gather_bytes(setup.encode(), group=self.group, wire_device=self.wire_device)
        odd = [r for r, t in enumerate(texts) if t != texts[0]]
        if odd:
            raise AuditSetupError(
                f"sharded audit set-up refused on every rank; rank(s) {odd} differ from rank 0 in their options or"
                " trained parameters"
            )

    def prove_resumed(self, expected: str) -> None:
        """The replicas must agree on the resumed state and it must be the parent checkpoint's (the
        agreed fingerprint is the same on every rank, so every rank refuses together)."""
        found = self.weight_consensus(self._resume_state, found_by="resume")
        if not found.agreed or found.state_fp != expected:
            what = f"consensus fingerprint {found.state_fp}" if found.agreed else "no agreed fingerprint"
            raise AuditSetupError(
                f"the state loaded for step {self.step} has {what}, but the checkpoint resumed from"
                f" ({self.parent or 'the parent'}) recorded {expected}: load that checkpoint's state into every"
                " rank (dcp.load, then set_state_dict) and pass the same dict as resume_state"
            )

    # --- hook points ------------------------------------------------------------------------------

    def begin_micro_batch(self, unit: Any) -> None:
        """Call on every rank before each micro-batch's forward pass (replay audits only).

        Keeps ``unit`` (by reference: do not modify it in place) and, when the step may be replayed
        (an audit step, or any step while the sentinels are on: a trigger replays the step it
        doubts), the RNG state it starts with; on an audit step, arms the signing of every layer's
        local gradient at its reduce-scatter.

        Raises:
            ConfigurationError: the session has no ``loss_fn`` (nothing to replay).
        """
        recorder, state = self.ctx.recorder, self.state
        if recorder is None:
            raise ConfigurationError("begin_micro_batch is for the replay audit: construct the session with loss_fn=")
        step = state.open
        if step is None:
            s = state.step + 1
            audit = s % self.audit_every == 0
            signed = audit or state.path_check_pending
            keep_rng = signed or self.sentinels.active
            step = state.open = {"s": s, "audit": audit, "signed": signed, "units": [], "rngs": [], "rng": keep_rng}
            recorder.new_step()
            if signed:
                recorder.arm("train")
            if recorder.injector is not None:
                recorder.injector.begin(s, "train")
        recorder.micro = len(step["units"])
        if step["rng"]:
            step["rngs"].append(_rng_state(self.device))
        step["units"].append(unit)

    def before_update(self, *, loss_divisor: int | None = None) -> bool:
        """Call on every rank after the step's last backward, before the optimizer step (collective).

        Checks the reduced gradients for non-finite values and, on audit steps, runs the ring replay
        audit with the weights before the update (``.grad`` is left as it is); returns whether the
        update may be applied (a refused update's gradients are dropped).

        Args:
            loss_divisor: what the loop divided each micro-batch's loss by before its backward
                (default: the number of micro-batches, as plain accumulation does; 1 leaves it).

        Raises:
            FaultDetectedError: a check failed and the policy is to raise.
            AuditSetupError, UnsupportedObjectError: the first step's replay check refused, on every rank.
            ConfigurationError: with ``loss_fn``, no ``begin_micro_batch`` since the last step.
        """
        recorder, state = self.ctx.recorder, self.state
        s = state.step + 1
        step, state.open = state.open, None
        state.audited = None
        if recorder is not None and step is None:
            raise ConfigurationError(
                "before_update without begin_micro_batch: with loss_fn (the replay audit), call"
                " session.begin_micro_batch(unit) before each micro-batch's forward"
            )
        trained = recorder.take() if recorder is not None and step is not None and step["signed"] else None
        now = (step is not None and step["audit"]) or self._consensus_due(s) or state.path_check_pending
        if not self.nonfinite.check(s, now=now):
            return False
        if step is None:
            return True
        decision = self.sentinels.decide(s, self.nonfinite.table, replaying=step["audit"])
        triggered = decision is not None and decision.replay
        if state.first_batch and (trained is not None or self.sentinels.active):
            # before any step's micro-batches may travel: with the sentinels on, that is any step
            state.first_batch = False
            refuse_unshippable(step["units"], group=self.group, wire_device=self.wire_device)
        if trained is None and not triggered:
            return True
        n = loss_divisor or len(step["units"])
        if trained is not None and state.path_check_pending:
            self.replay.check_path(step, trained, n)
        if decision is not None and triggered:
            return self.sentinels.replay_now(s, step, n, decision)
        if trained is None or not step["audit"]:
            return True
        t0 = time.perf_counter()
        ok = self.replay.audit(s, step, trained, n)
        state.audit_seconds = time.perf_counter() - t0
        state.audited = (s, ok)
        if ok and self.audit_updates:
            state.update = update_inputs(self.optimizer, self.ctx.names_by_id)  # copies, before the step
        return ok

    # --- the weight consensus -------------------------------------------------------------------

    def _consensus_due(self, s: int) -> bool:
        return self.consensus_every is not None and s % self.consensus_every == 0

    def after_update(self) -> bool:
        """Call on every rank after the optimizer step (or its refusal): counts the step and runs the
        weight consensus at audit steps and every ``consensus_every`` steps.

        Returns:
            Whether the weight consensus that ran here agreed: False when the replicas disagree and
            the policy is ``on_fault="continue"`` (with ``"raise"`` it raises). True when none ran.
            The same for ``AuditSession.after_update``.

        Raises:
            FaultDetectedError: the replicas disagree (policy ``on_fault="raise"``).
        """
        state = self.state
        state.step += 1
        audited, state.audited = state.audited, None
        if audited is not None and audited[0] == state.step:
            t0 = time.perf_counter()
            update, state.update = state.update, None
            updated = self.replay.audit_update(state.step, *update) if update is not None else True
            agreed = self.weight_consensus().agreed
            if audited[1] and updated:
                checked = self.nonfinite.summarise(state.step)  # with the replay and the consensus: a full audit
                if agreed:
                    seconds = state.audit_seconds + time.perf_counter() - t0
                    self.audit_passed(state.step, checked=checked, seconds=seconds)
            return agreed
        if not self._consensus_due(state.step):
            return True
        return self.weight_consensus().agreed

    @timed("consensus")
    def weight_consensus(
        self, state: dict[str, Any] | None = None, *, checkpoint: bool = False, found_by: str | None = None
    ) -> ShardConsensus:
        """Compare every region of ``state`` (default ``state_fn()``) across the ranks that hold it
        (collective), compose the full-tensor and state fingerprints, and emit a ``consensus`` event
        (with ``fp``, the state fingerprint a checkpoint's record must carry, when ``checkpoint``;
        with ``found_by`` when it is another check's precondition, which the certifier skips).

        Raises:
            FaultDetectedError: replicas disagree and ``on_fault="raise"``.
            ConfigurationError: the ranks' pieces of a tensor do not cover it exactly once.
        """
        self.nonfinite.settle()  # no consensus vouches for weights a pending non-finite step updated
        report = self.ctx.report
        s = self.step
        mine, meta = local_regions(self.state_fn() if state is None else state)
        texts = all_gather_bytes(json.dumps(mine).encode(), group=self.group, wire_device=self.wire_device)
        result, counts = decide_consensus(s, [json.loads(t) for t in texts], meta)
        self.last_consensus = result
        details: dict[str, Any] = dict(counts)  # the event's details, in this order
        if result.agreed:
            if checkpoint:
                self.nonfinite.summarise(s)
            details.update({"fp": result.state_fp} if checkpoint else {"state_fp": result.state_fp})
            if found_by:
                details["found_by"] = found_by
            report.event("consensus", "pass", step=s, **details)
            return result
        note = None
        if result.candidates:
            note = "two replicas disagree and no majority decides: attribution needs >= 3 replicas of a shard"
        details.update(
            tensors=sorted({k.rsplit("@", 1)[0] for k in result.disputed}),
            regions_disputed={k: {str(r): v for r, v in vals.items()} for k, vals in result.disputed.items()},
            candidates=list(result.candidates),
            note=note,
        )
        if found_by:
            details["found_by"] = found_by
        ev = report.event("consensus", "fail", step=s, suspects=result.suspect_ranks, **details)
        report.fail(
            ev,
            f"replicas disagree after step {s} on {sorted(result.disputed)[:3]}"
            f" (outvoted: {list(result.suspect_ranks)}; undecided between: {list(result.candidates)})",
            policy=self.options.on_fault.value,
        )
        return result

    # --- checkpoints ----------------------------------------------------------------------------

    def checkpoint_evidence(self, state: dict[str, Any]) -> CheckpointEvidence:
        """The evidence a DCP checkpoint of ``state`` taken now carries (collective: every rank calls it).

        Runs the consensus on exactly ``state`` (what ``dcp.save`` will write), so that the agreed
        state fingerprint is the one the checkpoint's manifest records; hand the result to
        ``certckpt.dcp.CertifiedWriter(..., evidence=...)``. Events so far are flushed to the sink, so
        they reach the ledger before the checkpoint's commit record.

        Raises:
            FaultDetectedError: the replicas disagree (policy ``on_fault="raise"``); with
                ``"continue"`` the evidence carries no consensus fingerprint.
        """
        s = self.step
        result = self.weight_consensus(state, checkpoint=True)
        replays = self.loss_fn is not None
        head = {
            "world": self.world,
            "mode": "sharded-replay" if replays else "sharded-consensus",
            "audit_every": self.options.audit_every if replays else None,
        }
        agreed = result.agreed
        evidence = self.evidence(
            s,
            head=head,
            consensus_fp=result.state_fp if agreed else None,
            tensor_fps=dict(result.tensors) if agreed else {},
        )
        self.flush()
        self.end_lineage(s)
        return evidence

    def release(self) -> None:
        """At ``close``: a pending deferred read forgotten, the non-finite checks not summarised yet
        reported (rank 0 publishes; no collective)."""
        self.nonfinite.discard_pending()
        self.nonfinite.summarise(self.step)
