"""Check 2 of an FSDP2 / HSDP audit session: the ring replay audit and the optimizer-step replay.

At audit steps every rank replays its predecessor's micro-batches collectively through the sharded
model (``sharded_replay.GradientRecorder``) and the ranks compare the layers' digest lists ring-wise,
with attribution and a two-hop arbitration; with ``audit_updates`` the next rank also recomputes each
rank's optimizer step on its shard. ``ShardedReplayAudit`` is a check object of
``sharded.ShardedAuditSession``, built on its ``sharded_context.ShardedContext``.
"""

from __future__ import annotations

import json
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .agreement import all_gather_bytes, refuse_together
from .attribution import arbitration_plan, attribute_replay, ring_pairs
from .exchange import RingShift
from .replay import restore_rng
from .sharded_consensus import ShardConsensus
from .sharded_context import ShardedContext
from .sharded_replay import (
    LayerDigest,
    arbitrate,
    compare_ring,
    recompute_update,
    sync_pattern,
    update_digests,
    update_labels,
)
from .timing import timed

__all__ = ["ShardedReplayAudit"]


class ShardedReplayAudit:
    """The replay audits of ``ShardedAuditSession``, through the context's recorder and ``loss_fn``.

    ``consensus(found_by=...)``: the session's weight consensus, which a failed replay checks first.
    Its own state: whether the first update audit's self-check ran, and its one warning.
    """

    def __init__(self, ctx: ShardedContext, *, consensus: Callable[..., ShardConsensus]) -> None:
        self.ctx, self.consensus = ctx, consensus
        self._update_checked = False  # the first update audit also recomputes the rank's own step
        self._update_skip_warned = False

    @timed("replay")
    def _replay(
        self, payload: dict[str, Any], trained: list[LayerDigest], measure: str = "digest"
    ) -> list[LayerDigest]:
        ctx = self.ctx
        assert ctx.recorder is not None and ctx.loss_fn is not None, "the replay audit runs with loss_fn only"
        return ctx.recorder.replay(
            ctx.model,
            ctx.loss_fn,
            payload["units"],
            payload["rngs"],
            divisor=int(payload["n"]),
            pattern=sync_pattern(trained),
            restore_rng=lambda state: restore_rng(state, ctx.device),
            measure=measure,
        )

    def _gather_digests(self, *lists: list[LayerDigest]) -> list[list[Any]]:
        """Every rank's digest lists, in rank order (one small all-gather)."""
        mine = json.dumps([[d.as_list() for d in lst] for lst in lists]).encode()
        return [json.loads(t) for t in all_gather_bytes(mine, group=self.ctx.group, wire_device=self.ctx.wire_device)]

    def check_path(self, step: dict[str, Any], trained: list[LayerDigest], n: int) -> None:
        """At the first step with finite gradients, every rank replays its own micro-batches and
        must sign exactly what training reduce-scattered; else every rank refuses together (a
        set-up the audits would always flag)."""
        ctx = self.ctx
        ctx.state.path_check_pending = False
        reason = self._unsigned_problem(trained)
        if reason is None:
            again = self._replay({"units": step["units"], "rngs": step["rngs"], "n": n}, trained)
            if [d.as_list() for d in again] != [d.as_list() for d in trained]:
                layers = sorted({d.layer for d, e in zip(again, trained) if d != e}) or ["*"]
                reason = (
                    f"the replay of the first step signs other local gradients than training did (layers {layers[:5]})"
                )
        refuse_together(
            reason,
            group=ctx.group,
            wire_device=ctx.wire_device,
            what="the replay check",
            advice=(
                "the replay calls loss_fn(model, unit) for each micro-batch given to begin_micro_batch and"
                " back-propagates it divided by loss_divisor (default: the number of micro-batches); likely"
                " causes: a loss_fn that is not what the loop computes, a loop that scales its loss otherwise"
                " (pass before_update(loss_divisor=...)), nondeterministic kernels"
                " (torch.use_deterministic_algorithms(True)), or randomness drawn outside torch"
            ),
        )

    def _unsigned_problem(self, trained: list[LayerDigest]) -> str | None:
        # Gradients were reduced but nothing signed them: an audit would compare two empty lists and pass.
        if trained or not any(p.grad is not None and isinstance(p, DTensor) for _, p in self.ctx.params):
            return None
        return (
            "no reduce-scatter was signed: something replaced certckpt's reduce-scatter after the session was"
            " created (FSDPModule.set_custom_reduce_scatter, set_symm_mem_for_comm, ...); set those up before"
            " creating the session, which then signs around them"
        )

    @timed("replay_audit")
    def audit(
        self,
        s: int,
        step: dict[str, Any],
        trained: list[LayerDigest],
        n: int,
        *,
        trigger: dict[str, Any] | None = None,
    ) -> bool:
        """Every rank replays its predecessor's micro-batches; returns whether the update may be applied.

        ``trained``: this rank's signed reduce-scatter inputs. ``trigger``: the sentinels' reasons,
        when they asked for this replay between audits (``sharded_trigger``): ``trained`` then holds
        the sums of squares training took, the replay takes its own (``measure="squares"``), a pass
        is a ``triggered-replay`` event (no audit) and a failure a ``replay`` failure carrying them.
        """
        ctx = self.ctx
        measure = "digest" if trigger is None else "squares"
        refuse_together(
            self._unsigned_problem(trained),
            group=ctx.group,
            wire_device=ctx.wire_device,
            what="the replay audit",
        )
        payload = {"units": step["units"], "rngs": step["rngs"], "n": n}
        prev = RingShift(payload, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
        replayed = self._replay(prev, trained, measure)
        docs = self._gather_digests(trained, replayed)
        trained_all, replayed_all = [d[0] for d in docs], [d[1] for d in docs]
        result = compare_ring(trained_all, replayed_all)
        details: dict[str, Any] = {
            "comparisons": ctx.world,
            "layers": len(trained),
            "micro_batches": len(step["units"]),
        }
        if trigger is not None:
            details = {"trigger": trigger, "compared": "sum of squares per layer", **details}
        if ctx.not_replayed:
            details["params_not_replayed"] = ctx.not_replayed[:20]  # not fully_shard-ed: FSDP never reduces them
        if result.passed:
            kind = "replay" if trigger is None else "triggered-replay"
            ctx.report.event(kind, "pass", step=s, mode="deterministic", **details)
            return True
        # A replay can only be trusted between replicas holding the same weights: check them first.
        if not self.consensus(found_by="replay precondition").agreed:
            ctx.drop_grads()
            return False
        arbitration: dict[tuple[int, int], str] = {}
        if arbitrate_needed := bool(arbitration_plan(ctx.world, result.failed)):
            # two hops round the ring: the rank after each replayer recomputes the origin's micro-batches
            prev2 = RingShift(prev, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
            arbiters = [d[0] for d in self._gather_digests(self._replay(prev2, trained, measure))]
            arbitration = arbitrate(ctx.world, result.failed, trained_all, replayed_all, arbiters)
        verdict = attribute_replay(ctx.world, result.failed, arbitration)
        ev = ctx.report.event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            mode="deterministic",
            **details,
            failed=[{"origin": o, "replayer": r} for o, r in result.failed],
            mismatched=result.mismatched,
            arbitration={f"{o}->{r}": v for (o, r), v in arbitration.items()},
            arbitrated=arbitrate_needed,
            notes=list(verdict.notes),
        )
        return ctx.fail_replay(ev, verdict.suspects)

    # --- the update replay ------------------------------------------------------------------------

    @timed("update_audit")
    def audit_update(self, s: int, inputs: dict[str, Any], params: list[torch.Tensor]) -> bool:
        """After the optimizer step: the next rank recomputes this rank's update (see
        ``sharded_replay``); returns whether every recomputation matched (collective)."""
        ctx = self.ctx
        gone = any(p.grad is None for p in params)
        flags = all_gather_bytes(b"1" if gone else b"0", group=ctx.group, wire_device=ctx.wire_device)
        if b"1" in flags:  # zero_grad ran before after_update on some rank: nothing to recompute from
            if not self._update_skip_warned:
                self._update_skip_warned = True
                warnings.warn(
                    f"certckpt: step {s}: the optimizer step could not be recomputed (its gradients were dropped"
                    " before after_update()); call opt.zero_grad() after session.after_update()",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return True
        items = [item for g in inputs["groups"] for item in g["params"]]
        for item, p in zip(items, params):
            g = p.grad
            assert g is not None  # every rank has them (checked above)
            item["g"] = (g.to_local() if isinstance(g, DTensor) else g).detach()
        actual = update_digests(ctx.optimizer, params)
        labels = update_labels(ctx.optimizer, params, ctx.names_by_id)
        cls = type(ctx.optimizer)
        prev = RingShift(inputs, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
        recomputed = recompute_update(cls, prev, device=ctx.device)
        if not self._update_checked:
            self._update_checked = True
            own = recompute_update(cls, inputs, device=ctx.device)
            differ = sorted({lab for lab, a, b in zip(labels, own, actual) if a != b})
            differ = differ or (["*"] if own != actual else [])
            refuse_together(
                f"recomputing this rank's own optimizer step gives other values ({differ[:5]})" if differ else None,
                group=ctx.group,
                wire_device=ctx.wire_device,
                what="the update audit check",
                advice=(
                    f"the step is recomputed with a fresh {cls.__name__} over plain copies of the shards; a loop"
                    " that changes the gradients between before_update() and opt.step() other than by clipping,"
                    " an optimizer whose step depends on more than its param groups and state, or kernels that"
                    " differ between DTensors and plain tensors make it differ: pass audit_updates=False"
                ),
            )
        mine = json.dumps([actual, recomputed, labels]).encode()
        docs = [json.loads(t) for t in all_gather_bytes(mine, group=ctx.group, wire_device=ctx.wire_device)]
        failed, mismatched = [], {}
        for origin, replayer in ring_pairs(ctx.world):
            got, want, names = docs[replayer][1], docs[origin][0], docs[origin][2]
            if got != want:
                failed.append((origin, replayer))
                diff = [n for n, a, b in zip(names, got, want) if a != b] if len(got) == len(want) else ["*"]
                mismatched[f"{origin}->{replayer}"] = diff[:10]
        details: dict[str, Any] = {
            "phase": "update",
            "comparisons": ctx.world,
            "params": len(params),
            "optimizer": cls.__name__,
        }
        if not failed:
            ctx.report.event("replay", "pass", step=s, **details)
            return True
        arbitration: dict[tuple[int, int], str] = {}
        if arbitration_plan(ctx.world, failed):
            # two hops round the ring: the rank after each replayer recomputes the origin's step too
            prev2 = RingShift(prev, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
            third = recompute_update(cls, prev2, device=ctx.device)
            texts = all_gather_bytes(json.dumps(third).encode(), group=ctx.group, wire_device=ctx.wire_device)
            actual_all, recomputed_all = [d[0] for d in docs], [d[1] for d in docs]
            third_all = [json.loads(t) for t in texts]
            arbitration = arbitrate(ctx.world, failed, actual_all, recomputed_all, third_all, same=operator.eq)
        verdict = attribute_replay(ctx.world, failed, arbitration)
        ev = ctx.report.event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            **details,
            failed=[{"origin": o, "replayer": r} for o, r in failed],
            mismatched=mismatched,
            arbitration={f"{o}->{r}": v for (o, r), v in arbitration.items()},
            notes=list(verdict.notes),
        )
        who = f"rank(s) {list(verdict.suspects)}" if verdict.suspects else "no rank could be named"
        message = f"the optimizer step's recomputation differs ({who}); the update was applied"
        ctx.report.fail(ev, message, policy=ctx.options.on_fault.value)
        return False
