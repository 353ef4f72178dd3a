"""``AuditOptions``: every choice of how the DDP checks run, in one typed, validated object.

``Auditor``, ``AuditSession`` and both frameworks' ``AuditCallback`` take ``options=AuditOptions(...)``
(or the same names as keywords, a shorthand that builds one): each option is defined, defaulted and
documented here only. Modes are ``str`` enums, so ``mode="tolerance"`` and ``mode=Mode.TOLERANCE``
are the same option. What depends on the model (a gradient scaler with deferred reads, the hand-over
with this torch) is checked where the model is known (``setup_checks.option_problem``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from certckpt.errors import ConfigurationError

from .sentinel import Triggers

__all__ = [
    "AuditOptions",
    "Mode",
    "OnNonfinite",
    "OnFault",
    "ExchangeFlags",
    "NonfiniteRead",
    "FleetPolicy",
    "Triggers",
    "DDP_ONLY",
    "SHARDED_ONLY",
    "unused_problem",
    "session_options",
]


class _Choice(str, Enum):
    def __str__(self) -> str:
        return self.value


class Mode(_Choice):
    """How replayed gradients are compared."""

    DETERMINISTIC = "deterministic"  # bit-exact digests (deterministic kernels)
    TOLERANCE = "tolerance"  # norm and projection within ``rtol``


class OnNonfinite(_Choice):
    """What a non-finite gradient does."""

    RAISE = "raise"  # FaultDetectedError (the update is dropped)
    SKIP = "skip"  # drop the update and go on: a contained detection


class OnFault(_Choice):
    """What a failed replay or consensus does (the step's update is dropped either way)."""

    RAISE = "raise"
    CONTINUE = "continue"


class ExchangeFlags(_Choice):
    """When ranks exchange their non-finite flags."""

    ON_FAILURE = "on-failure"  # only on a failing step (no collective on a clean one)
    EVERY_STEP = "every-step"  # one small all-reduce per step: a partial delivery stays contained


class NonfiniteRead(_Choice):
    """When a step's non-finite flags are read on the host."""

    IMMEDIATE = "immediate"  # before its update: one host synchronisation per step
    DEFERRED = "deferred"  # a step later, without waiting for the GPU (docs/detection.md)


class FleetPolicy(_Choice):
    """What a run configured with a fleet registry does when a rank's device is convicted there."""

    REFUSE = "refuse"  # every rank raises DeviceConvictedError before the first step
    WARN = "warn"  # every rank warns, training goes on


_CHOICES: dict[str, type[_Choice]] = {
    "fleet_policy": FleetPolicy,
    "mode": Mode,
    "on_nonfinite": OnNonfinite,
    "on_fault": OnFault,
    "exchange_flags": ExchangeFlags,
    "nonfinite_read": NonfiniteRead,
}


@dataclass(frozen=True, kw_only=True)
class AuditOptions:
    """How the checks run. Every field has a default; frozen, so one object can configure many runs.

    Attributes:
        audit_every: K, the replay-audit interval in steps (full audit = replay + non-finite + consensus).
        consensus_every: also compare weights every N steps (None: at audits and checkpoints only).
        mode: ``"deterministic"`` (bit-exact fingerprints) or ``"tolerance"`` (norm and projection).
        rtol: relative tolerance in tolerance mode.
        on_nonfinite: ``"raise"`` or ``"skip"`` (drop the update: a contained detection).
        exchange_flags: ``"on-failure"`` (default: ranks exchange the non-finite flags only on a
            failing step) or ``"every-step"`` (one small all-reduce per step, so that a reduction
            delivering non-finite values to some ranks only is still a clean, contained detection).
        nonfinite_read: ``"immediate"`` (default: each step's flags are read before its update,
            one host synchronisation per step) or ``"deferred"`` (read one step later, without
            waiting for the GPU: a non-finite step's update is applied, the detection raises at the
            next step, and the weights in memory are then not to be trusted; audits, consensus
            steps and checkpoints read every pending flag first, so no evidence ever covers an
            unread step; ``close`` leaves the last one unread). Deferred needs
            ``on_nonfinite="raise"``, no ``grad_scaler`` and ``exchange_flags="on-failure"``.
        on_fault: ``"raise"`` or ``"continue"`` for replay and consensus failures (the failing step's
            update is dropped either way).
        clip_grad_norm: clip the reduced gradients to this total 2-norm before the optimizer step,
            as ``torch.nn.utils.clip_grad_norm_`` would after a plain DDP backward (every rank clips
            the same averaged gradients identically); the norm is in ``auditor.last.grad_norm``.
        before_optimizer_step: ``fn(module, optimizer)``, called on every rank after the checks
            passed and after clipping, just before ``optimizer.step()``: a gradient transform
            (clip by value, masking, ...). It sees the reduced gradients; it must treat them the
            same on every rank (the weight consensus catches replicas that diverge).
        replay_micro_batches: with ``train_step(micro_batches=...)``, replay at most this many
            micro-batches of an audited step (a contiguous block; successive audits tile the step)
            instead of all of them: an audit then costs k/n of a step's compute, and covers
            k/n of a one-time fault within the step (a persistent one still shows in every block),
            and not the accumulation of the micro-batches' gradients (see docs/detection.md).
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 autocast: the auditor scales the loss,
            unscales before clipping, steps and updates it. A non-finite step is replayed on the
            flagged ranks' neighbours: non-finite again, it is an overflow (skipped by the scaler,
            scale backed off, an ``overflow`` event); finite, a ``nonfinite-pre`` detection naming
            the rank.
        hand_over_grads: where DDP would copy each reduced bucket into ``.grad`` (gradient copies,
            its default), point ``.grad`` at the reduced bucket instead and skip that copy (default
            True; see ``hook.hand_over_possible``). ``p.grad`` is then a view of DDP's bucket after each
            step, as with ``gradient_as_bucket_view=True``; False keeps DDP's copy.
        audit_updates: (``ShardedAuditSession`` only) at audit steps the next rank also recomputes
            this rank's optimizer step on its shard and the results must match. Default (None): on
            when the mesh has no replicas (1-D FSDP), where no consensus can see a wrong update.
        state_fn: (``ShardedAuditSession`` only) ``state_fn() -> state dict``, what the per-step
            weight consensus covers, as a DCP state dict (None: ``{"model": model.state_dict()}``,
            parameters and buffers).
        check_determinism: at the first step, replay the rank's own batch twice and refuse a model
            whose gradients differ (deterministic mode only); and, in either mode, at the first
            step with finite gradients, replay the step once and refuse when the replay does not
            reproduce what training computed (every rank refuses together).
        fleet: a fleet registry's path or URL (``docs/operations.md``, "Convicted devices"): every
            rank's device is looked up there before the first step, the run's store registers
            there, and the devices a failed check blames are convicted there (None: no fleet).
        fleet_policy: with a fleet registry (``fleet=URL``), what a convicted device (or a registry
            that cannot be read or is tampered) does at the start: ``"refuse"`` (default: every rank
            raises ``DeviceConvictedError`` with the same message) or ``"warn"``.
        triggers: the per-step sentinels and the replays they trigger between audits (a
            ``Triggers``; default on): each rank's local gradient norms (and loss) are exchanged
            every step, and a step where a rank's look like outliers is replayed at once, before
            its update (``docs/detection.md``, "Triggered replays"). DDP: per bucket, before the
            all-reduce; ``ShardedAuditSession`` with ``loss_fn``: per ``fully_shard``-ed layer, at
            its reduce-scatter. ``Triggers(enabled=False)`` turns them off.
    """

    audit_every: int = 10
    consensus_every: int | None = None
    mode: Mode = Mode.DETERMINISTIC
    rtol: float = 1e-3
    on_nonfinite: OnNonfinite = OnNonfinite.RAISE
    on_fault: OnFault = OnFault.RAISE
    exchange_flags: ExchangeFlags = ExchangeFlags.ON_FAILURE
    nonfinite_read: NonfiniteRead = NonfiniteRead.IMMEDIATE
    check_determinism: bool = True
    hand_over_grads: bool = True
    clip_grad_norm: float | None = None
    before_optimizer_step: Callable[[Any, Any], None] | None = None
    grad_scaler: Any = None
    replay_micro_batches: int | None = None
    audit_updates: bool | None = None
    state_fn: Callable[[], dict[str, Any]] | None = None
    fleet: str | None = None
    fleet_policy: FleetPolicy = FleetPolicy.REFUSE
    triggers: Triggers = Triggers()

    def __post_init__(self) -> None:
        for name, kind in _CHOICES.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                names = [repr(c.value) for c in kind]
                allowed = f"{', '.join(names[:-1])} or {names[-1]}"
                raise ConfigurationError(f"{name} must be {allowed}, got {value!r}") from None
        if self.state_fn is not None and not callable(self.state_fn):
            got = type(self.state_fn).__name__
            raise ConfigurationError(f"state_fn must be None or callable as state_fn() -> state dict, got a {got}")
        if not isinstance(self.triggers, Triggers):
            got = type(self.triggers).__name__
            raise ConfigurationError(f"triggers must be a certckpt.detect.Triggers(...), got a {got}")
        if self.fleet is not None and (not isinstance(self.fleet, str) or not self.fleet.strip()):
            raise ConfigurationError(f"fleet must be None or a fleet registry's path or URL, got {self.fleet!r}")
        for name, low, optional in (
            ("audit_every", 1, False),
            ("consensus_every", 1, True),
            ("replay_micro_batches", 1, True),
        ):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if type(value) is not int or value < low:
                raise ConfigurationError(
                    f"{name} must be {'None or ' if optional else ''}an int >= {low}, got {value!r}"
                )

    @classmethod
    def build(cls, options: AuditOptions | None = None, **shorthand: Any) -> AuditOptions:
        """``options`` (default: every default) with the keyword shorthand applied on top.

        Raises:
            ConfigurationError: a keyword that is not an option, or a value an option refuses.
        """
        if options is not None and not isinstance(options, AuditOptions):
            raise ConfigurationError(f"options must be an AuditOptions, got {type(options).__name__}")
        unknown = sorted(set(shorthand) - set(FIELDS))
        if unknown:
            raise ConfigurationError(
                f"unknown audit option(s) {', '.join(unknown)}; the options are: {', '.join(FIELDS)}"
            )
        return dataclasses.replace(options or cls(), **shorthand)


FIELDS = tuple(f.name for f in dataclasses.fields(AuditOptions))
# Which options each session reads; one set to anything but its default where it is not read is
# refused (``unused_problem``), never silently ignored.
DDP_ONLY = ("mode", "rtol", "exchange_flags", "hand_over_grads", "clip_grad_norm", "before_optimizer_step",
            "grad_scaler", "replay_micro_batches")  # fmt: skip
SHARDED_ONLY = ("audit_updates", "state_fn")


def session_options(
    options: AuditOptions | None, shorthand: dict[str, Any], *, unused: tuple[str, ...], where: str
) -> tuple[AuditOptions, str | None]:
    """A session's options and what is wrong with them (None: nothing), never raising: the session
    refuses on every rank together, so that no rank is left waiting in a collective."""
    try:
        opts = AuditOptions.build(options, **shorthand)
    except ConfigurationError as e:
        return AuditOptions(), str(e)
    return opts, unused_problem(opts, unused, where)


def unused_problem(options: AuditOptions, unused: tuple[str, ...], where: str) -> str | None:
    """The options set away from their defaults that ``where`` does not read (None: none)."""
    default = AuditOptions()
    given = [n for n in unused if getattr(options, n) != getattr(default, n)]
    return f"{where} does not take {', '.join(given)}" if given else None
