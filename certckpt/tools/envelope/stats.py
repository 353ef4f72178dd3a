"""The envelope's arithmetic: figures from measured times, their noise, the gate, and argument parsing (pure)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = [
    "TRIM",
    "describe",
    "exit_code",
    "figures",
    "over_budget",
    "parse_int_list",
    "premium_se",
    "se_text",
    "shape_figures",
    "step_samples",
    "trimmed_mean",
]

TRIM = 0.1
"""Each figure is the mean of its trials after dropping this fraction at each end (see :func:`trimmed_mean`)."""


def figures(
    *, plain_s: float, nonaudit_s: float, audit_s: float, consensus_s: float, fb_s: float, audit_every: int
) -> dict[str, Any]:
    """The reported figures of one combination from its measured mean times (see the package docstring).

    Args:
        plain_s: P, mean plain DDP step.
        nonaudit_s: N, mean audited step that is not an audit step.
        audit_s: A, mean audit step. Unlike the others it is not timed on its own but estimated by a
            difference (``nonaudit/K`` / m + ``cycle/K - nonaudit/K``), so under noise it can come out
            below zero: it must be finite, not >= 0, and the premium then says "within noise".
        consensus_s: C, mean weight consensus alone.
        fb_s: F, mean forward + backward alone.
        audit_every: K.

    Returns:
        ``{"plain_s", "audited_s", "premium", "premium_parts": {replay, consensus, nonfinite},
        "shares": {replay, consensus, nonfinite} (None when premium <= 0; the sweep also drops them
        when the premium is within two standard errors of zero), "replay_floor"}``.

    Raises:
        ConfigurationError: K is not an integer >= 1, a time is not finite, a timed mean (all but A) is
            below 0, or P is 0.
    """
    if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1:
        raise ConfigurationError(f"audit_every must be an integer >= 1, got {audit_every!r}")
    times = (
        ("plain_s", plain_s),
        ("nonaudit_s", nonaudit_s),
        ("audit_s", audit_s),
        ("consensus_s", consensus_s),
        ("fb_s", fb_s),
    )
    for name, v in times:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigurationError(f"{name} must be a finite time, got {v!r}")
        # A is a difference of two timed blocks (see the docstring): on a busy machine a few trials of a
        # millisecond step can put it below zero, which is noise to report, not a bad input
        if v < 0 and name != "audit_s":
            raise ConfigurationError(f"{name} must be a finite time >= 0, got {v!r}")
    if plain_s <= 0:
        raise ConfigurationError(f"plain_s must be > 0, got {plain_s!r}")
    k = audit_every
    audited = nonaudit_s + (audit_s - nonaudit_s) / k
    premium = (audited - plain_s) / plain_s
    parts = {
        "replay": (audit_s - nonaudit_s - consensus_s) / k / plain_s,
        "consensus": consensus_s / k / plain_s,
        "nonfinite": (nonaudit_s - plain_s) / plain_s,
    }
    shares = {n: v / premium for n, v in parts.items()} if premium > 0 else None
    return {
        "plain_s": plain_s,
        "audited_s": audited,
        "premium": premium,
        "premium_parts": parts,
        "shares": shares,
        "replay_floor": fb_s / plain_s / k,
    }


def trimmed_mean(xs: Sequence[float], trim: float = TRIM) -> float:
    """The mean of ``xs`` without its ``floor(trim * n)`` smallest and largest values.

    Other jobs on a shared machine put rare, huge outliers into single trials (a 45 ms step timed
    at 450 ms); dropping a tenth at each end keeps them from deciding a premium. With fewer than
    ``1 / trim`` values nothing is dropped: the plain mean.

    Raises:
        ConfigurationError: ``xs`` is empty or ``trim`` is outside [0, 0.5).
    """
    if not xs:
        raise ConfigurationError("trimmed_mean of no values")
    if not 0 <= trim < 0.5:
        raise ConfigurationError(f"trim must be in [0, 0.5), got {trim!r}")
    v = sorted(xs)
    cut = math.floor(trim * len(v) + 1e-9)
    return statistics.fmean(v[cut : len(v) - cut] if cut else v)


def premium_se(
    *, plain: Sequence[float], nonaudit: Sequence[float], audit: Sequence[float], audit_every: int
) -> float | None:
    """Standard error of the premium from per-trial samples, paired by trial (index i of each list
    was measured in trial i, under the same machine load).

    Per trial ``D_i = (1 - 1/K) N_i + A_i / K - P_i`` (audited minus plain); the premium is
    ``mean(D) / mean(P)`` and its standard error ``stdev(D) / sqrt(n) / mean(P)`` (the uncertainty
    of the denominator is second order). None with fewer than two trials.
    """
    n = len(plain)
    if n < 2 or len(nonaudit) != n or len(audit) != n:
        return None
    k = audit_every
    d = [(1 - 1 / k) * x + a / k - p for p, x, a in zip(plain, nonaudit, audit, strict=True)]
    return statistics.stdev(d) / math.sqrt(n) / statistics.fmean(plain)


def step_samples(raw: Mapping[str, list[float]], *, audit_every: Sequence[int], block: int) -> dict[str, list[float]]:
    """Per-trial step times from one shape's raw block timings.

    ``plain``, ``fb`` and ``consensus/K`` arrive per step already. Per trial, the non-audit step is
    the ``nonaudit/K`` block over m and the audit step that plus ``cycle/K - nonaudit/K``: both
    blocks are m steps long, so that the barriers' share is the same in every figure.

    Args:
        raw: the kept trials' timings by measurement name.
        audit_every: the Ks measured.
        block: m, the steps per block.

    Returns:
        ``plain``, ``fb``, and per K ``nonaudit/K``, ``audit/K``, ``consensus/K``: one value per trial.
    """
    samples: dict[str, list[float]] = {"plain": raw["plain"], "fb": raw["fb"]}
    for k in audit_every:
        na, cy = raw[f"nonaudit/{k}"], raw[f"cycle/{k}"]
        samples[f"nonaudit/{k}"] = [x / block for x in na]
        samples[f"audit/{k}"] = [x / block + (c - x) for x, c in zip(na, cy, strict=True)]
        samples[f"consensus/{k}"] = raw[f"consensus/{k}"]
    return samples


def shape_figures(
    samples: Mapping[str, list[float]],
    *,
    mean: Mapping[str, float],
    seq_len: int,
    micro_batch: int,
    audit_every: Sequence[int],
) -> list[dict[str, Any]]:
    """One combination per K of a shape: its :func:`figures` from the means, plus ``premium_se``.

    Shares are dropped when the premium is within two standard errors of zero: a premium within
    noise has no meaningful split (shares would exceed 100%).

    Args:
        samples: per-trial step times, as :func:`step_samples` gives them.
        mean: the trimmed mean of each entry of ``samples``.
        seq_len: L, named in each combination.
        micro_batch: B, named in each combination.
        audit_every: the Ks measured.
    """
    combos = []
    for k in audit_every:
        f = figures(
            plain_s=mean["plain"],
            nonaudit_s=mean[f"nonaudit/{k}"],
            audit_s=mean[f"audit/{k}"],
            consensus_s=mean[f"consensus/{k}"],
            fb_s=mean["fb"],
            audit_every=k,
        )
        f["premium_se"] = premium_se(
            plain=samples["plain"], nonaudit=samples[f"nonaudit/{k}"], audit=samples[f"audit/{k}"], audit_every=k
        )
        if f["premium_se"] is not None and f["premium"] <= 2 * f["premium_se"]:
            f["shares"] = None
        combos.append({"seq_len": seq_len, "micro_batch": micro_batch, "audit_every": k, **f})
    return combos


def over_budget(combinations: Iterable[Mapping[str, Any]], max_premium: float) -> list[dict[str, Any]]:
    """The combinations whose premium exceeds ``max_premium`` (strictly), named by their shape and K."""
    return [
        {
            "seq_len": c["seq_len"],
            "micro_batch": c["micro_batch"],
            "audit_every": c["audit_every"],
            "premium": c["premium"],
        }
        for c in combinations
        if c["premium"] > max_premium
    ]


def exit_code(report: Mapping[str, Any]) -> int:
    """The gate: 1 when any combination is over budget, else 0."""
    return 1 if report["over_budget"] else 0


def describe(c: Mapping[str, Any]) -> str:
    """``seq 128 x mb 4, K 10`` for one combination."""
    return f"seq {c['seq_len']} x mb {c['micro_batch']}, K {c['audit_every']}"


def se_text(v: float | None) -> str:
    """`` ±1.2`` for a standard error of 0.012 (in percentage points), nothing for None."""
    return "" if v is None else f" ±{v * 100:.1f}"


def parse_int_list(text: str, name: str, *, low: int = 1) -> tuple[int, ...]:
    """``"128,512"`` -> ``(128, 512)``: distinct integers >= ``low``, in the order given.

    Raises:
        ConfigurationError: not a comma-separated list of integers, a value below ``low``, or a repeat.
    """
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(t == "" for t in items):
        raise ConfigurationError(f"{name}: expected a comma-separated list of integers, got {text!r}")
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise ConfigurationError(f"{name}: expected a comma-separated list of integers, got {text!r}") from None
    bad = [v for v in values if v < low]
    if bad:
        raise ConfigurationError(f"{name}: every value must be >= {low}, got {bad[0]}")
    if len(set(values)) != len(values):
        raise ConfigurationError(f"{name}: a value is repeated in {text!r}")
    return tuple(values)
