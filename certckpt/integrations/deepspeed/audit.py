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
  and the replay must be bit-equal; a failed comparison is arbitrated by a third rank, and
  ``certckpt.detect.attribute_replay`` names the rank. It compares recomputations: a fault that
  repeats on a unit (persistent) is caught and named; a one-time fault inside DeepSpeed's own
  backward is not (training's local gradients are never seen).

ZeRO-3 partitions the weights (each piece has one holder: nothing to compare) and gathers them in
forward hooks that are collectives, so both checks are refused there (docs/detection.md,
"DeepSpeed"). A detection raises ``FaultDetectedError`` on every rank, naming the suspect ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from certckpt.detect.agreement import all_gather_bytes, refuse_together, wire_device_for
from certckpt.detect.attribution import arbitration_plan, attribute_replay, consensus_verdict, ring_pairs
from certckpt.detect.inject import Fault, Injector
from certckpt.errors import AuditSetupError, FaultDetectedError
from certckpt.format.fingerprinting import fingerprint_many

__all__ = ["ZeroAudit"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class ZeroAudit:
    """The checks of a ZeRO-1/2 run; every rank builds one (collective) after ``deepspeed.initialize``.

    Args:
        engine: the ``DeepSpeedEngine``.
        loss_fn: ``loss_fn(module, batch) -> loss``: what the loop computes for one micro-batch,
            called on the bare module for replays.
        audit_every: replay every N optimizer steps (and run the consensus then).
        consensus_every: also run the consensus every N steps (default: audit steps only).
        injector_faults: synthetic faults for tests and drills (``certckpt.detect.Fault``).

    Example:
        >>> audit = ZeroAudit(engine, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]), audit_every=10)
        >>> for batch in loader:
        ...     audit.begin_micro_batch(batch)
        ...     engine.backward(loss_fn(engine, batch))
        ...     audit.before_update()        # at audit steps: the replay (before the weights change)
        ...     engine.step()
        ...     audit.after_update()         # the weight consensus
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
        stage = int(engine.zero_optimization_stage())
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
        self.step = int(engine.global_steps)  # optimizer steps done
        self.units: list[tuple[Any, torch.Tensor]] = []  # this step's micro-batches and their RNG states
        self.passed: list[tuple[str, int]] = []  # (check, step) that ran and passed

    # --- the hook points ------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        return step % self.audit_every == 0

    def begin_micro_batch(self, batch: Any) -> None:
        """Before each micro-batch's forward: keep it (and the RNG state it starts from) at audit steps."""
        s = self.step + 1
        if self.injector is not None:
            self.injector.begin(s, "train")
        if self.is_audit_step(s):
            self.units.append((batch, torch.get_rng_state()))

    def before_update(self) -> None:
        """After the step's last backward, before ``engine.step()``: the replay at audit steps.

        Raises:
            FaultDetectedError: on every rank, when the replay names a rank (or cannot tell which).
        """
        s = self.step + 1
        if not self.is_audit_step(s):
            return
        units, self.units = self.units, []
        payloads = all_gather_bytes(_pack(units), group=self.group, wire_device=self.wire)
        steps = [_unpack(p) for p in payloads]
        origin = (self.rank - 1) % self.world
        mine = [self._replay(steps[self.rank], s), self._replay(steps[origin], s)]
        rows = [
            json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), group=self.group, wire_device=self.wire)
        ]
        failed = [(o, r) for o, r in ring_pairs(self.world) if rows[o][0] != rows[r][1]]
        if not failed:
            self.passed.append(("replay", s))
            return
        plan = arbitration_plan(self.world, failed)
        asked = {(o, r): self._replay(steps[o], s) for o, r, a in plan if a == self.rank}
        said = json.dumps([[o, r, v] for (o, r), v in asked.items()]).encode()
        outcome: dict[tuple[int, int], str] = {}
        for blob in all_gather_bytes(said, group=self.group, wire_device=self.wire):
            for o, r, v in json.loads(blob):
                outcome[(o, r)] = "origin" if v == rows[o][0] else "replayer" if v == rows[r][1] else "neither"
        verdict = attribute_replay(self.world, failed, outcome)
        event = {
            "kind": "replay",
            "step": s,
            "suspects": list(verdict.suspects),
            "failed": failed,
            "notes": list(verdict.notes),
        }
        raise FaultDetectedError(
            f"replay audit at step {s} failed: suspect rank(s) {list(verdict.suspects)}"
            + (f" ({'; '.join(verdict.notes)})" if verdict.notes else ""),
            event,
        )

    def after_update(self) -> None:
        """After ``engine.step()``: the weight consensus at audit (and ``consensus_every``) steps.

        Raises:
            FaultDetectedError: on every rank, naming the ranks the majority outvoted.
        """
        self.step = s = int(self.engine.global_steps)
        if self.injector is not None:
            self.injector.begin(s, "train")
            self.injector.after_optimizer(list(zip(self.names, self.params)))
        if self.is_audit_step(s) or (self.consensus_every is not None and s % self.consensus_every == 0):
            self.consensus(s)

    def consensus(self, s: int) -> None:
        """Every rank's fingerprints of the full weights and floating-point buffers, compared."""
        tensors = [p.detach() for p in self.params] + [
            b for _, b in self.module.named_buffers() if b.is_floating_point()
        ]
        row = fingerprint_many(tensors)
        rows = [
            json.loads(b) for b in all_gather_bytes(json.dumps(row).encode(), group=self.group, wire_device=self.wire)
        ]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            self.passed.append(("consensus", s))
            return
        names = self.names + [n for n, b in self.module.named_buffers() if b.is_floating_point()]
        where = [names[i] for i in verdict.mismatched[:5]]
        event = {"kind": "consensus", "step": s, "suspects": list(verdict.minority_ranks), "tensors": where}
        raise FaultDetectedError(
            f"weight consensus at step {s} failed: rank(s) {list(verdict.minority_ranks)} hold other weights "
            f"than the majority (tensors {where})",
            event,
        )

    # --- the replay -----------------------------------------------------------------------------

    def _replay(self, units: list[tuple[Any, torch.Tensor]], s: int) -> list[int]:
        """Fingerprints of the gradients of ``units`` (averaged as DeepSpeed averages them over its
        accumulation), computed on the bare module; ``.grad`` and the RNG state are left as found."""
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
            return fingerprint_many(total or [])
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
