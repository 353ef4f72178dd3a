"""Check 2 of a DDP audit session: the ring replay audit.

On an audit step every rank recomputes its predecessor's micro-batches (shipped round the ring with
the RNG state they started with) with its own weights, signs the gradients and compares them with
the signatures the predecessor computed in training; a failed comparison is checked against the
weight consensus and arbitrated by a third rank's replay, then attributed (``attribution.py``). The
same replay serves the first step's checks (the model is deterministic; a replay reproduces
training) and a gradient scaler's overflow check. ``RingReplay`` is a check object of
``session.AuditSession``, built on its ``context.CheckContext``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .agreement import refuse_together
from .attribution import arbitration_plan, attribute_replay, ring_pairs
from .buckets import BucketLayout, BucketSquares, TrainedSquares, squares_match
from .consensus import WeightConsensus
from .context import CheckContext
from .exchange import recv_payload, send_payload
from .hook import nonfinite_flag
from .letgo import released
from .options import Mode
from .signature import matches, signature
from .timing import span, timed

__all__ = ["RingReplay", "restore_rng"]

# Replayed gradients smaller than SIGN_ALONE_BYTES wait, up to SIGN_BATCH_BYTES of them, to be signed
# together (one kernel launch on a GPU, ``digests``); larger ones are signed as they come.
SIGN_ALONE_BYTES = 1 << 20
SIGN_BATCH_BYTES = 16 << 20


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the RNG states a micro-batch was computed with (as ``CheckContext.rng_state`` took them).

    The neighbour's states travel with its micro-batch and arrive on the wire device (CUDA under
    NCCL, the model's device under gloo); torch's setters accept only a CPU ByteTensor.
    """
    torch.set_rng_state(state["cpu"].to(device="cpu", dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].to(device="cpu", dtype=torch.uint8), device)


class _ReplaySigner:
    """Signs one replay's gradients as backward produces them (see ``RingReplay.recompute``).

    One batch: each gradient is signed by its tensor hook (small ones batched, up to
    SIGN_BATCH_BYTES, into one launch). Several micro-batches: the hook adds each gradient into
    a per-parameter accumulator (``acc``) in micro-batch order, signed at the end. ``finite``: each
    row is a non-finite flag instead of a signature. ``buckets``: each gradient goes into its DDP
    bucket instead, and the result is each bucket's sum of squares (a triggered replay without
    hand-over, ``buckets.py``).
    """

    def __init__(
        self,
        ctx: CheckContext,
        *,
        finite: bool,
        accumulate: bool,
        buckets: BucketSquares | None = None,
        kept: list[torch.Tensor | None] | None = None,
    ) -> None:
        self.ctx, self.finite, self.buckets = ctx, finite, buckets
        self.rows: list[torch.Tensor | None] = [None] * len(ctx.params)
        self.acc: list[torch.Tensor | None] | None = [None] * len(ctx.params) if accumulate else None
        # CPU: the previous replay's accumulators, written over instead of adopting new memory (RingReplay)
        self.kept = kept
        self._adopted: set[int] = set()  # data pointers of the gradients adopted as accumulators
        # Small gradients are signed in batches: on a GPU one launch per small parameter costs more
        # host time than the replay's own backward (issue 15); a few MiB held at a time.
        self.batched = ctx.options.mode is Mode.DETERMINISTIC and not finite
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.held = 0

    def sign(self, i: int, g: torch.Tensor) -> torch.Tensor:
        if self.finite:
            return nonfinite_flag(g)
        probes = self.ctx.probes.subset([i]) if self.ctx.probes is not None else None
        with span("replay_signature"):
            return signature([g], mode=self.ctx.options.mode, probes=probes)[0]

    def flush(self) -> None:
        if self.pending:
            with span("replay_signature"):
                rows = signature([g for _, g in self.pending], mode=self.ctx.options.mode)
            for (i, _), row in zip(self.pending, rows):
                self.rows[i] = row
            self.pending.clear()
            self.held = 0

    def sign_later(self, i: int, g: torch.Tensor) -> None:
        if self.buckets is not None:
            self.buckets.add(i, g)
            return
        size = g.numel() * g.element_size()
        if not self.batched or size >= SIGN_ALONE_BYTES:
            self.rows[i] = self.sign(i, g)
            return
        self.pending.append((i, g))
        self.held += size
        if self.held >= SIGN_BATCH_BYTES:
            self.flush()

    def hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.acc is not None:
                a = self.acc[i]
                if a is None:
                    self.acc[i] = self._adopt(i, grad.detach())
                else:
                    a.add_(grad.detach())
            else:
                g = grad
                injector = self.ctx.injector
                if injector is not None:  # drills only: a persistent fault corrupts replays too
                    g = grad.detach().clone()
                    injector.on_local_grads([self.ctx.param_names[i]], [g])
                self.sign_later(i, g.detach())
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)

        return hook

    def _adopt(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """The first micro-batch's gradient of parameter ``i`` as its accumulator: the tensor itself
        when autograd made it for this parameter alone (dense, not a view, not handed to another
        parameter), else a copy; with ``kept`` (CPU), a copy into the previous replay's accumulator.

        The hook hands autograd a placeholder, so nothing else writes this tensor once the hook
        has run, and the next micro-batch adds into it after this backward's graph is gone. A copy
        is kept for the gradients that alias something: a view of a larger gradient, or one tensor
        reaching two parameters (``p1 + p2``), which two accumulators must not share.
        """
        if self.kept is not None:
            k = self.kept[i]
            if k is None or k.shape != g.shape or k.dtype != g.dtype:
                k = self.kept[i] = torch.empty(g.shape, dtype=g.dtype, device=g.device)
            return k.copy_(g)
        if g._base is None and g.is_contiguous() and g.data_ptr() not in self._adopted:
            self._adopted.add(g.data_ptr())
            return g
        return g.clone()

    def sign_accumulated(self, s: int) -> None:
        """Sign the accumulators (after a drill's backward faults, which hit an accumulated
        gradient as they hit DDP's bucket in training)."""
        acc, injector = self.acc, self.ctx.injector
        if acc is None:
            return
        if injector is not None:
            injector.begin(s, "replay")
            present = [(i, a) for i, a in enumerate(acc) if a is not None]
            injector.on_local_grads([self.ctx.param_names[i] for i, _ in present], [a for _, a in present])
            injector.begin(s, "train")
        for i, a in enumerate(acc):
            if a is not None:
                self.sign_later(i, a)
                acc[i] = None
        self.flush()

    def result(self) -> torch.Tensor:
        """The stacked rows (a parameter unused in the forward signs zeros, as DDP's bucket holds
        them), one flag with ``finite``, or the buckets' sums of squares with ``buckets``."""
        if self.buckets is not None:
            return self.buckets.result()
        rows = [
            r if r is not None else self.sign(i, torch.zeros_like(p))
            for i, (r, p) in enumerate(zip(self.rows, self.ctx.params))
        ]
        return torch.stack(rows).any() if self.finite else torch.stack(rows)


class RingReplay:
    """The ring replay of ``AuditSession``: replays through the bare module and ``loss_fn``.

    ``consensus``: the weight consensus a failed replay checks first (the replicas must hold the
    same weights for a replay to be compared).
    """

    def __init__(self, ctx: CheckContext, *, consensus: WeightConsensus) -> None:
        self.ctx, self.consensus = ctx, consensus
        # On CPU the accumulators of a replay with several micro-batches (one model's gradients) are
        # kept from one audit to the next and written over. Freed, glibc hands such blocks back to the
        # system, and the next audit, and the optimizer step after each audit, paid a page fault per
        # 4 KiB to get them again: in the 2-rank Accelerate benchmark (29 MiB of gradients) an audit
        # step took about 45 ms less with them kept. A GPU's caching allocator keeps freed blocks
        # itself, so there the gradients are adopted as they come and nothing is held between audits.
        self._kept: list[torch.Tensor | None] | None = [None] * len(ctx.params) if ctx.device.type == "cpu" else None

    @timed("replay")
    def recompute(
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
        layouts: Sequence[BucketLayout] | None = None,
    ) -> torch.Tensor:
        """Gradient signature of one step's micro-batches recomputed on this rank, leaving .grad and
        buffers alone.

        One batch: each parameter's gradient is signed by a tensor hook as soon as backward
        produces it (gradients under SIGN_ALONE_BYTES wait for a few others, to be signed in one
        launch), and the hook hands autograd a zero-stride placeholder instead, so the gradient is
        freed at once: at most one large gradient, or SIGN_BATCH_BYTES of small ones, alive at a time.
        Keeping all of them until the end (as ``autograd.grad`` would) means as much fresh memory as
        the model on every audit, which on CPU costs a page fault per 4 KiB (about 12 ms per 36 MiB
        here) because the allocator hands such a block back to the system after each audit.

        Several micro-batches: the hook adds each gradient into a per-parameter accumulator, in
        micro-batch order, as autograd accumulates ``.grad`` under ``no_sync`` (the same additions,
        so the same bits), and the accumulators are signed at the end: one model's worth of memory
        during the audit, one graph alive at a time.

        ``finite=True`` (a gradient scaler's overflow check) returns one flag instead: True when
        any recomputed gradient is non-finite. ``n_total``: the step's number of micro-batches when
        ``units`` is a sample of them (each loss is divided by the step's count, as in training).
        ``rngs``: the RNG state each micro-batch started with (a loop someone else runs may draw
        random numbers between micro-batches, e.g. in its data pipeline); default: ``rng`` once.
        ``layouts``: return each of these DDP buckets' sum of squares instead, the replayed (and,
        with micro-batches, accumulated) gradients laid out as DDP lays them into its buckets
        (``buckets.BucketSquares``: one bucket's buffer alive while backward fills it).
        """
        ctx = self.ctx
        buffers = [b.detach().clone() for b in module.buffers()]
        buckets = BucketSquares(layouts, device=ctx.device) if layouts is not None else None
        signer = _ReplaySigner(ctx, finite=finite, accumulate=len(units) > 1, buckets=buckets, kept=self._kept)
        handles = [p.register_hook(signer.hook(i)) for i, p in enumerate(ctx.params)]
        try:
            self._forward_backward(module, units, micro, rng, s, n=n_total or len(units), rngs=rngs)
            signer.flush()
        finally:
            for h in handles:
                h.remove()
            with torch.no_grad():
                for b, saved in zip(module.buffers(), buffers):
                    b.copy_(saved)
            if ctx.injector is not None:
                ctx.injector.begin(s, "train")
        signer.sign_accumulated(s)
        return signer.result()

    def _forward_backward(
        self,
        module: torch.nn.Module,
        units: list[Any],
        micro: bool,
        rng: dict[str, torch.Tensor],
        s: int,
        *,
        n: int,
        rngs: Sequence[dict[str, torch.Tensor]] | None,
    ) -> None:
        """Forward and backward of ``units`` from their RNG states, gradients to the tensor hooks only."""
        ctx = self.ctx
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            restore_rng(rng, ctx.device)
            if ctx.injector is not None:
                ctx.injector.begin(s, "replay")
            for k, unit in enumerate(units):
                if rngs is not None and k:
                    restore_rng(rngs[k], ctx.device)
                loss = ctx.loss_fn(module, unit)
                torch.autograd.grad(ctx.scaled(loss, n=n, micro=micro), ctx.params, allow_unused=True)
                del loss

    def _refuse_unless_same(self, same: list[bool], differs: str, *, what: str, advice: str) -> None:
        """Refuse on every rank together (``refuse_together``) unless every parameter's comparison
        in ``same`` held; the reason is ``differs``, with the first five parameters that differ."""
        ctx = self.ctx
        reason = None
        if not all(same):
            names = [n for n, ok in zip(ctx.param_names, same) if not ok][:5]
            reason = f"{differs} (e.g. {names})"
        refuse_together(reason, group=ctx.group, wire_device=ctx.wire_device, what=what, advice=advice)

    def check_deterministic(self, units: list[Any], micro: bool) -> None:
        """Replay the rank's own first step twice; refuse (on every rank together) if they differ."""
        ctx = self.ctx
        rng = ctx.rng_state()
        module = ctx.model.module
        a, b = self.recompute(module, units, micro, rng, 0), self.recompute(module, units, micro, rng, 0)
        self._refuse_unless_same(
            matches(a.cpu(), b.cpu(), mode="deterministic", rtol=0),
            "gradients differ between two identical computations",
            what="the determinism check (deterministic mode)",
            advice=(
                "the replay restores torch's RNG state only, so the likely causes are: randomness drawn outside"
                " torch inside the model or loss_fn (Python's random, numpy.random: draw from torch instead, e.g."
                " torch.rand), state that changes between calls (a counter, a cache), or non-deterministic kernels"
                " (enable torch.use_deterministic_algorithms(True)); Auditor(mode='tolerance') helps with the"
                " last cause only"
            ),
        )

    def check_path(
        self,
        s: int,
        units: list[Any],
        micro: bool,
        rng: dict[str, torch.Tensor] | None,
        *,
        n_total: int | None = None,
        rngs: Sequence[dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """Replay this rank's own step and compare with its training gradients (first clean step).

        This is the comparison every audit makes between two ranks, made on one rank with the same
        weights, so that a set-up the audits would always flag is refused at once, on every rank.
        ``rng`` is always there on that step (the session keeps it whenever the check is pending).
        """
        ctx = self.ctx
        assert rng is not None, "the replay-path check needs the step's RNG state"
        ctx.state.path_check_pending = False
        local = self._local_signatures()
        again = self.recompute(ctx.model.module, units, micro, rng, s, n_total=n_total, rngs=rngs)
        self._refuse_unless_same(
            matches(again.cpu(), local.cpu(), mode=ctx.options.mode, rtol=ctx.options.rtol),
            "the replay of the first step gives other gradients than training did",
            what="the replay check",
            advice=(
                "a replay calls loss_fn(model.module, batch) on the bare module, outside DDP and outside a"
                " torch.compile wrapped around DDP; likely causes: a loss_fn that treats the bare module"
                " differently, a compiler that changes the arithmetic (compile inside DDP instead,"
                " DDP(torch.compile(model)), or use Auditor(mode='tolerance')), a forward that reads the buffers"
                " it updates, or randomness drawn outside torch"
            ),
        )

    def _local_signatures(self) -> torch.Tensor:
        """The signatures the hook took of this rank's local gradients, in parameter order."""
        return torch.stack([self.ctx.hook.local_sig[i] for i in range(len(self.ctx.params))])

    def _comparison(self, layouts: Sequence[BucketLayout] | None) -> Callable[[torch.Tensor, torch.Tensor], list[bool]]:
        """How two gathered rows are compared: signatures per parameter, or sums of squares per bucket."""
        mode, rtol = self.ctx.options.mode.value, self.ctx.options.rtol
        if layouts is not None:
            return lambda a, b: squares_match(a, b, mode=mode, rtol=rtol)
        return lambda a, b: matches(a, b, mode=mode, rtol=rtol)

    def _labels(self, layouts: Sequence[BucketLayout] | None) -> list[str]:
        """What each compared row is called in a failure's ``mismatched``: a parameter's name, or a
        bucket with the first parameters it holds."""
        names = self.ctx.param_names
        if layouts is None:
            return list(names)
        out = []
        for lay in layouts:
            held = ", ".join(names[i] for i in lay.params[:3]) + (", ..." if len(lay.params) > 3 else "")
            out.append(f"bucket {lay.index} ({held})")
        return out

    @timed("replay_audit")
    def audit(
        self,
        s: int,
        units: list[Any],
        prev: dict[str, Any],
        *,
        payload: dict[str, Any],
        sampled: torch.Tensor | None = None,
        trigger: dict[str, Any] | None = None,
        squares: TrainedSquares | None = None,
    ) -> bool:
        """Run the ring replay of ``prev`` (the previous rank's micro-batches and RNG state); returns
        whether the update may be applied.

        ``payload``: what this rank shipped to its neighbour (sent again to an arbiter); ``sampled``:
        the signature of an audit's sampled micro-batches, taken in training (default: the hook's
        signatures of the step's local gradients). ``trigger``: the sentinels' reasons, when they
        asked for this replay between audits: a pass is then a ``triggered-replay`` event (no
        audit), a failure a ``replay`` failure like an audit's, carrying them as ``trigger``.
        ``squares``: the buckets' sums of squares the hook took in training, compared (and
        arbitrated) instead of signatures: a triggered replay where no local gradient survived the
        all-reduce (``buckets.py``).
        """
        ctx = self.ctx
        layouts = squares.layouts if squares is not None else None
        if squares is not None:
            local = squares.sums
        else:
            local = sampled if sampled is not None else self._local_signatures()
        replay = self.recompute(
            ctx.model.module,
            prev["units"],
            bool(prev["micro"]),
            prev["rng"],
            s,
            n_total=int(prev["n"]),
            rngs=prev.get("rngs"),
            layouts=layouts,
        )
        gathered = ctx.gather_rows(torch.stack([local, replay]))  # [W, 2, P, ...] (buckets: [W, 2, B])
        same = self._comparison(layouts)
        labels = self._labels(layouts)
        failed, mismatched = [], {}
        for origin, replayer in ring_pairs(ctx.world):
            ok = same(gathered[replayer][1], gathered[origin][0])
            if not all(ok):
                failed.append((origin, replayer))
                mismatched[f"{origin}->{replayer}"] = [n for n, good in zip(labels, ok) if not good][:10]
        extra: dict[str, Any] = {} if trigger is None else {"trigger": trigger}
        if layouts is not None:
            extra["compared"] = "sum of squares per bucket"
        if not failed:
            ctx.report.event(
                "replay" if trigger is None else "triggered-replay",
                "pass",
                step=s,
                **extra,
                comparisons=len(ring_pairs(ctx.world)),
                mode=ctx.options.mode.value,
                micro_batches=len(units),
                replayed_micro_batches=len(prev["units"]),  # an audit's sample: fewer (coverage reads it)
            )
            return True
        if ctx.state.last is not None:
            ctx.state.last.applied = False
        # A replay can only be trusted between replicas that hold the same weights: check first.
        if not self.consensus.check(s - 1, found_by="replay precondition"):
            ctx.drop_grads()
            return False
        arbitration = self._arbitrate(s, failed, payload, gathered, layouts=layouts)
        verdict = attribute_replay(ctx.world, failed, arbitration)
        ev = ctx.report.event(
            "replay",
            "fail",
            step=s,
            suspects=verdict.suspects,
            contained=False,
            mode=ctx.options.mode.value,
            micro_batches=len(units),
            replayed_micro_batches=len(prev["units"]),
            failed=[{"origin": o, "replayer": r} for o, r in failed],
            mismatched=mismatched,
            arbitration={f"{o}->{r}": v for (o, r), v in arbitration.items()},
            notes=list(verdict.notes),
            **extra,
        )
        return ctx.fail_replay(ev, verdict.suspects)

    def _arbitrate(
        self,
        s: int,
        failed: list[tuple[int, int]],
        payload: dict[str, Any],
        gathered: list[torch.Tensor],
        *,
        layouts: Sequence[BucketLayout] | None = None,
    ) -> dict[tuple[int, int], str]:
        """For each failed comparison no persistent fault explains, a third rank replays the batch
        (``layouts``: it recomputes the buckets' sums of squares, compared as the replay's were)."""
        ctx = self.ctx
        same = self._comparison(layouts)
        results: dict[tuple[int, int], str] = {}
        for origin, replayer, arbiter in arbitration_plan(ctx.world, failed):
            if ctx.rank == origin:
                send_payload(
                    payload,
                    dist.get_global_rank(ctx.group, arbiter),
                    group=ctx.group,
                    wire_device=ctx.wire_device,
                )
                sig = torch.zeros_like(gathered[origin][1])
            elif ctx.rank == arbiter:
                got = recv_payload(
                    dist.get_global_rank(ctx.group, origin),
                    group=ctx.group,
                    wire_device=ctx.wire_device,
                    out_device=ctx.device,
                )
                sig = self.recompute(
                    ctx.model.module,
                    got["units"],
                    bool(got["micro"]),
                    got["rng"],
                    s,
                    n_total=int(got["n"]),
                    rngs=got.get("rngs"),
                    layouts=layouts,
                ).cpu()
            else:
                sig = torch.zeros_like(gathered[origin][1])
            wire = sig.to(ctx.wire_device)
            with released(wire):  # an arbitration may be a run's last collective (letgo)
                dist.broadcast(wire, dist.get_global_rank(ctx.group, arbiter), group=ctx.group)
            arb = wire.cpu()
            with_origin = all(same(arb, gathered[origin][0]))
            with_replayer = all(same(arb, gathered[replayer][1]))
            results[(origin, replayer)] = "origin" if with_origin else "replayer" if with_replayer else "neither"
        return results
