"""The set-up refusals of a DDP audit session, which every rank makes together.

Before the first step can be trusted, the session checks that its options make sense
(``option_problem``), that every rank built the same model with the same audit settings, that
resumed weights are the checkpoint resumed from, and, at the first step, that the batch can travel
to a neighbour and the model computes deterministically. A refusal is collective: every rank raises
the same error, so that none is left waiting in the next collective. ``SetupChecks`` is a check
object of ``session.AuditSession``, built on its ``context.CheckContext``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import AuditSetupError

from .consensus import WeightConsensus
from .context import CheckContext
from .exchange import refuse_unshippable
from .letgo import released
from .options import AuditOptions, Mode
from .replay import RingReplay

__all__ = ["SetupChecks", "option_problem"]


def option_problem(ddp: Any, options: AuditOptions) -> str | None:
    """What is wrong with the Auditor's model and options on this rank (None: nothing); each option
    alone was validated when ``options`` was built."""
    if not isinstance(ddp, DistributedDataParallel):
        return (
            f"model must be a DistributedDataParallel (or torch.compile of one), got {type(ddp).__name__};"
            " wrap it: Auditor(DDP(model), ...)"
        )
    problem = nonfinite_read_problem(
        options.nonfinite_read,
        on_nonfinite=options.on_nonfinite,
        grad_scaler=options.grad_scaler,
        exchange_flags=options.exchange_flags,
    )
    if problem is not None:
        return problem
    clip, before, scaler = options.clip_grad_norm, options.before_optimizer_step, options.grad_scaler
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        return f"clip_grad_norm must be a positive number (the max norm) or None, got {clip!r}"
    if before is not None and not callable(before):
        return "before_optimizer_step must be callable as fn(module, optimizer)"
    if scaler is not None and not all(
        callable(getattr(scaler, name, None)) for name in ("scale", "unscale_", "step", "update", "get_scale")
    ):
        return f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}"
    return None


def nonfinite_read_problem(
    nonfinite_read: str, *, on_nonfinite: str, grad_scaler: Any = None, exchange_flags: str = "on-failure"
) -> str | None:
    """What is wrong with ``nonfinite_read`` given the other options (both sessions; None: nothing).

    A deferred read learns of a non-finite step after its update was applied: it cannot skip that
    update, nor tell a scaler's overflow apart in time, and an every-step exchange would read anyway.
    """
    if nonfinite_read not in ("immediate", "deferred"):
        return f"nonfinite_read must be 'immediate' or 'deferred', got {nonfinite_read!r}"
    if nonfinite_read == "immediate":
        return None
    if on_nonfinite != "raise":
        return (
            "nonfinite_read='deferred' applies a step's update before reading its flags, so it cannot"
            " skip it: use on_nonfinite='raise'"
        )
    if grad_scaler is not None:
        return (
            "nonfinite_read='deferred' cannot be used with grad_scaler: an overflow must be found"
            " before the update, to skip it"
        )
    if exchange_flags != "on-failure":
        return (
            "nonfinite_read='deferred' with exchange_flags='every-step' would still read the flags"
            " every step: choose one"
        )
    return None


def late_detection_note(step: int) -> str:
    """What a detection made by a deferred read tells the user about the step it names."""
    return (
        f"; step {step}'s update was applied (nonfinite_read='deferred' reads each step's flags a step later)"
        " and the weights in memory are not to be trusted: resume from the latest good checkpoint"
    )


class SetupChecks:
    """The set-up checks of ``AuditSession``: on the context's configuration, parameters and buffers.

    ``consensus`` checks resumed weights; ``replay`` makes the first step's determinism check.
    """

    def __init__(self, ctx: CheckContext, *, consensus: WeightConsensus, replay: RingReplay) -> None:
        self.ctx, self.consensus, self.replay = ctx, consensus, replay

    def check_resumed_weights(self, expected: str, *, parent: str | None) -> None:
        """Every replica's weights at ``start_step`` must be the checkpoint resumed from: they agree
        (a disagreement is a fault, as at any consensus) and their state fingerprint is ``expected``.
        Every rank computes the same agreed value, so every rank refuses together."""
        step = self.ctx.state.step
        self.consensus.check(step, found_by="resume", fingerprints=True)
        agreed_at = self.ctx.state.agreed_at(step)
        agreed = agreed_at[1] if agreed_at is not None else None
        if agreed != expected:
            raise AuditSetupError(
                f"the weights loaded for step {step} have consensus fingerprint {agreed}, but the checkpoint "
                f"resumed from ({parent or 'the parent'}) recorded {expected}: load that checkpoint's state "
                "(model and buffers) into every replica before creating the auditor"
            )

    def check_world_agrees(self) -> None:
        """Every rank must have the same parameters and the same audit configuration.

        Every rank raises the same message, naming the groups of ranks that agree with each other.
        """
        ctx, opts = self.ctx, self.ctx.options
        desc = json.dumps(
            [
                opts.audit_every,
                opts.consensus_every,
                opts.mode.value,
                opts.exchange_flags.value,
                opts.clip_grad_norm,
                opts.before_optimizer_step is not None,
                ctx.grad_scaler is not None,
                opts.replay_micro_batches,
                repr(opts.triggers),
                ctx.hook.sentinels,  # every rank exchanges the sentinels' rows, or none does
                [(n, list(p.shape), str(p.dtype)) for n, p in zip(ctx.param_names, ctx.params)],
                [(n, list(b.shape), str(b.dtype)) for n, b in zip(ctx.buffer_names, ctx.buffers)],
            ]
        ).encode()
        mine = torch.tensor(
            [xxhash.xxh3_64_intdigest(desc) & ((1 << 62) - 1)], dtype=torch.int64, device=ctx.wire_device
        )
        allv = [torch.empty_like(mine) for _ in range(ctx.world)]
        with released(mine, *allv):
            dist.all_gather(allv, mine, group=ctx.group)
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

    def first_step_checks(self, units: list[Any], micro: bool) -> None:
        """Refuse, on every rank together, a batch that cannot travel or a model that is not deterministic."""
        ctx = self.ctx
        refuse_unshippable(units if micro else units[0], group=ctx.group, wire_device=ctx.wire_device)
        if ctx.options.check_determinism and ctx.options.mode is Mode.DETERMINISTIC:
            self.replay.check_deterministic(units, micro)
