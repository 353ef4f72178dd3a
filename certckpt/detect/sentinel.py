"""Sentinels: the pure decision whether a step looks wrong enough to replay it now.

Every step, each rank reduces its *local* gradient (before the all-reduce) to a few scalars: the
global norm, the norms of a few groups of DDP buckets and, where the session has it, the loss. The
ranks exchange them in one small collective (``trigger.SentinelCheck``), so every rank holds the
same table ``rows[rank][scalar]``, and this module decides from that table alone, with the same
arithmetic on every rank: the same table and the same ``SentinelState`` give the same ``Decision``
everywhere, which is what keeps the ranks entering the replay's collectives together.

Two tests, on the natural logarithm of each scalar (a norm multiplied by k moves by ln k, whatever
its size):

- **peers** (3 ranks or more): the rank's value against the median of every rank's at this step,
  in units of the median absolute deviation (``1.4826 * MAD``, the normal-consistent scale, never
  below ``Triggers.floor``); an outlier scores above ``mad_threshold``. Two ranks have no median
  that can outvote one of them, so this test is skipped there;
- **history**: the rank's value against its own exponentially weighted mean and standard deviation
  (``ewma_alpha``; never below ``floor``), once it has seen ``warmup_steps`` values; an outlier
  scores above ``band``. The history only takes in values inside its band (one outside is clipped to
  the band's edge first, from the second value on), so a fault does not widen the band that should
  catch the next one, and a lasting change of regime is still absorbed over a few tens of steps.

A rank is flagged when one of its scalars is an outlier on both tests (3 ranks or more; before its
history is warm, on the peer test alone), or on the history test (1 or 2 ranks). A flagged step is
replayed, unless the step is replayed anyway (an audit step) or the last triggered replay was fewer
than ``min_interval`` steps ago (counted as ``suppressed``). A non-finite scalar (a norm that
overflowed float32: an element near 1e19 or larger) is an outlier on every test.

A sentinel only chooses which steps to replay; the replay decides whether anything was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from certckpt.errors import ConfigurationError

__all__ = [
    "Triggers",
    "Track",
    "SentinelState",
    "Outlier",
    "Decision",
    "decide",
    "scores",
    "to_log",
    "scalars_of",
    "MAD_SCALE",
]

MAD_SCALE = 1.4826
"""``1.4826 * MAD`` estimates the standard deviation of normally distributed values."""
_TINY = 1e-30  # the log of a zero norm (a bucket without gradient) is ln(1e-30), not -inf


@dataclass(frozen=True, kw_only=True, slots=True)
class Triggers:
    """When a step's sentinels make the ring replay run at that step (``AuditOptions(triggers=...)``).

    The defaults were set against clean runs (``docs/detection.md``, "Triggered replays"): a flag
    needs a scalar about 2.7x (ln 1.0) or more away from both its peers and its own recent values,
    far beyond the noise of local gradient norms, while a gradient scaled by 1e3 moves by ln 1000 =
    6.9 and an element set to 1e30 overflows the norm.

    Attributes:
        enabled: compute and exchange the sentinels every step and replay the steps they flag.
        mad_threshold: the peer test's threshold, in robust standard deviations from the median.
        ewma_alpha: the weight of the newest value in the history's moving mean and variance.
        band: the history test's threshold, in the history's standard deviations.
        floor: the smallest spread either test assumes, in natural-log units (0.125: 13 %): without
            it, ranks or steps that happen to agree closely would make a small change an outlier.
        warmup_steps: values a rank's history must have seen before its test counts.
        min_interval: at most one triggered replay every this many steps (the rate limit: a
            noisy run pays at most one extra replay per ``min_interval`` steps).
        max_groups: the bucket norms are summed into at most this many groups of consecutive
            buckets, which bounds what each rank sends per step (``3 + max_groups`` floats with
            the loss and the two non-finite flags).
    """

    enabled: bool = True
    mad_threshold: float = 8.0
    ewma_alpha: float = 0.1
    band: float = 8.0
    floor: float = 0.125
    warmup_steps: int = 8
    min_interval: int = 10
    max_groups: int = 8

    def __post_init__(self) -> None:
        if type(self.enabled) is not bool:
            raise ConfigurationError(f"Triggers.enabled must be True or False, got {self.enabled!r}")
        for name in ("mad_threshold", "band", "floor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ConfigurationError(f"Triggers.{name} must be a positive number, got {value!r}")
        alpha = self.ewma_alpha
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha <= 1:
            raise ConfigurationError(f"Triggers.ewma_alpha must be in (0, 1], got {alpha!r}")
        for name, low in (("warmup_steps", 1), ("min_interval", 1), ("max_groups", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise ConfigurationError(f"Triggers.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Track:
    """One rank's history of one scalar (log units): moving mean, moving variance, values taken."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SentinelState:
    """What the decision remembers between steps (the same on every rank).

    Attributes:
        names: the scalars' names the tracks follow (a new layout starts the histories again).
        tracks: ``tracks[rank][scalar]``.
        last_replay: the step of the last triggered replay (the rate limit counts from it).
        suppressed: flagged steps the rate limit held back since the last triggered replay.
    """

    names: tuple[str, ...] = ()
    tracks: tuple[tuple[Track, ...], ...] = ()
    last_replay: int | None = None
    suppressed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Outlier:
    """One rank's scalar that failed a test: its log value and the scores (None: test not run)."""

    rank: int
    scalar: str
    value: float
    peer_score: float | None
    history_score: float | None

    def to_dict(self) -> dict[str, object]:
        def num(x: float | None) -> float | str | None:
            return None if x is None else round(x, 3) if math.isfinite(x) else str(x)

        return {
            "rank": self.rank,
            "scalar": self.scalar,
            "log_value": num(self.value),
            "peer_score": num(self.peer_score),
            "history_score": num(self.history_score),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The sentinels' verdict at one step.

    Attributes:
        replay: replay this step now (flagged, not an audit step, outside the rate limit).
        flagged: the ranks flagged (the replay, not this list, names a faulty rank).
        outliers: the scalars that flagged them.
        suppressed: flagged, but the rate limit held the replay back.
        suppressed_before: flagged steps held back since the previous triggered replay.
    """

    replay: bool
    flagged: tuple[int, ...] = ()
    outliers: tuple[Outlier, ...] = field(default_factory=tuple)
    suppressed: bool = False
    suppressed_before: int = 0


def to_log(value: float) -> float:
    """The test's scale: ``ln |value|`` (a zero as 1e-30; inf and NaN stay non-finite)."""
    if not math.isfinite(value):
        return math.inf if not math.isnan(value) else math.nan
    return math.log(max(abs(value), _TINY))


def scalars_of(table: Sequence[Sequence[float]], names: Sequence[str], *, skip: int) -> list[list[float]]:
    """The scalars ``decide`` reads from an exchanged table (pure).

    Each row starts with ``skip`` values that are not scalars (the non-finite flags); then one value
    per name. A norm (a name ending in ``_norm``) travels as its square, a sum of squares: its square
    root is taken here (a NaN or negative value stays as it is, an outlier); others (the loss) as
    they are.
    """
    squares = [name.endswith("_norm") for name in names]
    out = []
    for row in table:
        values = row[skip : skip + len(names)]
        out.append([math.sqrt(v) if sq and v >= 0 else v for sq, v in zip(squares, values)])
    return out


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _peer_scores(column: Sequence[float], floor: float) -> list[float]:
    """Per rank, ``|x - median| / max(1.4826 * MAD, floor)`` over the finite values (non-finite: inf)."""
    finite = [x for x in column if math.isfinite(x)]
    if not finite:
        return [math.inf] * len(column)
    med = _median(finite)
    scale = max(MAD_SCALE * _median([abs(x - med) for x in finite]), floor)
    return [abs(x - med) / scale if math.isfinite(x) else math.inf for x in column]


def _history_score(track: Track, x: float, triggers: Triggers) -> float | None:
    """How far ``x`` is from the track, in its standard deviations (None: still warming up)."""
    if track.count < triggers.warmup_steps:
        return None
    if not math.isfinite(x):
        return math.inf
    return abs(x - track.mean) / max(math.sqrt(track.var), triggers.floor)


def _absorb(track: Track, x: float, triggers: Triggers) -> Track:
    """The track after value ``x``, clipped to the band first; a non-finite value is skipped.

    Clipped from the second value on, warm-up included: a fault during the warm-up, taken in
    whole, would widen the band for tens of steps and hide the next one.
    """
    if not math.isfinite(x):
        return track
    if track.count == 0:
        return Track(mean=x, var=0.0, count=1)
    half = triggers.band * max(math.sqrt(track.var), triggers.floor)
    x = min(max(x, track.mean - half), track.mean + half)
    a = triggers.ewma_alpha
    delta = x - track.mean
    # the exponentially weighted variance (West 1979): it stays >= 0 and needs no stored values
    return Track(mean=track.mean + a * delta, var=(1 - a) * (track.var + a * delta * delta), count=track.count + 1)


def _tracks(state: SentinelState, names: tuple[str, ...], world: int) -> tuple[tuple[Track, ...], ...]:
    """The state's histories, or fresh ones when the layout of the scalars or the world changed."""
    if state.names != names or len(state.tracks) != world:
        return tuple(tuple(Track() for _ in names) for _ in range(world))
    return state.tracks


def scores(
    rows: Sequence[Sequence[float]], names: Sequence[str], state: SentinelState, *, triggers: Triggers
) -> list[list[tuple[float | None, float | None]]]:
    """Every rank's two scores on each scalar at this step, ``[rank][scalar] -> (peer, history)``
    (None: that test does not run: fewer than 3 ranks, or a history still warming up); what
    ``decide`` compares with ``mad_threshold`` and ``band``, and what a benchmark reports as the
    margin of a clean run (pure).

    Example:
        >>> rows = [[1.0], [1.1], [30.0]]
        >>> [round(p, 1) for (p, _), in scores(rows, ["grad_norm"], SentinelState(), triggers=Triggers())]
        [0.7, 0.0, 23.4]
    """
    world = len(rows)
    tracks = _tracks(state, tuple(names), world)
    logs = [[to_log(float(v)) for v in row] for row in rows]
    peers = [_peer_scores([logs[r][k] for r in range(world)], triggers.floor) for k in range(len(names))]
    return [
        [
            (peers[k][r] if world >= 3 else None, _history_score(tracks[r][k], logs[r][k], triggers))
            for k in range(len(names))
        ]
        for r in range(world)
    ]


def decide(
    rows: Sequence[Sequence[float]],
    names: Sequence[str],
    state: SentinelState,
    *,
    step: int,
    triggers: Triggers,
    replaying: bool,
) -> tuple[Decision, SentinelState]:
    """The decision at ``step`` from every rank's scalars, and the state after it (pure).

    Args:
        rows: ``rows[rank][k]``, scalar ``names[k]`` of each rank's local gradient, as exchanged
            (raw values: norms, a loss; ``to_log`` is applied here).
        names: the scalars' names (the layout: a different one starts the histories afresh).
        state: the state after the previous step (``SentinelState()`` at the start).
        step: this step (the rate limit counts from the last triggered replay).
        triggers: the thresholds.
        replaying: the step is replayed anyway (an audit step): no triggered replay is needed.

    Returns:
        ``(decision, new state)``; identical on every rank given identical arguments.
    """
    world = len(rows)
    names = tuple(names)
    tracks = _tracks(state, names, world)
    logs = [[to_log(float(v)) for v in row] for row in rows]
    table = scores(rows, names, state, triggers=triggers)
    outliers = []
    for r in range(world):
        for k, name in enumerate(names):
            x = logs[r][k]
            peer, hist = table[r][k]
            peer_out = peer is not None and not peer <= triggers.mad_threshold  # NaN counts as out
            hist_out = hist is not None and not hist <= triggers.band
            if world >= 3:
                flagged = peer_out and (hist is None or hist_out)
            else:
                flagged = hist_out
            if flagged:
                outliers.append(Outlier(rank=r, scalar=name, value=x, peer_score=peer, history_score=hist))
    new_tracks = tuple(
        tuple(_absorb(tracks[r][k], logs[r][k], triggers) for k in range(len(names))) for r in range(world)
    )
    flagged_ranks = tuple(sorted({o.rank for o in outliers}))
    after = replace(state, names=names, tracks=new_tracks)
    if not flagged_ranks or replaying:
        return Decision(replay=False, flagged=flagged_ranks, outliers=tuple(outliers)), after
    if state.last_replay is not None and step - state.last_replay < triggers.min_interval:
        decision = Decision(replay=False, flagged=flagged_ranks, outliers=tuple(outliers), suppressed=True)
        return decision, replace(after, suppressed=state.suppressed + 1)
    decision = Decision(
        replay=True, flagged=flagged_ranks, outliers=tuple(outliers), suppressed_before=state.suppressed
    )
    return decision, replace(after, last_replay=step, suppressed=0)
