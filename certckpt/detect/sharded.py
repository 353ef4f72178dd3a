"""Detection under FSDP2 / HSDP: weight consensus per shard, non-finite reduced gradients.

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
kinds (``nonfinite``, ``nonfinite-post``, ``consensus``), so the certifier reads them unchanged; no
replay runs here (see ``docs/detection.md``, "Sharded training: FSDP2 and HSDP").
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from certckpt.errors import ArgumentTypeError, AuditSetupError, ConfigurationError, FaultDetectedError
from certckpt.format.header import printable
from certckpt.format.sharded.composition import compose, hex64, is_partition, state_fp
from certckpt.format.sharded.shardfp import tensor_contribution
from certckpt.format.tensors import TORCH_TO_ST
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import Ledger, LedgerSink

from .agreement import all_gather_bytes, refuse_together, wire_device_for
from .events import AuditEvent, EventSink, MemorySink, make_event, publish, rank_inventory
from .session import CheckpointEvidence

__all__ = ["ShardedAuditSession", "ShardConsensus", "local_regions"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardConsensus:
    """The outcome of one weight consensus (the same on every rank).

    Attributes:
        step: the optimizer step the weights follow.
        agreed: every region's holders produced the same contribution.
        tensors: ``{fqn: fingerprint hex}`` of the full tensors, composed from the agreed (or, for a
            disputed region without a majority, the lowest rank's) contributions.
        state_fp: the whole-state fingerprint over ``tensors`` (``certckpt.dcp``'s manifest rule).
        disputed: per disputed region ``"fqn@offsets"``, each holder's contribution by rank.
        suspect_ranks: ranks outvoted by a majority of their region's holders.
        candidates: holders of a disputed region that no majority decides (a tie, as with 2 replicas).
    """

    step: int
    agreed: bool
    tensors: dict[str, str]
    state_fp: str
    disputed: dict[str, dict[int, str]] = field(default_factory=dict)
    suspect_ranks: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()


def local_regions(state: dict[str, Any]) -> tuple[list[list[Any]], dict[str, tuple[str, tuple[int, ...]]]]:
    """This rank's pieces of a (nested) state: ``[[fqn, offsets, sizes, contribution hex], ...]`` and
    ``{fqn: (dtype code, global shape)}``, under DCP's flattened names.

    A DTensor contributes its local shard at its global offsets (empty shards nothing); a plain
    tensor is a whole copy (offsets 0). Non-tensor values are skipped.

    Raises:
        ArgumentTypeError: a dtype without a fingerprint, or a DTensor with a Partial placement.
    """
    flat, _ = flatten_state_dict(state)
    regions: list[list[Any]] = []
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fqn, v in flat.items():
        if not isinstance(v, torch.Tensor):
            continue
        code = TORCH_TO_ST.get(v.dtype)
        if code is None:
            raise ArgumentTypeError(f"`{printable(fqn)}`: dtype {v.dtype} has no fingerprint")
        shape = tuple(v.shape)
        meta[fqn] = (code, shape)
        if isinstance(v, DTensor):
            if any(p.is_partial() for p in v.placements):
                raise ArgumentTypeError(f"`{printable(fqn)}` is a DTensor with a Partial placement (unreduced)")
            local = v.to_local()
            for chunk in v.__create_chunk_list__():
                offsets, sizes = list(chunk.offsets), list(chunk.sizes)
                if not local.numel():
                    continue
                raw = tensor_contribution(local, offsets=offsets, global_shape=shape)
                regions.append([fqn, offsets, sizes, hex64(raw)])
        else:
            raw = tensor_contribution(v.detach(), offsets=(0,) * len(shape), global_shape=shape)
            regions.append([fqn, [0] * len(shape), list(shape), hex64(raw)])
    return regions, meta


def _vote(values: dict[int, str]) -> tuple[str | None, list[int]]:
    """``(majority value or None on a tie, ranks outvoted)`` among one region's holders."""
    counts = Counter(values.values()).most_common()
    if len(counts) == 1:
        return counts[0][0], []
    top, n = counts[0]
    if counts[1][1] == n:
        return None, []
    return top, sorted(r for r, v in values.items() if v != top)


def _offsets(t: torch.Tensor) -> list[int] | None:
    """Where a DTensor's local shard starts in the global tensor (None: a plain tensor, or no shard here)."""
    if not isinstance(t, DTensor):
        return None
    chunks = t.__create_chunk_list__()
    return list(chunks[0].offsets) if chunks else None


def _nonfinite_flags(grads: list[torch.Tensor]) -> torch.Tensor:
    # One reduction per gradient, no copy: NaN and Inf survive a sum (an overflow to Inf is flagged
    # too, and means the gradients are unusable anyway), as the DDP hook's check.
    if not grads:
        return torch.zeros(0, dtype=torch.bool)
    return ~torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in grads]).cpu())


class ShardedAuditSession:
    """The non-finite check and the weight consensus of an FSDP2 / HSDP run (see the module docstring).

    Every rank constructs one after ``fully_shard`` and before the first backward (a collective: the
    ranks agree on the set-up or all refuse together), and calls ``before_update()`` after the step's
    last backward (FSDP has reduce-scattered the gradients, and all-reduced them across replicas under
    HSDP), ``after_update()`` after the optimizer step (whether it ran or not), and
    ``checkpoint_evidence(state)`` where a checkpoint is taken.

    Args:
        model: the ``fully_shard``-ed module (its parameters are DTensors).
        optimizer: its optimizer (its gradients are dropped when an update is refused).
        run, branch, parent: the run's identity, recorded in events and checkpoints.
        consensus_every: compare the weights every N steps (default 1: every step).
        state_fn: what the per-step consensus covers, as a DCP state dict (default
            ``{"model": model.state_dict()}``: parameters and buffers).
        on_nonfinite: ``"raise"`` (``FaultDetectedError``) or ``"skip"`` (drop the update); a
            contained detection either way.
        on_fault: ``"raise"`` or ``"continue"`` on a consensus failure.
        group: the process group of every rank of the mesh (default: the default group).
        sink: where rank 0 emits events (default: the ledger's, else in memory).
        ledger: a ``certckpt.Ledger`` or run store URL: events and incidents go there.
        start_step: optimizer steps already done (when resuming).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run: str = "run",
        branch: str = "main",
        parent: str | None = None,
        consensus_every: int = 1,
        state_fn: Callable[[], dict[str, Any]] | None = None,
        on_nonfinite: str = "raise",
        on_fault: str = "raise",
        group: Any = None,
        sink: EventSink | None = None,
        ledger: Ledger | str | None = None,
        start_step: int = 0,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise AuditSetupError("torch.distributed is not initialized; call init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        first = next(iter(model.parameters()), None)
        self.wire_device = wire_device_for(self.group, first.device if first is not None else torch.device("cpu"))
        self.model, self.optimizer = model, optimizer
        self.run, self.branch, self.parent = run, branch, parent
        self.consensus_every = consensus_every
        self.state_fn = state_fn or (lambda: {"model": model.state_dict()})
        self.on_nonfinite, self.on_fault = on_nonfinite, on_fault
        self.step = start_step
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        problem = None
        if on_nonfinite not in ("raise", "skip") or on_fault not in ("raise", "continue"):
            problem = "on_nonfinite must be 'raise' or 'skip'; on_fault 'raise' or 'continue'"
        elif type(consensus_every) is not int or consensus_every < 1:
            problem = f"consensus_every must be an int >= 1, got {consensus_every!r}"
        elif not any(isinstance(p, DTensor) for _, p in self.params):
            problem = "no parameter is a DTensor: apply fully_shard (FSDP2) to the model first"
        setup = json.dumps([consensus_every, on_nonfinite, on_fault, [n for n, _ in self.params]])
        refuse_together(problem, group=self.group, wire_device=self.wire_device, what="sharded audit set-up")
        texts = all_gather_bytes(setup.encode(), group=self.group, wire_device=self.wire_device)
        odd = [r for r, t in enumerate(texts) if t != texts[0]]
        if odd:
            raise AuditSetupError(
                f"sharded audit set-up refused on every rank; rank(s) {odd} differ from rank 0 in their options or"
                " trained parameters"
            )
        self.ledger = Ledger(ledger) if isinstance(ledger, str) else ledger
        if sink is None and self.ledger is not None:
            sink = LedgerSink(self.ledger)
        self.sink: EventSink = sink if sink is not None else MemorySink()
        inv = all_gather_bytes(json.dumps(rank_inventory()).encode(), group=self.group, wire_device=self.wire_device)
        self.inventory = {str(r): json.loads(t) for r, t in enumerate(inv)}
        self.last_consensus: ShardConsensus | None = None
        self.last_checkpoint_step: int | None = start_step or None
        self._checked = 0  # steps whose non-finite check passed since the last summary
        self._first_checked: int | None = None
        self._events: list[tuple[int, str, str]] = []  # (step, kind, outcome) since the last checkpoint

    # --- events ---------------------------------------------------------------------------------

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
        self._events.append((step, kind, outcome))
        return ev

    def _fail(self, ev: AuditEvent, message: str, *, policy: str) -> None:
        if policy != "raise":
            return
        # every rank raises here together, after rank 0 has written the event (see AuditSession._fail)
        dist.barrier(group=self.group)
        raise FaultDetectedError(
            f"step {ev.step}: {message}", ev, incident_id=None if ev.contained else incident_id_for(ev.to_dict())
        )

    # --- the non-finite check -------------------------------------------------------------------

    def before_update(self) -> bool:
        """Check the reduced gradients of the coming update (collective); returns whether to apply it.

        Every rank sums its local gradient shards (one reduction each), the ranks all-gather one flag
        each, and on a failure the names: a non-finite shard on some replicas of a region only names
        those ranks (the reduction delivered them bad values, or their memory went bad); on every
        holder of the region it came through the reduction from some rank's local gradient, which
        FSDP's reduce-scatter has consumed, and names nobody. A refused update's gradients are dropped.
        """
        s = self.step + 1
        named = [(n, p.grad) for n, p in self.params if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for _, g in named]
        flags = _nonfinite_flags(grads)
        mine = torch.tensor([int(flags.any())], dtype=torch.int64, device=self.wire_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        bad_ranks = [r for r, f in enumerate(everyone) if int(f)]
        if not bad_ranks:
            self._checked += 1
            self._first_checked = s if self._first_checked is None else self._first_checked
            return True
        # the failing step: which tensors, and which regions, on every rank
        mine_bad = [[n, _offsets(g)] for (n, g), bad in zip(named, flags.tolist()) if bad]
        held = [[n, _offsets(p)] for n, p in self.params]
        texts = all_gather_bytes(
            json.dumps({"bad": mine_bad, "held": held}).encode(), group=self.group, wire_device=self.wire_device
        )
        reports = [json.loads(t) for t in texts]
        holders: dict[str, list[int]] = {}
        for r, rep in enumerate(reports):
            for n, off in rep["held"]:
                holders.setdefault(json.dumps([n, off]), []).append(r)
        suspects, where = set(), {}
        for r, rep in enumerate(reports):
            for n, off in rep["bad"]:
                where.setdefault(str(r), []).append(n if off is None else f"{n}@{','.join(map(str, off))}")
                region = json.dumps([n, off])
                flagged = [h for h in holders.get(region, [r]) if any(b == [n, off] for b in reports[h]["bad"])]
                if len(flagged) < len(holders.get(region, [r])):
                    suspects.add(r)  # its replicas of the same region hold finite values
        for _, p in self.params:
            p.grad = None  # the update is dropped: it never reaches the weights (contained)
        ev = self._event(
            "nonfinite-post",
            "fail",
            step=s,
            suspects=suspects,
            contained=True,
            post_ranks=bad_ranks,
            pre_ranks=[],
            tensors=where,
            where="reduced gradient shards (after FSDP's reduce-scatter and the replicas' all-reduce)",
            policy=self.on_nonfinite,
        )
        self._fail(
            ev,
            f"non-finite reduced gradients on rank(s) {bad_ranks} ({where}); the update was dropped",
            policy="raise" if self.on_nonfinite == "raise" else "skip",
        )
        return False

    # --- the weight consensus -------------------------------------------------------------------

    def after_update(self) -> bool:
        """Call on every rank after the optimizer step (or its refusal): counts the step and, every
        ``consensus_every`` steps, runs the weight consensus. Returns False when the consensus failed
        (policy ``on_fault="continue"``)."""
        self.step += 1
        if self.step % self.consensus_every:
            return True
        return self.weight_consensus().agreed

    def weight_consensus(self, state: dict[str, Any] | None = None, *, checkpoint: bool = False) -> ShardConsensus:
        """Compare every region of ``state`` (default ``state_fn()``) across the ranks that hold it
        (collective), compose the full-tensor and state fingerprints, and emit a ``consensus`` event
        (with ``fp``, the state fingerprint a checkpoint's record must carry, when ``checkpoint``).

        Raises:
            FaultDetectedError: replicas disagree and ``on_fault="raise"``.
            ConfigurationError: the ranks' pieces of a tensor do not cover it exactly once.
        """
        s = self.step
        mine, meta = local_regions(self.state_fn() if state is None else state)
        texts = all_gather_bytes(json.dumps(mine).encode(), group=self.group, wire_device=self.wire_device)
        regions: dict[tuple[str, tuple, tuple], dict[int, str]] = {}
        for r, t in enumerate(texts):
            for fqn, offsets, sizes, raw in json.loads(t):
                regions.setdefault((fqn, tuple(offsets), tuple(sizes)), {})[r] = raw
        disputed: dict[str, dict[int, str]] = {}
        suspects: set[int] = set()
        candidates: set[int] = set()
        chosen: dict[str, dict[tuple, str]] = {}
        for (fqn, offsets, sizes), values in regions.items():
            top, outvoted = _vote(values)
            if top is None or outvoted:
                disputed[f"{fqn}@{','.join(map(str, offsets))}"] = dict(sorted(values.items()))
                suspects.update(outvoted)
                if top is None:
                    candidates.update(values)
            chosen.setdefault(fqn, {})[(offsets, sizes)] = top if top is not None else values[min(values)]
        fps = {}
        for fqn, (code, shape) in meta.items():
            boxes = chosen.get(fqn, {})
            if not is_partition(list(boxes), shape):
                raise ConfigurationError(
                    f"`{printable(fqn)}`: the ranks' pieces do not cover it exactly once; every rank of the mesh must"
                    " take part in the consensus"
                )
            fps[fqn] = hex64(compose((int(v, 16) for v in boxes.values()), code, shape))
        result = ShardConsensus(
            step=s,
            agreed=not disputed,
            tensors=fps,
            state_fp=state_fp(fps),
            disputed=disputed,
            suspect_ranks=tuple(sorted(suspects)),
            candidates=tuple(sorted(candidates - suspects)),
        )
        self.last_consensus = result
        counts = {
            "tensor_count": len(fps),
            "regions": len(regions),
            "replicas": max(map(len, regions.values()), default=0),
        }
        if result.agreed:
            if checkpoint:
                self._summarise_nonfinite(s)
            extra = {"fp": result.state_fp} if checkpoint else {"state_fp": result.state_fp}
            self._event("consensus", "pass", step=s, **counts, **extra)
            return result
        note = None
        if result.candidates:
            note = "two replicas disagree and no majority decides: attribution needs >= 3 replicas of a shard"
        ev = self._event(
            "consensus",
            "fail",
            step=s,
            suspects=suspects,
            **counts,
            tensors=sorted({k.rsplit("@", 1)[0] for k in disputed}),
            regions_disputed={k: {str(r): v for r, v in vals.items()} for k, vals in disputed.items()},
            candidates=list(result.candidates),
            note=note,
        )
        self._fail(
            ev,
            f"replicas disagree after step {s} on {sorted(disputed)[:3]} (outvoted: {list(result.suspect_ranks)};"
            f" undecided between: {list(result.candidates)})",
            policy=self.on_fault,
        )
        return result

    def _summarise_nonfinite(self, s: int) -> None:
        # The per-step checks since the last summary, as the DDP auditor reports them at audit steps
        # (here at checkpoints and at close: there are no audit steps without a replay).
        if self._checked:
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked, first=self._first_checked)
            self._checked, self._first_checked = 0, None

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
        first = (self.last_checkpoint_step or 0) + 1
        lineage = {
            "world": self.world,
            "mode": "sharded-consensus",
            "audits": [{"step": st, "kind": k, "outcome": o} for st, k, o in self._events],
            "last_clean_audit": None,
            "consensus": {"step": s, "fp": result.state_fp} if result.agreed else None,
        }
        self.flush()
        self.last_checkpoint_step = s
        self._events = []
        return CheckpointEvidence(
            step=s,
            run=self.run,
            branch=self.branch,
            parent=self.parent,
            step_range=[first, s],
            lineage=lineage,
            consensus_fp=result.state_fp if result.agreed else None,
            known_fingerprints={},
            tensor_fps=dict(result.tensors) if result.agreed else {},
        )

    def flush(self) -> None:
        """Write the events emitted so far to the sink (rank 0)."""
        if self.rank == 0:
            self.sink.flush()

    def close(self) -> None:
        """Report the non-finite checks not summarised yet and flush the events."""
        self._summarise_nonfinite(self.step)
        self.flush()
