"""The magnitude sweep's table (pure): what became of each run, the catch rate per kind and magnitude.

A faulty run is **caught** when a check stopped the fault at its own step, before its update, and
named the faulty rank (``CAUGHT_MEANS``): the ring replay (triggered by the sentinels, or a
scheduled audit) or the non-finite check. Any other detection is ``late``; none is an escape. The
clean runs give the false triggers: triggered replays that found nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from certckpt.errors import ConfigurationError

from .sweep import PERTURBATIONS, magnitude_label, split_kind

CAUGHT_MEANS = (
    "caught = stopped at its own step, before its update, with the faulty rank named: by the ring replay "
    "(triggered by the sentinels, or a scheduled audit) or by the non-finite check (a value that became "
    "NaN/Inf); a detection at a later step or naming another rank is not a catch"
)

__all__ = [
    "CAUGHT_MEANS",
    "Outcome",
    "Cell",
    "outcome",
    "tally",
    "effect_ratio",
    "clean_summary",
    "thresholds",
    "table_rows",
    "TABLE_HEAD",
    "report",
]


class Outcome(str, enum.Enum):
    """What became of one faulty run (see the module docstring for what counts as a catch)."""

    CAUGHT_REPLAY = "caught-replay"
    CAUGHT_NONFINITE = "caught-nonfinite"
    LATE = "late"
    ESCAPED = "escaped"
    NOT_FIRED = "not-fired"

    @property
    def caught(self) -> bool:
        return self in (Outcome.CAUGHT_REPLAY, Outcome.CAUGHT_NONFINITE)


def outcome(result: Mapping[str, Any]) -> Outcome:
    """The outcome of a faulty run from its result (``sweep_run``: the case's fields, ``fired`` from
    the faulty rank, ``detected`` as every rank raised it or None)."""
    if not result.get("fired"):
        return Outcome.NOT_FIRED
    det = result.get("detected")
    if det is None:
        return Outcome.ESCAPED
    at_its_step = det["step"] == result["injected_step"] and list(det["suspects"]) == [result["rank"]]
    if at_its_step and det["kind"] == "replay":
        return Outcome.CAUGHT_REPLAY
    if at_its_step and str(det["kind"]).startswith("nonfinite"):
        return Outcome.CAUGHT_NONFINITE
    return Outcome.LATE


@dataclass(kw_only=True, slots=True)
class Cell:
    """Counts of one (kind, magnitude, sentinels on or off) over its trials."""

    runs: int = 0
    caught_replay: int = 0
    caught_nonfinite: int = 0
    late: int = 0
    escaped: int = 0
    triggered: int = 0  # caught by a replay the sentinels asked for (the rest by a scheduled one)

    @property
    def caught(self) -> int:
        return self.caught_replay + self.caught_nonfinite

    @property
    def rate(self) -> float | None:
        return self.caught / self.runs if self.runs else None

    def add(self, o: Outcome, *, triggered: bool) -> None:
        self.runs += 1
        if o is Outcome.CAUGHT_REPLAY:
            self.caught_replay += 1
            self.triggered += triggered
        elif o is Outcome.CAUGHT_NONFINITE:
            self.caught_nonfinite += 1
        elif o is Outcome.LATE:
            self.late += 1
        else:
            self.escaped += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "caught": self.caught,
            "rate": self.rate,
            "caught_replay": self.caught_replay,
            "triggered": self.triggered,
            "caught_nonfinite": self.caught_nonfinite,
            "late": self.late,
            "escaped": self.escaped,
        }


def tally(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The table: one row per (kind, magnitude) in the order the cases ran, with a ``Cell`` (as a
    dict) for the runs with the sentinels on (``"on"``) and off (``"off"``), and ``effect``: the
    smallest and largest factor by which the fault changed the element it hit, over the row's runs.

    Raises:
        ConfigurationError: a faulty run whose fault never fired (the sweep measured nothing there).
    """
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    cells: dict[tuple[str, str], dict[str, Cell]] = {}
    effects: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if r["kind"] == "clean":
            continue
        o = outcome(r)
        if o is Outcome.NOT_FIRED:
            raise ConfigurationError(f"sweep case {r['name']}: its fault never fired; nothing was measured")
        label = magnitude_label(r["kind"], r["magnitude"])
        key = (r["kind"], label)
        if key not in rows:
            site, p = split_kind(r["kind"])
            rows[key] = {
                "kind": r["kind"],
                "site": site,
                "perturbation": p.name,
                "dtype": p.dtype,
                "magnitude": None if r["magnitude"] is None or math.isnan(r["magnitude"]) else r["magnitude"],
                "label": label,
            }
            cells[key] = {"on": Cell(), "off": Cell()}
        det = r.get("detected") or {}
        cells[key]["on" if r["sentinels"] else "off"].add(o, triggered=bool(det.get("triggered")))
        ratio = effect_ratio(r.get("effect"))
        if ratio is not None:
            effects.setdefault(key, []).append(ratio)
    return [
        {
            **row,
            "effect": _span(effects.get(key, [])),
            "on": cells[key]["on"].to_dict(),
            "off": cells[key]["off"].to_dict(),
        }
        for key, row in rows.items()
    ]


def effect_ratio(effect: Sequence[float | str] | None) -> float | None:
    """The perturbed element's ``after / before`` (``inject.Injector.effects``; non-finite values
    travel as strings): how much the fault changed the element it hit (None: unknown, or it was 0).

    Example:
        >>> effect_ratio([0.5, 8.0]), effect_ratio([0.5, "inf"]), effect_ratio(None)
        (16.0, inf, None)
    """
    if effect is None:
        return None
    before, after = (float(v) for v in effect)
    if before == 0 or math.isnan(before):
        return None
    return after / before


def _span(ratios: Sequence[float]) -> dict[str, Any] | None:
    """The smallest and largest ratio over a row's runs (an infinite one as a string, JSON-safe),
    and how many were NaN (a flipped exponent that made the element NaN)."""
    if not ratios:
        return None
    known = sorted(r for r in ratios if not math.isnan(r))
    ends = {"min": known[0], "max": known[-1]} if known else {"min": None, "max": None}
    out: dict[str, Any] = {k: v if v is None or math.isfinite(v) else str(v) for k, v in ends.items()}
    out["nan"] = len(ratios) - len(known)
    return out


def clean_summary(results: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dtype, the clean runs: runs, steps, triggered replays (each one passed, or it would be a
    detection), detections (false ones: every clean run must have none) and triggers per 1,000 steps."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["kind"] != "clean":
            continue
        s = out.setdefault(r["dtype"], {"runs": 0, "steps": 0, "triggered": 0, "suppressed": 0, "detections": 0})
        s["runs"] += 1
        s["steps"] += r["steps_run"]
        s["triggered"] += r["triggered_replays"]
        s["suppressed"] += r["suppressed"]
        s["detections"] += r["detected"] is not None
    for s in out.values():
        s["per_1000_steps"] = 1000 * s["triggered"] / s["steps"] if s["steps"] else None
    return out


def thresholds(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For each kind with ordered magnitudes (``scale``, ``set``), with the sentinels on: the largest
    magnitude with no catch at all, and the smallest from which every run at that magnitude and above
    was caught (None where there is none): where the sentinels stop seeing a one-time fault."""
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = sorted(
            (r for r in rows if r["kind"] == kind and r["magnitude"] is not None), key=lambda r: r["magnitude"]
        )
        if not mine or not PERTURBATIONS[mine[0]["perturbation"]].log_axis:
            continue
        never = [r["magnitude"] for r in mine if r["on"]["caught"] == 0]
        always = None
        for r in reversed(mine):
            if r["on"]["caught"] != r["on"]["runs"]:
                break
            always = r["magnitude"]
        out.append({"kind": kind, "largest_never_caught": max(never) if never else None, "always_caught_from": always})
    return out


def _how(cell: Mapping[str, Any]) -> str:
    parts = []
    if cell["triggered"]:
        parts.append(f"{cell['triggered']} triggered")
    if cell["caught_replay"] - cell["triggered"]:
        parts.append(f"{cell['caught_replay'] - cell['triggered']} audit")
    if cell["caught_nonfinite"]:
        parts.append(f"{cell['caught_nonfinite']} non-finite")
    return ", ".join(parts) or "-"


TABLE_HEAD = (
    "kind",
    "magnitude",
    "element x",
    "sentinels on",
    "caught by",
    "sentinels off",
    "caught by",
    "late on/off",
)


def _factor(span: Mapping[str, Any] | None) -> str:
    if span is None:
        return "-"
    text = ""
    if span["min"] is not None:
        lo, hi = (f"{float(span[k]):.2g}" for k in ("min", "max"))
        text = lo if lo == hi else f"{lo}..{hi}"
    if span.get("nan"):
        text += f"{', ' if text else ''}NaN x{span['nan']}"
    return text


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """The table as text cells (``TABLE_HEAD``): per row, the factor the element hit was changed by
    (smallest..largest over the runs), caught/runs and the rate with the sentinels on and off, what
    caught them (``triggered`` replays, scheduled ``audit`` replays, ``non-finite`` checks), and the
    detections that came late (not catches).

    Example:
        >>> cell = {"runs": 2, "caught": 2, "rate": 1.0, "caught_replay": 2, "triggered": 2, "caught_nonfinite": 0, \
"late": 0, "escaped": 0}
        >>> off = {**cell, "caught": 0, "rate": 0.0, "caught_replay": 0, "triggered": 0, "escaped": 2}
        >>> row = {"kind": "backward-scale", "label": "1000", "effect": {"min": 1001.0, "max": 1001.0}}
        >>> table_rows([{**row, "on": cell, "off": off}])
        [('backward-scale', '1000', '1e+03', '2/2 100%', '2 triggered', '0/2 0%', '-', '0/0')]
    """

    def rate(c: Mapping[str, Any]) -> str:
        return f"{c['caught']}/{c['runs']} {100 * c['rate']:.0f}%" if c["runs"] else "-"

    return [
        (
            r["kind"],
            r["label"],
            _factor(r.get("effect")),
            rate(r["on"]),
            _how(r["on"]),
            rate(r["off"]),
            _how(r["off"]),
            f"{r['on']['late']}/{r['off']['late']}",
        )
        for r in rows
    ]


def report(result: Mapping[str, Any], *, trials: int, kinds: Sequence[str]) -> dict[str, Any]:
    """The sweep's document (``--json``; what the picture is drawn from) from ``sweep_run.run_sweep``'s
    result: the table, the thresholds, the clean runs, what "caught" means, and every run."""
    rows = tally(result["cases"])
    return {
        **{k: v for k, v in result.items() if k != "cases"},
        "trials": trials,
        "kinds": list(kinds),
        "caught_means": CAUGHT_MEANS,
        "table": rows,
        "thresholds": thresholds(rows),
        "clean": clean_summary(result["cases"]),
        "cases": result["cases"],
    }
