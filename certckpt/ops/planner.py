"""The policy planner: what an (audit every K, checkpoint every C, keep N) policy detects, loses and costs.

Choosing K, C and N is a trade between audit overhead, the work a detected fault throws away, the
storage a rollback needs and the faults that escape. This module answers for one combination, exactly,
under the detection and trust rules of ``docs/trust.md`` and ``docs/detection.md``; ``certckpt plan`` is
its front end. Everything here is pure arithmetic except :func:`read_policy` (the ``--from`` reader).

The model (steps are optimizer updates, numbered from 1; step 0 is the initial state):

Detection
    Full audits run at the multiples of K. A persistent finite fault that starts in a step of
    ``(a, a+K]`` (a the last passing audit) is caught by the replay audit at the next audit step
    ``d = a+K``. At most K updates are contaminated before detection (mean ``(K+1)/2`` when the
    start is uniform over steps); the suspect interval is ``(c, d]`` with ``c = a`` the last clean
    audit point, always K updates wide. A *one-time* finite fault on one of the ``K-1`` steps of
    every K that no audit replays escapes (``docs/detection.md``): fraction ``(K-1)/K``.

Rollback
    Checkpoints are written at the multiples of C; one is trusted once the first audit at or after
    it passes (it waits ``(-s) mod K`` steps, at most ``K - gcd(K, C)``). A detection at d rolls back
    to the newest checkpoint at or before c, ``x = C*floor(c/C)``, losing ``d - x = K + (c mod C)``
    steps. With ``c = m*K`` the residues ``(m*K) mod C`` run through every multiple of
    ``g = gcd(K, C)`` below C, so

    - worst rollback    ``K + C - g``
    - expected rollback ``K + mean((m*K) mod C for m in range(C // g)) = K + (C - g) / 2``
      (fault start uniform over steps: every audit interval equally likely).

    Aligned policies (``K % C == 0`` or ``C % K == 0``) have ``g = min(K, C)``; any other C adds
    ``C - g`` over the aligned worst case of its size and makes every checkpoint wait to be
    certified. In GPU-hours: ``steps * S * G / 3600`` (S seconds per step, G GPUs), reported only
    when S and G describe the job (given, not defaulted).

Retention
    Node storage keeps the newest N checkpoints (count-based, as training frameworks prune). When
    a fault is detected at d, the checkpoints written in ``[x, d)`` are on node storage and only
    ``x`` is known-good; training stops before it would save at d. Their count is
    ``ceil((d - x) / C)``, at worst ``n_min = ceil((K + C - g) / C)``; ``N >= n_min`` keeps a
    known-good checkpoint on node storage for every detection (``keeps_known_good``). The planner
    assumes the failing audit at d runs before the checkpoint of step d is written (as the
    auditor does); a writer that saves first needs one more.

Expected cost of one run (currency of P, the price of a GPU-hour), with ``H = STEPS*S*G/3600``
GPU-hours and ``E = R*H`` expected silent faults (R per GPU-hour):

- extra compute        ``X * H * P``                          (X: audit overhead, fraction of compute)
- false positives      ``(STEPS / K) * F * I``                (F per audit, I per investigation)
- rollback waste       ``E * expected_rollback * S*G/3600 * P``
- undetected defects   ``E * T * (K-1)/K * D``                (T: transient fraction, D per defect)

Rollback waste charges every expected fault a rollback, an upper bound: a transient fault that
escapes costs no rollback and one caught on its own audit step may be contained. Defaults
(:data:`DEFAULT_COSTS`) are round numbers for an 8-GPU job, not measurements; the CLI says which
values were defaulted.

Warnings are one line each; ``not-aligned``, ``keep-too-small`` and ``audit-beyond-run`` make the
combination indefensible (``certckpt plan`` exits 1), ``ckpt-sparse`` and ``ckpt-beyond-run`` are advice.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = [
    "CostInputs",
    "DEFAULT_COSTS",
    "INPUT_NAMES",
    "SPARSE_RATIO",
    "Input",
    "DetectionFacts",
    "RollbackFacts",
    "RetentionFacts",
    "PlanWarning",
    "CostBreakdown",
    "Plan",
    "FoundPolicy",
    "detection_facts",
    "rollback_facts",
    "retention_facts",
    "plan_warnings",
    "expected_cost",
    "plan",
    "plan_inputs",
    "POLICY_NAMES",
    "resolve_inputs",
    "policy_from_snapshot",
    "overhead_from_envelope",
    "read_policy",
]

SPARSE_RATIO = 4
"""``ckpt-sparse`` fires from ``C >= SPARSE_RATIO * K``: then at least 3/4 of the worst rollback comes
from the checkpoint spacing, so auditing more often buys almost no rollback."""


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a number > 0, got {value!r}")


def _check_nonnegative(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name} must be a number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostInputs:
    """What a run looks like and what things cost (defaults: :data:`DEFAULT_COSTS`).

    Attributes:
        step_time: S, seconds per optimizer step (wall clock, audits excluded).
        gpus: G, GPUs the job holds.
        gpu_hour_cost: P, price of one GPU-hour; every cost is in this currency.
        audit_overhead: X, the audits' extra compute as a fraction of training compute.
        false_positive_rate: F, probability that one audit fails without a fault.
        investigation_cost: I, cost of investigating one failed audit.
        defect_cost: D, cost of shipping a model damaged by an undetected fault.
        fault_rate: R, silent data corruptions per GPU-hour.
        transient_fraction: T, share of those that are one-time (the rest persist until caught).
        run_steps: STEPS, optimizer steps in one run.
    """

    step_time: float = 1.0
    gpus: int = 8
    gpu_hour_cost: float = 2.0
    audit_overhead: float = 0.05
    false_positive_rate: float = 1e-4
    investigation_cost: float = 500.0
    defect_cost: float = 100_000.0
    fault_rate: float = 1e-6
    transient_fraction: float = 0.5
    run_steps: int = 100_000

    def __post_init__(self) -> None:
        _check_positive("step_time", self.step_time)
        _check_int("gpus", self.gpus, 1)
        _check_int("run_steps", self.run_steps, 1)
        for name in ("gpu_hour_cost", "audit_overhead", "investigation_cost", "defect_cost", "fault_rate"):
            _check_nonnegative(name, getattr(self, name))
        for name in ("false_positive_rate", "transient_fraction"):
            value = getattr(self, name)
            _check_nonnegative(name, value)
            if value > 1:
                raise ConfigurationError(f"{name} is a probability: got {value}, expected 0..1")

    @property
    def gpu_hours(self) -> float:
        """H: GPU-hours of one run."""
        return self.run_steps * self.step_time * self.gpus / 3600


DEFAULT_COSTS = CostInputs()
POLICY_NAMES = ("audit_every", "ckpt_every", "keep")
INPUT_NAMES = POLICY_NAMES + tuple(f.name for f in fields(CostInputs))


def _check_policy(audit_every: int, ckpt_every: int, keep: int | None = None) -> None:
    _check_int("audit_every", audit_every, 1)
    _check_int("ckpt_every", ckpt_every, 1)
    if keep is not None:
        _check_int("keep", keep, 0)


# --- the facts ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DetectionFacts:
    """How long a fault runs before the audits catch it, and what escapes them.

    Attributes:
        max_contaminated_updates: K, updates a persistent fault reaches before detection, at most.
        mean_contaminated_updates: ``(K+1)/2``, the same with the fault start uniform over steps.
        suspect_interval_updates: ``d - c``, always K: the detection's rollback window.
        transient_escape_fraction: ``(K-1)/K``, share of steps where a one-time fault escapes.
    """

    max_contaminated_updates: int
    mean_contaminated_updates: float
    suspect_interval_updates: int
    transient_escape_fraction: float


def detection_facts(*, audit_every: int) -> DetectionFacts:
    """Detection facts of audits every ``audit_every`` steps (see the module docstring)."""
    _check_int("audit_every", audit_every, 1)
    k = audit_every
    return DetectionFacts(
        max_contaminated_updates=k,
        mean_contaminated_updates=(k + 1) / 2,
        suspect_interval_updates=k,
        transient_escape_fraction=(k - 1) / k,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RollbackFacts:
    """What a detected fault throws away: from the rollback target to the detection step.

    Attributes:
        worst_steps: ``K + C - gcd(K, C)``.
        expected_steps: ``K + (C - gcd(K, C)) / 2`` (fault start uniform over steps).
        worst_gpu_hours, expected_gpu_hours: the same times ``S*G/3600``; None when S and G
            were not given (a defaulted job size would be fiction here).
        gcd: ``gcd(K, C)``.
        aligned: ``K % C == 0 or C % K == 0``.
        max_certification_delay: ``K - gcd(K, C)``, steps a checkpoint waits at most for the
            audit that certifies it (0 when every checkpoint is on an audit step).
    """

    worst_steps: int
    expected_steps: float
    worst_gpu_hours: float | None
    expected_gpu_hours: float | None
    gcd: int
    aligned: bool
    max_certification_delay: int


def rollback_facts(
    *, audit_every: int, ckpt_every: int, step_time: float | None = None, gpus: int | None = None
) -> RollbackFacts:
    """Worst and expected rollback of audits every K and checkpoints every C (module docstring)."""
    _check_policy(audit_every, ckpt_every)
    k, c = audit_every, ckpt_every
    g = math.gcd(k, c)
    worst = k + c - g
    expected = k + (c - g) / 2
    per_step = None if step_time is None or gpus is None else step_time * gpus / 3600
    return RollbackFacts(
        worst_steps=worst,
        expected_steps=expected,
        worst_gpu_hours=None if per_step is None else worst * per_step,
        expected_gpu_hours=None if per_step is None else expected * per_step,
        gcd=g,
        aligned=k % c == 0 or c % k == 0,
        max_certification_delay=k - g,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RetentionFacts:
    """Whether keeping the newest N checkpoints always leaves a known-good one on node storage.

    Attributes:
        keep: N.
        needed: ``n_min = ceil(worst_rollback / C)``, checkpoints in ``[x, d)`` at worst: the
            rollback target x and those written after it, not yet known-good at detection.
        keeps_known_good: ``N >= n_min``.
        smallest_keep: the smallest N that does, ``n_min``.
    """

    keep: int
    needed: int
    keeps_known_good: bool
    smallest_keep: int


def retention_facts(*, audit_every: int, ckpt_every: int, keep: int) -> RetentionFacts:
    """Retention facts of keeping the newest ``keep`` checkpoints (module docstring)."""
    _check_policy(audit_every, ckpt_every, keep)
    worst = rollback_facts(audit_every=audit_every, ckpt_every=ckpt_every).worst_steps
    needed = -(-worst // ckpt_every)
    return RetentionFacts(keep=keep, needed=needed, keeps_known_good=keep >= needed, smallest_keep=needed)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanWarning:
    """One thing wrong with a combination.

    Attributes:
        code: stable identifier (``not-aligned``, ``keep-too-small``, ``audit-beyond-run``,
            ``ckpt-sparse``, ``ckpt-beyond-run``).
        message: one line for people.
        indefensible: True when the combination should not be run as it is (``certckpt plan`` exits 1).
    """

    code: str
    message: str
    indefensible: bool


def _aligned_alternatives(k: int, c: int) -> tuple[int, int]:
    """The largest divisor of K below C and the smallest multiple of K above C."""
    below = max(d for d in _divisors(k) if d < c)
    return below, -(-c // k) * k


def _divisors(n: int) -> list[int]:
    out = []
    i = 1
    while i * i <= n:
        if n % i == 0:
            out += [i, n // i]
        i += 1
    return out


def plan_warnings(*, audit_every: int, ckpt_every: int, keep: int, run_steps: int) -> list[PlanWarning]:
    """The warnings of one combination, in a fixed order (indefensible ones first)."""
    _check_policy(audit_every, ckpt_every, keep)
    _check_int("run_steps", run_steps, 1)
    k, c = audit_every, ckpt_every
    rb = rollback_facts(audit_every=k, ckpt_every=c)
    ret = retention_facts(audit_every=k, ckpt_every=c, keep=keep)
    out: list[PlanWarning] = []
    if not rb.aligned:
        below, above = _aligned_alternatives(k, c)
        out.append(
            PlanWarning(
                code="not-aligned",
                indefensible=True,
                message=(
                    f"checkpoints every {c} steps are not aligned with audits every {k} (neither divides the other): "
                    f"a checkpoint waits up to {rb.max_certification_delay} steps to be certified "
                    f"and the worst rollback grows by {c - rb.gcd} to {rb.worst_steps} steps; "
                    f"use --ckpt-every {below} or {above}"
                ),
            )
        )
    if not ret.keeps_known_good:
        out.append(
            PlanWarning(
                code="keep-too-small",
                indefensible=True,
                message=(
                    f"keeping {keep} checkpoint(s) is too few: "
                    "a detected fault can leave no known-good checkpoint on node storage "
                    f"(up to {ret.needed} are written from the rollback target on); keep at least {ret.needed}"
                ),
            )
        )
    if k > run_steps:
        out.append(
            PlanWarning(
                code="audit-beyond-run",
                indefensible=True,
                message=(
                    f"audits every {k} steps never run in a {run_steps}-step run: no checkpoint can ever be certified"
                ),
            )
        )
    if c >= SPARSE_RATIO * k:
        out.append(
            PlanWarning(
                code="ckpt-sparse",
                indefensible=False,
                message=(
                    f"checkpoints every {c} steps are {c / k:.3g}x sparser than audits: "
                    f"the rollback (worst {rb.worst_steps} steps) "
                    f"is dominated by the checkpoint spacing; checkpointing every {k} steps cuts it to {k}"
                ),
            )
        )
    if c > run_steps:
        out.append(
            PlanWarning(
                code="ckpt-beyond-run",
                indefensible=False,
                message=(
                    f"no checkpoint is written in a {run_steps}-step run (every {c} steps): "
                    "a detected fault restarts the run"
                ),
            )
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CostBreakdown:
    """Expected cost of one accepted, integrity-checked run, by cause (currency of P).

    Attributes:
        extra_compute: ``X*H*P``.
        false_positives: ``(STEPS/K)*F*I``.
        rollback_waste: ``E*expected_rollback*S*G/3600*P``.
        undetected_defects: ``E*T*(K-1)/K*D``.
        total: their sum.
        per_1000_steps: ``total / STEPS * 1000``.
        gpu_hours: H, GPU-hours of the run.
        expected_faults: ``E = R*H``.
    """

    extra_compute: float
    false_positives: float
    rollback_waste: float
    undetected_defects: float
    total: float
    per_1000_steps: float
    gpu_hours: float
    expected_faults: float

    @property
    def components(self) -> dict[str, float]:
        return {
            "extra_compute": self.extra_compute,
            "false_positives": self.false_positives,
            "rollback_waste": self.rollback_waste,
            "undetected_defects": self.undetected_defects,
        }


def expected_cost(*, audit_every: int, ckpt_every: int, costs: CostInputs = DEFAULT_COSTS) -> CostBreakdown:
    """The four expected cost components of one run (formulas in the module docstring)."""
    _check_policy(audit_every, ckpt_every)
    k = audit_every
    h = costs.gpu_hours
    faults = costs.fault_rate * h
    rollback = rollback_facts(audit_every=k, ckpt_every=ckpt_every).expected_steps
    parts = {
        "extra_compute": costs.audit_overhead * h * costs.gpu_hour_cost,
        "false_positives": costs.run_steps / k * costs.false_positive_rate * costs.investigation_cost,
        "rollback_waste": faults * rollback * costs.step_time * costs.gpus / 3600 * costs.gpu_hour_cost,
        "undetected_defects": faults * costs.transient_fraction * (k - 1) / k * costs.defect_cost,
    }
    total = sum(parts.values())
    return CostBreakdown(
        **parts, total=total, per_1000_steps=total / costs.run_steps * 1000, gpu_hours=h, expected_faults=faults
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything the planner says about one combination."""

    audit_every: int
    ckpt_every: int
    keep: int
    costs: CostInputs
    detection: DetectionFacts
    rollback: RollbackFacts
    retention: RetentionFacts
    warnings: tuple[PlanWarning, ...]
    cost: CostBreakdown

    @property
    def indefensible(self) -> bool:
        """True when any warning says the combination should not be run as it is."""
        return any(w.indefensible for w in self.warnings)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready report (without input sources: see :func:`resolve_inputs`)."""
        return {
            "policy": {"audit_every": self.audit_every, "ckpt_every": self.ckpt_every, "keep": self.keep},
            "detection": asdict(self.detection),
            "rollback": asdict(self.rollback),
            "retention": asdict(self.retention),
            "warnings": [w.message for w in self.warnings],
            "warning_codes": [w.code for w in self.warnings],
            "indefensible": self.indefensible,
            "cost": {
                "components": self.cost.components,
                "total": self.cost.total,
                "per_1000_steps": self.cost.per_1000_steps,
                "gpu_hours": self.cost.gpu_hours,
                "expected_faults": self.cost.expected_faults,
            },
        }


def plan(
    *, audit_every: int, ckpt_every: int, keep: int, costs: CostInputs = DEFAULT_COSTS, hardware_known: bool = True
) -> Plan:
    """Plan one combination.

    Args:
        audit_every: K, full-audit interval in steps.
        ckpt_every: C, checkpoint interval in steps.
        keep: N, checkpoints kept on node storage (newest first).
        costs: the job and the prices.
        hardware_known: whether ``costs.step_time`` and ``costs.gpus`` describe the real job; the
            rollback is given in GPU-hours only then (costs always use them).
    """
    _check_policy(audit_every, ckpt_every, keep)
    return Plan(
        audit_every=audit_every,
        ckpt_every=ckpt_every,
        keep=keep,
        costs=costs,
        detection=detection_facts(audit_every=audit_every),
        rollback=rollback_facts(
            audit_every=audit_every,
            ckpt_every=ckpt_every,
            step_time=costs.step_time if hardware_known else None,
            gpus=costs.gpus if hardware_known else None,
        ),
        retention=retention_facts(audit_every=audit_every, ckpt_every=ckpt_every, keep=keep),
        warnings=tuple(
            plan_warnings(audit_every=audit_every, ckpt_every=ckpt_every, keep=keep, run_steps=costs.run_steps)
        ),
        cost=expected_cost(audit_every=audit_every, ckpt_every=ckpt_every, costs=costs),
    )


# --- where each input came from ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Input:
    """One input value and where it came from.

    Attributes:
        value: the value used.
        source: ``"flag"`` (given on the command line), ``"from"`` (found by ``--from``) or
            ``"default"`` (:data:`DEFAULT_COSTS`).
        origin: for ``"from"``, the URL or file it was read from.
        note: for ``"from"``, how it was derived.
    """

    value: Any
    source: str
    origin: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": self.value, "source": self.source}
        if self.source == "from":
            d["origin"], d["note"] = self.origin, self.note
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class FoundPolicy:
    """What ``--from`` found in one source.

    Attributes:
        origin: the store URL or report path read.
        values: input name (:data:`INPUT_NAMES`) -> value.
        notes: input name -> how it was derived (one line).
        missing: input name -> why it could not be derived (one line), for the error message.
    """

    origin: str
    values: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)


def resolve_inputs(*, flags: Mapping[str, Any], found: Iterable[FoundPolicy] = ()) -> dict[str, Input]:
    """Merge explicit flags over what ``--from`` found over the defaults.

    Flags win (a person said so); then the sources in order, a later one overriding an earlier one;
    then :data:`DEFAULT_COSTS` for the cost inputs. K, C and N have no default: when neither a flag
    nor a source gives one, a ``ValueError`` says which is missing and why the sources could not
    tell.
    """
    unknown = set(flags) - set(INPUT_NAMES)
    if unknown:
        raise ConfigurationError(f"unknown planner input(s): {', '.join(sorted(unknown))}")
    found = list(found)
    out: dict[str, Input] = {}
    for name in INPUT_NAMES:
        if flags.get(name) is not None:
            out[name] = Input(value=flags[name], source="flag")
            continue
        src = next((f for f in reversed(found) if name in f.values), None)
        if src is not None:
            out[name] = Input(value=src.values[name], source="from", origin=src.origin, note=src.notes.get(name))
        elif name in POLICY_NAMES:
            option = "--" + {"audit_every": "audit-every", "ckpt_every": "ckpt-every", "keep": "keep"}[name]
            why = "; ".join(f"{f.origin}: {f.missing[name]}" for f in found if name in f.missing)
            raise ConfigurationError(
                f"{option} is needed: give it, or --from a run store that records it" + (f" ({why})" if why else "")
            )
        else:
            out[name] = Input(value=getattr(DEFAULT_COSTS, name), source="default")
    return out


def plan_inputs(inputs: Mapping[str, Input]) -> Plan:
    """Plan from resolved inputs; the rollback is in GPU-hours when S and G were not defaulted."""
    costs = replace(DEFAULT_COSTS, **{f.name: inputs[f.name].value for f in fields(CostInputs)})
    return plan(
        audit_every=inputs["audit_every"].value,
        ckpt_every=inputs["ckpt_every"].value,
        keep=inputs["keep"].value,
        costs=costs,
        hardware_known=inputs["step_time"].source != "default" and inputs["gpus"].source != "default",
    )


# --- reading a policy back from what a run left ------------------------------------------------------


def _most_common_gap(steps_by_branch: Mapping[str, Iterable[int]]) -> tuple[int | None, Counter]:
    """The most common gap between consecutive distinct steps of a branch (ties: the smaller gap)."""
    gaps: Counter = Counter()
    for steps in steps_by_branch.values():
        s = sorted(set(steps))
        gaps.update(b - a for a, b in zip(s, s[1:]))
    if not gaps:
        return None, gaps
    return min(gaps, key=lambda g: (-gaps[g], g)), gaps


def _describe(gaps: Counter) -> str:
    return "gaps: " + ", ".join(f"{g} seen {n}x" for g, n in sorted(gaps.items(), key=lambda t: (-t[1], t[0]))[:3])


def policy_from_snapshot(snapshot: Any, *, origin: str) -> FoundPolicy:
    """K, C and N as a run store's ledger records them (pure: give it ``Ledger(url).snapshot()``).

    K is the most common gap between the steps of passing ``replay`` events on one branch (the
    audit cadence the run actually had); C the most common gap between checkpoint steps of a
    branch; N the number of checkpoints the store still holds (``snapshot.available``), which is
    what its retention kept.
    """
    found = FoundPolicy(origin=origin)
    replays: dict[str, list[int]] = {}
    for e in snapshot.events:
        if e.get("kind") == "replay" and e.get("outcome") == "pass":
            replays.setdefault(e.get("branch", ""), []).append(int(e["step"]))
    k, gaps = _most_common_gap(replays)
    if k is not None:
        found.values["audit_every"] = k
        found.notes["audit_every"] = f"most common gap between passing replay audits ({_describe(gaps)})"
    else:
        found.missing["audit_every"] = (
            f"{sum(map(len, replays.values()))} passing replay audit(s), need two on one branch"
        )
    ckpts: dict[str, list[int]] = {}
    for c in snapshot.checkpoints:
        ckpts.setdefault(c.branch, []).append(int(c.step))
    c, gaps = _most_common_gap(ckpts)
    if c is not None:
        found.values["ckpt_every"] = c
        found.notes["ckpt_every"] = f"most common gap between checkpoints ({_describe(gaps)})"
    else:
        found.missing["ckpt_every"] = f"{len(snapshot.checkpoints)} committed checkpoint(s), need two on one branch"
    if snapshot.checkpoints:
        held = sum(1 for c in snapshot.checkpoints if snapshot.available(c.ckpt_id))
        found.values["keep"] = held
        found.notes["keep"] = f"checkpoints held now ({held} of {len(snapshot.checkpoints)} committed)"
    else:
        found.missing["keep"] = "no committed checkpoint"
    return found


def overhead_from_envelope(report: Any, *, origin: str) -> FoundPolicy:
    """X from an envelope report ``{"combinations": [{"premium": fraction, ...}, ...]}``: the largest
    premium measured, so the planner charges the worst measured overhead rather than the mean."""
    combos = report.get("combinations") if isinstance(report, dict) else None
    premiums = [
        c["premium"]
        for c in combos or ()
        if isinstance(c, dict)
        and isinstance(c.get("premium"), (int, float))
        and not isinstance(c.get("premium"), bool)
        and math.isfinite(c["premium"])
    ]
    if not premiums:
        raise ConfigurationError(
            f'{origin}: not an envelope report (expected {{"combinations": [{{"premium": number, ...}}]}})'
        )
    x = max(premiums)
    note = f"largest premium of {len(premiums)} measured combination(s)"
    if x < 0:  # every audited run timed faster than plain: measurement noise, not a negative cost
        x, note = 0.0, note + f" (measured {max(premiums):+.3f}, within noise; taken as 0)"
    return FoundPolicy(origin=origin, values={"audit_overhead": float(x)}, notes={"audit_overhead": note})


def read_policy(url: str) -> FoundPolicy:
    """``--from``: read a run store's ledger, or an envelope report (a JSON file). The only I/O here.

    Raises:
        CheckpointNotFoundError: no store there, or a directory without ledger records.
        StorageError: the store cannot be read.
        ValueError: a JSON file that is not an envelope report.
    """
    from certckpt.errors import CheckpointNotFoundError
    from certckpt.storage import resolve, storage_of

    target = resolve(url)
    is_file = os.path.isfile(target.local) if target.local is not None else url.endswith(".json")
    if is_file:
        storage, name = storage_of(url)
        data = storage.get(name)
        if data is None:
            raise CheckpointNotFoundError(f"{url}: no such file")
        try:
            report = json.loads(data)
        except ValueError as e:
            raise ConfigurationError(
                f"{url}: neither a run store nor a JSON envelope report ({e.__class__.__name__})"
            ) from e
        return overhead_from_envelope(report, origin=url)

    from certckpt.trust.ledger import Ledger

    snap = Ledger(url).snapshot()
    if not snap.checkpoints and not snap.events:
        raise CheckpointNotFoundError(f"{url}: no certckpt ledger here (no checkpoint or audit records)")
    return policy_from_snapshot(snap, origin=url)
