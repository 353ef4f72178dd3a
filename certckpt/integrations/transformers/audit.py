"""``AuditCallback``: the auditor's three checks inside the Hugging Face Trainer's DDP loop.

The Trainer owns its loop, so the checks hook into the points it offers, on every rank:

- set-up (``on_train_begin``): the communication hook of ``certckpt.detect.hook`` on the Trainer's
  DDP model: it performs each bucket's all-reduce (averaging as DDP does), flags non-finite local
  and reduced gradients, and on audit steps signs the local gradients before the all-reduce;
- each micro-batch (``CertifiedTrainerMixin.training_step``): on audit steps, the inputs and, at the
  first micro-batch, the RNG state are kept for the replay;
- ``on_pre_optimizer_step`` (after the all-reduce and the Trainer's clipping, before
  ``optimizer.step()``): the non-finite flags of every rank (one small all-reduce per step); on
  audit steps the ring replay: every rank receives its predecessor's micro-batches and RNG state,
  recomputes their gradients on the bare model with the Trainer's own loss (``certckpt_loss``),
  and the signatures are compared; a failure is arbitrated by a third rank and names the rank. A
  detection here raises ``FaultDetectedError`` on every rank before the update is applied;
- ``on_step_end`` (after the update): the weight consensus on audit steps (and every
  ``consensus_every`` steps); at checkpoint steps the certified Trainer asks for a consensus on the
  64-bit fingerprints, which the checkpoint then carries and the certifier matches.

Events go to the run store's ledger (rank 0), so checkpoints become ``trusted`` once the audit at
or after them passes. What this cannot do that the ``Auditor`` does: fp16 with a gradient scaler
(refused: telling an overflow from a fault needs the replay before the scaler's step), BatchNorm
statistics under ``broadcast_buffers`` (left out of the consensus; the Auditor seals and broadcasts
them), sampling micro-batches for the replay (an audit replays the whole step), and the
first-step determinism check that replays a step twice (the replay-path check below stays).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from certckpt.detect.agreement import all_gather_bytes, refuse_together, wire_device_for
from certckpt.detect.attribution import arbitration_plan, attribute_replay, consensus_verdict, ring_pairs
from certckpt.detect.auditor import consensus_buffers
from certckpt.detect.digest import digests
from certckpt.detect.events import AuditEvent, MemorySink, make_event, publish, rank_inventory
from certckpt.detect.exchange import RingShift, check_shippable, recv_payload, send_payload
from certckpt.detect.hook import HookState, comm_hook, lazy_pre_possible
from certckpt.detect.inject import Fault, Injector
from certckpt.detect.signature import Probes, matches, signature
from certckpt.errors import AuditSetupError, FaultDetectedError, UnsupportedObjectError
from certckpt.format.fingerprinting import as_words, finalize, raw_sum
from certckpt.format.record import state_fingerprint
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import LedgerSink

__all__ = ["AuditCallback"]

_MAX_LINEAGE = 100_000  # audit results kept for one checkpoint's lineage (a bound, not a design limit)


class AuditCallback(TrainerCallback):
    """Replay audits, non-finite checks and weight consensus for a ``CertifiedTrainer`` under DDP.

    Args:
        audit_every: K, the replay-audit interval in optimizer steps (a full audit: replay,
            non-finite, consensus).
        consensus_every: also compare the weights every N steps (None: at audits and checkpoints).
        mode: ``"deterministic"`` (bit-exact gradient digests) or ``"tolerance"`` (norm and
            projection within ``rtol``, for kernels that are not deterministic).
        rtol: the relative tolerance of ``"tolerance"`` mode.
        check_replay: at the first step, each rank replays its own micro-batches and every rank
            refuses together when the replay does not reproduce training (a set-up the audits would
            always flag).
        injector_faults: synthetic faults (``certckpt.detect.Fault``) for drills and tests.

    Example::

        audit = AuditCallback(audit_every=10)
        trainer = CertifiedTrainer(model=model, args=args, train_dataset=ds, callbacks=[audit])
        with stop_on_fault(audit):                      # exit 86 on a detection
            trainer.train()
    """

    def __init__(
        self,
        *,
        audit_every: int = 10,
        consensus_every: int | None = None,
        mode: str = "deterministic",
        rtol: float = 1e-3,
        check_replay: bool = True,
        injector_faults: list[Fault] | None = None,
    ):
        if not isinstance(audit_every, int) or audit_every < 1:
            raise AuditSetupError(f"audit_every must be an int >= 1, got {audit_every!r}")
        if consensus_every is not None and (not isinstance(consensus_every, int) or consensus_every < 1):
            raise AuditSetupError(f"consensus_every must be None or an int >= 1, got {consensus_every!r}")
        if mode not in ("deterministic", "tolerance"):
            raise AuditSetupError(f"mode must be 'deterministic' or 'tolerance', got {mode!r}")
        self.audit_every, self.consensus_every, self.mode, self.rtol = audit_every, consensus_every, mode, rtol
        self.check_replay = check_replay
        self.faults = list(injector_faults or [])
        self.trainer: Any = None
        self.sink: Any = MemorySink()
        self.injector: Injector | None = None
        self._hooked: set[int] = set()  # the DDP models already carrying the hook (a second train())
        self._ready = False

    def bind(self, trainer: Any) -> None:
        """Called by ``CertifiedTrainerMixin.train``: the callback needs the Trainer's model and loss."""
        self.trainer = trainer

    # --- set-up -------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise AuditSetupError(
                "AuditCallback needs CertifiedTrainer (or CertifiedTrainerMixin): a plain Trainer shows a callback "
                "neither its DDP model nor its micro-batches"
            )
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            raise AuditSetupError(
                "AuditCallback compares ranks: run the Trainer under DDP (torchrun --nproc-per-node N; N >= 3 names "
                "the faulty rank); without audits the certified Trainer's checkpoints reach `verified`"
            )
        trainer = self.trainer
        ddp = trainer.model_wrapped
        group = ddp.process_group if isinstance(ddp, DistributedDataParallel) else dist.group.WORLD
        params_device = next(trainer.model.parameters()).device
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.wire = wire_device_for(group, params_device)
        reason = None
        if not isinstance(ddp, DistributedDataParallel):
            reason = f"the Trainer's model is a {type(ddp).__name__}, not DistributedDataParallel"
        elif getattr(trainer.accelerator, "scaler", None) is not None:
            reason = (
                "fp16 with a gradient scaler: an overflow and a fault look alike until a replay before the scaler's "
                "step tells them apart, which the Trainer's loop does not allow; use bf16, or the Auditor's own loop"
            )
        refuse_together(reason, group=group, wire_device=self.wire, what="AuditCallback set-up")
        self.ddp, self.module, self.device = ddp, ddp.module, params_device
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        # Per-rank norm statistics are each rank's own under the Trainer's DDP (broadcast from rank 0
        # only at the next forward), so they stay out; constant and synchronised buffers are in.
        self.buffer_names, self.buffers = consensus_buffers(self.module, broadcast=False)
        self._agree_on_settings()
        self.probes = Probes(self.params) if self.mode == "tolerance" else None
        self.injector = Injector(self.faults, rank=self.rank) if self.faults else None
        if self.injector is not None:
            self.injector.install(self.module)
        self.hook = HookState(
            names=self.names,
            index=self.index,
            mode=self.mode,
            probes=self.probes,
            injector=self.injector,
            group=group,
            eager_pre=not lazy_pre_possible(ddp, params_device),
            hand_over=False,
        )
        if id(ddp) in self._hooked:  # DDP takes one hook per model, and it holds the first state object
            raise AuditSetupError("AuditCallback: train() again on the same Trainer is not supported; build a new one")
        ddp.register_comm_hook(self.hook, comm_hook)
        self._hooked.add(id(ddp))
        run = trainer.certckpt
        self.run, self.branch = run.run, run.branch
        self.sink = LedgerSink(run.ledger) if self.rank == 0 else MemorySink()
        self.inventory = {
            str(r): json.loads(b)
            for r, b in enumerate(
                all_gather_bytes(json.dumps(rank_inventory(params_device)).encode(), group=group, wire_device=self.wire)
            )
        }
        self.checked_since_audit = 0
        self.last_clean_audit: int | None = None
        self.lineage_events: list[dict[str, Any]] = []
        self.path_check_pending = self.check_replay
        self.step = state.global_step
        self.units: list[dict[str, Any]] = []
        self.rng: dict[str, torch.Tensor] | None = None
        self.sign = False
        self._ready = True
        return control

    def _agree_on_settings(self) -> None:
        desc = json.dumps(
            [
                self.audit_every,
                self.consensus_every,
                self.mode,
                [(n, list(p.shape), str(p.dtype)) for n, p in zip(self.names, self.params)],
                [(n, list(b.shape), str(b.dtype)) for n, b in zip(self.buffer_names, self.buffers)],
            ]
        ).encode()
        every = all_gather_bytes(desc, group=self.group, wire_device=self.wire)
        reason = None if every[self.rank] == every[0] else "its model or AuditCallback settings differ from rank 0's"
        refuse_together(reason, group=self.group, wire_device=self.wire, what="AuditCallback set-up")

    # --- per step -----------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.audit_every == 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        self.sign = self.is_audit_step(self.step) or self.path_check_pending
        # The hook averages each bucket before its all-reduce (DDP's default hook divides; a
        # registered hook must do it itself).
        self.hook.reset(audit=self.sign, average=1.0 / self.world)
        if self.injector is not None:
            self.injector.begin(self.step, "train")
        self.units, self.rng = [], None
        return control

    def before_micro_batch(self, inputs: Any, num_items_in_batch: Any) -> None:
        """Keep a micro-batch (and, at the first, the RNG state) for this step's replay."""
        if not self._ready or not self.sign:
            return
        if not self.units:
            self.rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                self.rng["cuda"] = torch.cuda.get_rng_state(self.device)
        # A shallow copy: compute_loss may pop "labels" from the dict it is given.
        self.units.append({"inputs": dict(inputs), "n": num_items_in_batch})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self._ready:
            return control
        s = self.step
        self._nonfinite_check(s)
        self.checked_since_audit += 1
        if self.path_check_pending:
            self._first_checks(s)
        if self.is_audit_step(s):
            self._replay_audit(s)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._ready and self.injector is not None:  # drills: a fault in the stored weights
            self.injector.after_optimizer(list(zip(self.names, self.params)))
            self.injector.after_optimizer_buffers(list(zip(self.buffer_names, self.buffers)))
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if not self._ready:
            return control
        s = state.global_step
        audit = self.is_audit_step(s)
        if audit or (self.consensus_every is not None and s % self.consensus_every == 0):
            self.consensus(s)
        if audit:
            self._event("nonfinite", "pass", step=s, steps_checked=self.checked_since_audit)
            self.checked_since_audit = 0
            self.last_clean_audit = s
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    # --- check 1: non-finite gradients ---------------------------------------------------------

    def _nonfinite_check(self, s: int) -> None:
        """Every rank's flags, exchanged every step (one small all-reduce): a reduction that delivers
        non-finite values to some ranks only is still seen, the same way, by all of them."""
        flags = torch.zeros(2 * self.world, dtype=torch.int32, device=self.wire)
        if self.hook.post and bool(torch.stack(self.hook.post).any()):
            flags[self.world + self.rank] = 1
        if self.hook.pre and bool(torch.stack(self.hook.pre).any()):
            flags[self.rank] = 1
        dist.all_reduce(flags, group=self.group)
        values = flags.tolist()
        if not any(values):
            return
        pre = [r for r in range(self.world) if values[r]]
        post = [r for r in range(self.world) if values[self.world + r]]
        bad = [n for n, p in zip(self.names, self.params) if p.grad is not None and not torch.isfinite(p.grad).all()]
        if pre:
            kind, suspects = "nonfinite-pre", pre
            msg = f"non-finite local gradients on rank(s) {pre} before the all-reduce"
        else:
            kind, suspects = "nonfinite-post", []
            msg = (
                f"gradients became non-finite in the all-reduce (seen on rank(s) {post}) while every rank's local"
                " gradients were finite: suspect the reduction"
            )
        ev = self._event(
            kind, "fail", step=s, suspects=suspects, contained=True, pre_ranks=pre, post_ranks=post, tensors=bad[:20]
        )
        raise self._failure(ev, msg + "; the update was not applied")

    # --- check 2: ring replay ------------------------------------------------------------------

    def _payload(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "rng": self.rng,
            "accumulation": int(self.trainer.current_gradient_accumulation_steps),
        }

    def _first_checks(self, s: int) -> None:
        """The first step: the batch can travel, and a replay of this rank's own step reproduces
        the gradients training computed (refused on every rank together otherwise)."""
        self.path_check_pending = False
        reason = None
        try:
            check_shippable(self._payload())
        except UnsupportedObjectError as e:
            reason = str(e)
        refuse_together(
            reason, group=self.group, wire_device=self.wire, what="the first step's batch", error=UnsupportedObjectError
        )
        local = self._local_signature()
        again = self._replay(self._payload(), s)
        same = matches(again.cpu(), local.cpu(), mode=self.mode, rtol=self.rtol)
        reason = None
        if not all(same):
            names = [n for n, ok in zip(self.names, same) if not ok][:5]
            reason = f"the replay of the first step gives other gradients than training did (e.g. {names})"
        refuse_together(
            reason,
            group=self.group,
            wire_device=self.wire,
            what="the replay check",
            advice=(
                "the replay calls the Trainer's compute_loss on the bare model with the training step's RNG state;"
                " likely causes: randomness drawn outside torch (Python's random, numpy), state that changes between"
                " calls, non-deterministic kernels (torch.use_deterministic_algorithms(True)), or a compute_loss"
                " override that treats the bare model differently; AuditCallback(mode='tolerance') helps with the"
                " kernels only"
            ),
        )

    def _local_signature(self) -> torch.Tensor:
        missing = [self.names[i] for i in range(len(self.params)) if i not in self.hook.local_sig]
        if missing:
            raise AuditSetupError(
                f"rank {self.rank}: no local gradient signature for {missing[:3]}: the communication hook did not see "
                "this step's all-reduce (another hook registered on the DDP model?)"
            )
        return torch.stack([self.hook.local_sig[i] for i in range(len(self.params))])

    def _replay(self, payload: dict[str, Any], s: int) -> torch.Tensor:
        """Gradient signatures of one step's micro-batches recomputed on this rank, leaving ``.grad``
        and buffers alone (as ``Auditor._replay``: each gradient is signed, or accumulated in
        micro-batch order, by a tensor hook that hands autograd a zero placeholder)."""
        units = payload["units"]
        buffers = [b.detach().clone() for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        rows: list[torch.Tensor | None] = [None] * len(self.params)
        acc: list[torch.Tensor | None] | None = [None] * len(self.params) if len(units) > 1 else None

        def sign(i: int, g: torch.Tensor) -> torch.Tensor:
            probes = self.probes.subset([i]) if self.probes is not None else None
            return signature([g], mode=self.mode, probes=probes)[0]

        def signer(i: int):
            def hook(grad: torch.Tensor) -> torch.Tensor:
                if acc is not None:
                    acc[i] = grad.detach().clone() if acc[i] is None else acc[i].add_(grad.detach())
                else:
                    g = grad.detach()
                    if self.injector is not None:  # drills: a persistent fault corrupts replays too
                        g = g.clone()
                        self.injector.on_local_grads([self.names[i]], [g])
                    rows[i] = sign(i, g)
                return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

            return hook

        handles = [p.register_hook(signer(i)) for i, p in enumerate(self.params)]
        try:
            with torch.random.fork_rng(devices=devices):
                rng = payload["rng"]
                torch.set_rng_state(rng["cpu"].to(device="cpu", dtype=torch.uint8))
                if "cuda" in rng and self.device.type == "cuda":
                    torch.cuda.set_rng_state(rng["cuda"].to(device="cpu", dtype=torch.uint8), self.device)
                if self.injector is not None:
                    self.injector.begin(s, "replay")
                for unit in units:
                    loss = self.trainer.certckpt_loss(
                        self.module, unit["inputs"], unit["n"], int(payload["accumulation"])
                    )
                    torch.autograd.grad(loss, self.params, allow_unused=True)
                    del loss
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for b, saved in zip(self.module.buffers(), buffers):
                    b.copy_(saved)
            if self.injector is not None:
                self.injector.begin(s, "train")
        if acc is not None:
            if self.injector is not None:  # as in training: a backward fault hits the accumulated gradient
                self.injector.begin(s, "replay")
                present = [i for i, a in enumerate(acc) if a is not None]
                self.injector.on_local_grads([self.names[i] for i in present], [acc[i] for i in present])
                self.injector.begin(s, "train")
            for i, a in enumerate(acc):
                if a is not None:
                    rows[i] = sign(i, a)
        for i, p in enumerate(self.params):
            if rows[i] is None:  # unused in this forward: DDP's bucket holds zeros for it
                rows[i] = sign(i, torch.zeros_like(p))
        return torch.stack(rows)

    def _gather_rows(self, mine: torch.Tensor) -> list[torch.Tensor]:
        wire = mine.to(self.wire)
        out = [torch.empty_like(wire) for _ in range(self.world)]
        dist.all_gather(out, wire, group=self.group)
        return [o.cpu() for o in out]

    def _replay_audit(self, s: int) -> None:
        payload = self._payload()
        prev = RingShift(payload, group=self.group, wire_device=self.wire, out_device=self.device).finish()
        local = self._local_signature()
        replay = self._replay(prev, s)
        gathered = self._gather_rows(torch.stack([local, replay]))
        failed, mismatched = [], {}
        for origin, replayer in ring_pairs(self.world):
            ok = matches(gathered[replayer][1], gathered[origin][0], mode=self.mode, rtol=self.rtol)
            if not all(ok):
                failed.append((origin, replayer))
                mismatched[f"{origin}->{replayer}"] = [n for n, good in zip(self.names, ok) if not good][:10]
        units = len(payload["units"])
        if not failed:
            self._event("replay", "pass", step=s, comparisons=self.world, mode=self.mode, micro_batches=units)
            return
        # A replay compares only replicas that hold the same weights: check that first.
        self.consensus(s - 1, found_by="replay precondition")
        arbitration = self._arbitrate(s, failed, payload, gathered)
        verdict = attribute_replay(self.world, failed, arbitration)
        ev = self._event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            mode=self.mode,
            micro_batches=units,
            failed=[{"origin": o, "replayer": r} for o, r in failed],
            mismatched=mismatched,
            arbitration={f"{o}->{r}": v for (o, r), v in arbitration.items()},
            notes=list(verdict.notes),
        )
        who = f"rank(s) {list(verdict.suspects)}" if verdict.suspects else "no rank could be named"
        raise self._failure(ev, f"replay audit failed ({who}); the update was not applied")

    def _arbitrate(self, s: int, failed, payload, gathered) -> dict[tuple[int, int], str]:
        """For each failed comparison no persistent fault explains, a third rank replays the batch."""
        results: dict[tuple[int, int], str] = {}
        for origin, replayer, arbiter in arbitration_plan(self.world, failed):
            if self.rank == origin:
                send_payload(
                    payload, dist.get_global_rank(self.group, arbiter), group=self.group, wire_device=self.wire
                )
                sig = torch.zeros_like(gathered[origin][1])
            elif self.rank == arbiter:
                got = recv_payload(
                    dist.get_global_rank(self.group, origin),
                    group=self.group,
                    wire_device=self.wire,
                    out_device=self.device,
                )
                sig = self._replay(got, s).cpu()
            else:
                sig = torch.zeros_like(gathered[origin][1])
            wire = sig.to(self.wire)
            dist.broadcast(wire, dist.get_global_rank(self.group, arbiter), group=self.group)
            arb = wire.cpu()
            with_origin = all(matches(arb, gathered[origin][0], mode=self.mode, rtol=self.rtol))
            with_replayer = all(matches(arb, gathered[replayer][1], mode=self.mode, rtol=self.rtol))
            results[(origin, replayer)] = "origin" if with_origin else "replayer" if with_replayer else "neither"
        return results

    # --- check 3: weight consensus -------------------------------------------------------------

    def consensus(self, s: int, *, found_by: str | None = None, fingerprints: bool = False) -> dict[str, str]:
        """Compare every replica's weights (collective); raises ``FaultDetectedError`` when they differ.

        Returns:
            With ``fingerprints``, each parameter's (and buffer's) 64-bit fingerprint every replica
            holds; otherwise an empty dict.
        """
        state = [p.detach() for p in self.params] + [b.detach() for b in self.buffers]
        names = self.names + self.buffer_names
        if not state:
            raw = torch.zeros(0, dtype=torch.int64)
        elif fingerprints:
            raw = torch.stack([raw_sum(as_words(t)) for t in state])
        else:
            raw = digests(state)
        rows = [r.tolist() for r in self._gather_rows(raw)]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            details: dict[str, Any] = {"params": len(self.params), "buffers": len(self.buffers)}
            fps: dict[str, str] = {}
            if fingerprints:
                fps = {n: f"{finalize(r, t):016x}" for n, r, t in zip(names, rows[0], state)}
                details["fp"] = state_fingerprint(fps)
            if found_by is None:
                self._event("consensus", "pass", step=s, **details)
            return fps
        tensors = [names[j] for j in verdict.mismatched][:20]
        minority = list(verdict.minority_ranks) if verdict.majority is not None else "no majority"
        ev = self._event(
            "consensus",
            "fail",
            step=s,
            suspects=verdict.minority_ranks if verdict.majority is not None else (),
            tensors=tensors,
            majority=verdict.majority is not None,
            **({"found_by": found_by} if found_by else {}),
        )
        raise self._failure(
            ev, f"weights differ across replicas after step {s} (minority: {minority}; tensors {tensors[:3]})"
        )

    def checkpoint_consensus(self, s: int) -> tuple[str, dict[str, str]] | None:
        """The fingerprint consensus of a checkpoint step (collective): ``(state fp, per-tensor fps)``."""
        if not self._ready:
            return None
        fps = self.consensus(s, fingerprints=True)
        return state_fingerprint(fps), fps

    # --- events and the checkpoint's lineage ---------------------------------------------------

    def _event(
        self, kind: str, outcome: str, *, step: int, suspects=(), contained: bool = False, **details
    ) -> AuditEvent:
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
            publish(ev, sink=self.sink, ledger=self.trainer.certckpt.ledger)
        if len(self.lineage_events) < _MAX_LINEAGE:
            self.lineage_events.append({"step": step, "kind": kind, "outcome": outcome})
        return ev

    def _failure(self, ev: AuditEvent, message: str) -> FaultDetectedError:
        """The error every rank raises for a failed check (the same incident id on each)."""
        incident = None if ev.contained else incident_id_for(ev.to_dict())
        return FaultDetectedError(f"step {ev.step}: {message}", ev, incident_id=incident)

    def lineage(self) -> dict[str, Any]:
        """What the next checkpoint's record says about the audits since the previous one."""
        return {
            "audit_every": self.audit_every,
            "world": self.world,
            "mode": self.mode,
            "audits": list(self.lineage_events),
            "last_clean_audit": self.last_clean_audit,
        }

    def checkpoint_done(self) -> None:
        self.lineage_events = []

    def flush(self) -> None:
        self.sink.flush()

    def close(self) -> None:
        """Flush the events to the ledger and remove the drills' hooks (``stop_on_fault`` calls it)."""
        self.sink.flush()
        if self.injector is not None:
            self.injector.remove()
