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

__all__ = ["AuditOptions", "Mode", "OnNonfinite", "OnFault", "ExchangeFlags", "NonfiniteRead"]


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


_CHOICES = {
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
        audit_every: K, the replay-audit interval in steps (a full audit: replay, non-finite
            summary and weight consensus).
        consensus_every: also compare the weights every N steps (None: at audits and checkpoints).
        mode: ``Mode``: ``"deterministic"`` (bit-exact fingerprints) or ``"tolerance"``.
        rtol: the relative tolerance in tolerance mode.
        on_nonfinite: ``OnNonfinite``: ``"raise"`` or ``"skip"``.
        on_fault: ``OnFault``: ``"raise"`` or ``"continue"``, for replay and consensus failures.
        exchange_flags: ``ExchangeFlags``: ``"on-failure"`` or ``"every-step"``.
        nonfinite_read: ``NonfiniteRead``: ``"immediate"`` or ``"deferred"`` (needs
            ``on_nonfinite="raise"``, no ``grad_scaler``, ``exchange_flags="on-failure"``).
        check_determinism: at the first step, refuse (every rank together) a set-up whose replay
            does not reproduce training.
        hand_over_grads: point ``.grad`` at DDP's reduced bucket instead of copying it (the loop
            must start each step with ``zero_grad(set_to_none=True)``).
        clip_grad_norm: clip the reduced gradients to this total 2-norm before the optimizer step.
        before_optimizer_step: ``fn(module, optimizer)`` after the checks and clipping, before the
            step: a gradient transform every rank applies alike.
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 autocast.
        replay_micro_batches: with micro-batches, replay at most this many of an audited step.
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

    def __post_init__(self) -> None:
        for name, kind in _CHOICES.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(repr(c.value) for c in kind)
                raise ConfigurationError(f"{name} must be one of {allowed}, got {value!r}") from None
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
