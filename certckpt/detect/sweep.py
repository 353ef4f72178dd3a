"""The magnitude sweep of ``certckpt drill faults --sweep`` (pure): its kinds, magnitudes and cases.

One case is one short training run of the drill's model on 3 gloo ranks (``sweep_run``) with one
one-time fault between two audits: on one rank, at one step, in the forward pass (the output layer's
activation, where a fault reaches the loss whole) or the backward pass (a local gradient before the
all-reduce), with or without the sentinels. The perturbations:

- ``scale``: the whole tensor (a gradient, an activation) multiplied by ``1 + eps``;
- ``bitflip-fp32`` / ``bitflip-bf16``: one bit of the largest-magnitude element flipped, the model
  training in float32 or in bfloat16 (mantissa, exponent and sign bits);
- ``set``: the largest-magnitude element set to a value;
- ``zero``: a zeroed bucket (backward: every local gradient of the DDP bucket; forward: the layer's
  whole output).

Clean runs (the same loop, no fault) give the false triggers. What became of each run, and the
table, are ``sweep_table``'s; the rank processes are ``sweep_run``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = [
    "PERTURBATIONS",
    "SITES",
    "KINDS",
    "Perturbation",
    "SweepCase",
    "select_kinds",
    "split_kind",
    "parse_magnitudes",
    "sweep_cases",
    "magnitude_label",
]

SITES = ("forward", "backward")


@dataclass(frozen=True, kw_only=True, slots=True)
class Perturbation:
    """One way the sweep perturbs a tensor, and the magnitudes it sweeps.

    Attributes:
        name: the name ``--kinds`` takes (with a site: ``backward-scale``).
        magnitudes: the default magnitudes, smallest effect first where there is an order.
        dtype: the dtype the model trains in for these cases.
        axis: what a magnitude is, in words (the table's and the picture's axis).
        log_axis: the magnitudes are spread over decades (the picture spaces them by category anyway).
    """

    name: str
    magnitudes: tuple[float, ...]
    dtype: str
    axis: str
    log_axis: bool

    def fault_fields(self, magnitude: float | None) -> dict[str, Any]:
        """The ``inject.Fault`` fields for one magnitude."""
        if self.name == "scale":
            assert magnitude is not None
            return {"factor": 1.0 + magnitude}
        if self.name.startswith("bitflip"):
            assert magnitude is not None
            return {"bit": int(magnitude)}
        if self.name == "set":
            return {"set_to": magnitude}
        return {"zero": True}


_EPS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1e3)
_VALUES = (1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e6, 1e10, 1e20, 1e30)

PERTURBATIONS: dict[str, Perturbation] = {
    p.name: p
    for p in (
        Perturbation(
            name="scale", magnitudes=_EPS, dtype="float32", axis="eps: the tensor times (1 + eps)", log_axis=True
        ),
        Perturbation(
            name="bitflip-fp32",
            magnitudes=tuple(float(b) for b in range(32)),
            dtype="float32",
            axis="bit flipped in the largest element (0-22 mantissa, 23-30 exponent, 31 sign)",
            log_axis=False,
        ),
        Perturbation(
            name="bitflip-bf16",
            magnitudes=tuple(float(b) for b in range(16)),
            dtype="bfloat16",
            axis="bit flipped in the largest element (0-6 mantissa, 7-14 exponent, 15 sign)",
            log_axis=False,
        ),
        Perturbation(
            name="set", magnitudes=_VALUES, dtype="float32", axis="the largest element set to this value", log_axis=True
        ),
        Perturbation(name="zero", magnitudes=(math.nan,), dtype="float32", axis="a zeroed bucket", log_axis=False),
    )
}
KINDS = tuple(f"{site}-{p}" for p in PERTURBATIONS for site in SITES)
"""Every kind ``--kinds`` takes: a site and a perturbation (``forward-scale``, ``backward-bitflip-bf16``...)."""


def split_kind(kind: str) -> tuple[str, Perturbation]:
    """``backward-bitflip-fp32`` -> ``("backward", PERTURBATIONS["bitflip-fp32"])``."""
    site, _, name = kind.partition("-")
    return site, PERTURBATIONS[name]


def select_kinds(spec: str | None) -> list[str]:
    """The kinds a ``--kinds`` value names, in ``KINDS`` order: comma-separated kinds, perturbations
    (``scale``: both sites) or sites (``backward``: every perturbation); None or ``all``: every kind.

    Example:
        >>> select_kinds("scale,backward-zero")
        ['forward-scale', 'backward-scale', 'backward-zero']

    Raises:
        ConfigurationError: a name that is none of these.
    """
    if spec is None or spec.strip() in ("", "all"):
        return list(KINDS)
    chosen: set[str] = set()
    for word in (w.strip() for w in spec.split(",")):
        if word in KINDS:
            chosen.add(word)
        elif word in PERTURBATIONS:
            chosen.update(f"{site}-{word}" for site in SITES)
        elif word in SITES:
            chosen.update(f"{word}-{p}" for p in PERTURBATIONS)
        else:
            raise ConfigurationError(
                f"--kinds: unknown kind {word!r}; choose kinds ({', '.join(KINDS)}), "
                f"perturbations ({', '.join(PERTURBATIONS)}) or sites ({', '.join(SITES)})"
            )
    return [k for k in KINDS if k in chosen]


def parse_magnitudes(spec: str | None, kinds: Sequence[str]) -> tuple[float, ...] | None:
    """``--magnitudes 1e-6,1e3``: the magnitudes to sweep instead of each kind's defaults (None: the
    defaults). Bit flips take bit indexes; a zeroed bucket has no magnitude and keeps its one case.

    Raises:
        ConfigurationError: not numbers, or a bit outside the dtype of a bit-flip kind.
    """
    if spec is None:
        return None
    try:
        values = tuple(float(v) for v in spec.split(","))
    except ValueError:
        raise ConfigurationError(f"--magnitudes: expected numbers separated by commas, got {spec!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise ConfigurationError(f"--magnitudes: expected finite numbers, got {spec!r}")
    for kind in kinds:
        _, p = split_kind(kind)
        if p.name.startswith("bitflip"):
            width = 16 if p.dtype == "bfloat16" else 32
            if any(v != int(v) or not 0 <= v < width for v in values):
                raise ConfigurationError(f"--magnitudes: {kind} takes bit indexes 0-{width - 1}, got {spec!r}")
    return values


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepCase:
    """One training run of the sweep (JSON to the ranks through ``to_dict``).

    Attributes:
        name: unique within the sweep.
        kind: ``site-perturbation``, or ``clean`` (no fault: the false-trigger runs).
        magnitude: the perturbation's magnitude (NaN for a zeroed bucket, None for a clean run).
        dtype: what the model trains in.
        sentinels: the sentinels on (``Triggers()``) or off (``Triggers(enabled=False)``).
        trial: the trial's index (it picks the data, the faulty rank and the step).
        rank: the faulty rank (None: clean).
        injected_step: the fault's step, strictly between two audits (None: clean).
        steps: the steps the run trains (a faulty one stops earlier at a detection).
        fault: the ``inject.Fault`` fields (None: clean).
    """

    name: str
    kind: str
    magnitude: float | None
    dtype: str
    sentinels: bool
    trial: int
    rank: int | None
    injected_step: int | None
    steps: int
    fault: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sweep_cases(
    *,
    kinds: Sequence[str],
    trials: int,
    ranks: int = 3,
    audit_every: int = 10,
    magnitudes: Sequence[float] | None = None,
    clean_steps: int = 100,
) -> list[SweepCase]:
    """Every case of a sweep: first one clean run per trial per dtype in use (sentinels on), then per
    kind, magnitude and trial a faulty run with the sentinels on and one with them off.

    A trial's faulty rank is ``trial % ranks`` and its step lies strictly between the audits at K and
    2K (the sentinels' histories are warm by then); every run trains up to step 2K, the audit after
    the fault, so that the scheduled replay had its chance too. Its data differ per trial.

    Example:
        >>> cs = sweep_cases(kinds=["backward-scale"], trials=2, magnitudes=[1e3])
        >>> [(c.kind, c.sentinels, c.rank, c.injected_step) for c in cs]
        [('clean', True, None, None), ('clean', True, None, None), ('backward-scale', True, 0, 11), \
('backward-scale', False, 0, 11), ('backward-scale', True, 1, 15), ('backward-scale', False, 1, 15)]

    Raises:
        ConfigurationError: fewer than 3 ranks (a replay names a rank only then), ``trials`` < 1,
            ``audit_every`` < 3, an unknown kind.
    """
    if ranks < 3:
        raise ConfigurationError(
            f"the sweep needs 3 ranks or more (a replay names a faulty rank only then), got {ranks}"
        )
    if trials < 1 or clean_steps < 1:
        raise ConfigurationError(f"trials and clean steps must be >= 1, got {trials} and {clean_steps}")
    if audit_every < 3:
        raise ConfigurationError(
            f"the sweep needs audit_every >= 3 (a step strictly between two audits), got {audit_every}"
        )
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ConfigurationError(f"unknown sweep kind(s) {unknown}; choose from {', '.join(KINDS)}")
    k = audit_every
    dtypes = sorted({split_kind(kind)[1].dtype for kind in kinds}, key=("float32", "bfloat16").index)
    cases = [
        SweepCase(
            name=f"clean-{dtype}-t{t}",
            kind="clean",
            magnitude=None,
            dtype=dtype,
            sentinels=True,
            trial=t,
            rank=None,
            injected_step=None,
            steps=clean_steps,
            fault=None,
        )
        for dtype in dtypes
        for t in range(trials)
    ]
    for kind in kinds:
        site, p = split_kind(kind)
        for m in magnitudes if magnitudes is not None and p.name != "zero" else p.magnitudes:
            for t in range(trials):
                rank, step = t % ranks, k + 1 + (4 * t) % (k - 1)
                # a forward fault's target, the model's output layer, is the runner's to name
                fault = {"kind": site, "rank": rank, "step": step, **p.fault_fields(m)}
                for on in (True, False):
                    cases.append(
                        SweepCase(
                            name=f"{kind}-{magnitude_label(kind, m)}-{'on' if on else 'off'}-t{t}",
                            kind=kind,
                            magnitude=m,
                            dtype=p.dtype,
                            sentinels=on,
                            trial=t,
                            rank=rank,
                            injected_step=step,
                            steps=2 * k,
                            fault=fault,
                        )
                    )
    return cases


def magnitude_label(kind: str, magnitude: float | None) -> str:
    """A magnitude as the table shows it: ``1e-06``, ``bit 30``, ``bucket``.

    Example:
        >>> magnitude_label("forward-scale", 0.3), magnitude_label("backward-bitflip-fp32", 30.0)
        ('0.3', 'bit30')
    """
    if magnitude is None or kind == "clean":
        return "-"
    name = split_kind(kind)[1].name
    if name == "zero":
        return "bucket" if kind.startswith("backward") else "output"
    if name.startswith("bitflip"):
        return f"bit{int(magnitude)}"
    return f"{magnitude:g}"
