"""Check 2 of a DDP audit session: the ring replay audit.

On an audit step every rank recomputes its predecessor's micro-batches (shipped round the ring with
the RNG state they started with) with its own weights, signs the gradients and compares them with
the signatures the predecessor computed in training; a failed comparison is checked against the
weight consensus and arbitrated by a third rank's replay, then attributed (``attribution.py``). The
same replay serves the first step's checks (the model is deterministic; a replay reproduces
training) and a gradient scaler's overflow check. ``RingReplay`` is a mixin of
``session.AuditSession`` and works on the session's attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .agreement import refuse_together
from .attribution import arbitration_plan, attribute_replay, ring_pairs
from .exchange import recv_payload, send_payload
from .hook import nonfinite_flag
from .signature import Probes, matches, signature

__all__ = ["RingReplay", "restore_rng"]

# Replayed gradients smaller than SIGN_ALONE_BYTES wait, up to SIGN_BATCH_BYTES of them, to be signed
# together (one kernel launch on a GPU, ``digests``); larger ones are signed as they come.
SIGN_ALONE_BYTES = 1 << 20
SIGN_BATCH_BYTES = 16 << 20


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set the RNG states a micro-batch was computed with (as ``Auditor._rng_state`` took them).

    The neighbour's states travel with its micro-batch and arrive on the wire device (CUDA under
    NCCL, the model's device under gloo); torch's setters accept only a CPU ByteTensor.
    """
    torch.set_rng_state(state["cpu"].to(device="cpu", dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].to(device="cpu", dtype=torch.uint8), device)


class RingReplay:
    """The ring replay of ``AuditSession`` (a mixin: the session holds the state it reads).

    It replays through the session's bare module and ``loss_fn`` and uses its ``_scaled``,
    ``_rng_state``, ``_gather_rows``, ``weight_consensus`` (a failed replay's precondition),
    ``_event``, ``_fail`` and ``_zero_grad``.
    """

    def _replay(  # noqa: C901
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

        # Small gradients are signed in batches: on a GPU one launch per small parameter costs more
        # host time than the replay's own backward (issue 15); a few MiB held at a time.
        batched = self.mode == "deterministic" and not finite
        pending: list[tuple[int, torch.Tensor]] = []
        held = [0]

        def flush() -> None:
            if pending:
                for (i, _), row in zip(pending, signature([g for _, g in pending], mode=self.mode)):
                    rows[i] = row
                pending.clear()
                held[0] = 0

        def sign_later(i: int, g: torch.Tensor) -> None:
            size = g.numel() * g.element_size()
            if not batched or size >= SIGN_ALONE_BYTES:
                rows[i] = sign(i, g)
                return
            pending.append((i, g))
            held[0] += size
            if held[0] >= SIGN_BATCH_BYTES:
                flush()

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
                    sign_later(i, g.detach())
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
            flush()
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
                    sign_later(i, a)
                    acc[i] = None
            flush()
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
