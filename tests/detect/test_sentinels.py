"""Sentinels and triggered replays: the pure decision (no processes), then one 3-rank gloo world."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.detect import AuditOptions, Triggers
from certckpt.detect.buckets import BucketSquares, bucket_squares, lay_out, layout_of, squares_match, sum_of_squares
from certckpt.detect.drill import expected_catch, matrix_cases
from certckpt.detect.sentinel import SentinelState, decide
from certckpt.detect.trigger import sentinels_off
from certckpt.errors import ConfigurationError

NAMES = ("grad_norm", "loss")


DEFAULT = Triggers()


def _run(rows_per_step, *, triggers=DEFAULT, audit_every=None):
    """Feed steps 1, 2, ... to ``decide``; returns the decisions and the last state."""
    state, out = SentinelState(), []
    for s, rows in enumerate(rows_per_step, 1):
        replaying = audit_every is not None and s % audit_every == 0
        d, state = decide(rows, NAMES, state, step=s, triggers=triggers, replaying=replaying)
        out.append(d)
    return out, state


def _steady(world, steps, *, wobble=0.05):
    """Plausible clean scalars: each rank's norm and loss wander a few percent around 1."""
    return [
        [[1.0 + wobble * math.sin(1.7 * s + 2.3 * r), 0.5 + wobble * math.cos(1.1 * s + r)] for r in range(world)]
        for s in range(steps)
    ]


def test_a_large_gradient_on_one_of_three_ranks_triggers_and_flags_that_rank():
    rows = _steady(3, 20)
    rows[14][1][0] *= 1e3
    decisions, _ = _run(rows)
    assert [s for s, d in enumerate(decisions, 1) if d.replay] == [15]
    d = decisions[14]
    assert d.flagged == (1,)
    (o,) = d.outliers
    assert o.scalar == "grad_norm" and o.peer_score > 8 and o.history_score > 8
    assert o.value == pytest.approx(math.log(1e3 * rows[14][1][0] / 1e3))


def test_an_overflowed_norm_is_an_outlier_on_every_test():
    rows = _steady(3, 12)
    rows[10][2][0] = math.inf
    decisions, state = _run(rows)
    assert decisions[10].replay and decisions[10].flagged == (2,)
    assert math.isinf(decisions[10].outliers[0].peer_score)
    assert all(math.isfinite(t.mean) for t in state.tracks[2])  # the inf never entered the history


def test_a_change_on_every_rank_at_once_is_no_peer_outlier():
    rows = _steady(3, 20)
    for r in range(3):
        rows[15][r][0] *= 50  # a loss spike every rank sees: not one rank's computation
    decisions, _ = _run(rows)
    assert not any(d.replay for d in decisions)


def test_two_ranks_use_the_history_band_only_and_wait_for_its_warm_up():
    rows = _steady(2, 20)
    rows[3][1][0] *= 1e3  # during the warm-up: no history yet, and no median of two can decide
    rows[15][1][0] *= 1e3
    decisions, _ = _run(rows)
    assert [s for s, d in enumerate(decisions, 1) if d.replay] == [16]
    assert decisions[15].outliers[0].peer_score is None


def test_the_rate_limit_allows_one_triggered_replay_per_min_interval_and_counts_the_rest():
    # thresholds so low that the wobble of clean scalars flags a rank at every step (3 ranks: the
    # peer test alone before the history is warm)
    t = Triggers(min_interval=5, warmup_steps=1, mad_threshold=1e-9, band=1e-9, floor=1e-9)
    decisions, state = _run(_steady(3, 28), triggers=t)
    assert all(d.flagged for d in decisions)
    replayed = [s for s, d in enumerate(decisions, 1) if d.replay]
    assert replayed == [1, 6, 11, 16, 21, 26]
    assert all(b - a >= t.min_interval for a, b in zip(replayed, replayed[1:]))
    assert [decisions[s - 1].suppressed_before for s in replayed] == [0, 4, 4, 4, 4, 4]
    assert state.suppressed == 2 and state.last_replay == 26


def test_an_audit_step_needs_no_triggered_replay_and_does_not_start_the_rate_limit():
    rows = _steady(3, 20)
    rows[9][1][0] *= 1e3
    rows[11][1][0] *= 1e3
    decisions, _ = _run(rows, audit_every=10)
    assert decisions[9].flagged == (1,) and not decisions[9].replay  # step 10 is audited anyway
    assert decisions[11].replay  # step 12: nothing held it back


def test_a_lasting_change_of_one_rank_is_absorbed_by_its_history():
    rows = _steady(3, 80)
    for s in range(20, 80):
        rows[s][1][0] *= 3  # rank 1's data shard has larger gradients from step 21 on, for good
    decisions, _ = _run(rows, triggers=Triggers(mad_threshold=2.0, min_interval=1))
    late = [s for s, d in enumerate(decisions, 1) if d.replay and s > 50]
    assert late == []


def test_a_new_layout_of_scalars_starts_the_histories_again():
    state = SentinelState()
    for s in range(1, 12):
        _, state = decide([[1.0], [1.1], [0.9]], ("grad_norm",), state, step=s, triggers=Triggers(), replaying=False)
    assert state.tracks[0][0].count == 11
    _, state = decide([[1.0, 2.0]] * 3, ("grad_norm", "loss"), state, step=12, triggers=Triggers(), replaying=False)
    assert [t.count for t in state.tracks[0]] == [1, 1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(min_value=1e-6, max_value=1e6, allow_nan=False), min_size=3, max_size=3),
        min_size=2,
        max_size=40,
    )
)
def test_the_decision_is_a_function_of_its_inputs_and_never_replays_twice_within_the_interval(norms):
    rows = [[[v, 1.0] for v in step] for step in norms]
    a, state_a = _run(rows, triggers=Triggers(min_interval=3, warmup_steps=2))
    b, state_b = _run(rows, triggers=Triggers(min_interval=3, warmup_steps=2))
    assert a == b and state_a == state_b  # what every rank relies on to enter the same collectives
    replayed = [s for s, d in enumerate(a, 1) if d.replay]
    assert all(y - x >= 3 for x, y in zip(replayed, replayed[1:]))
    for d in a:
        assert set(d.flagged) == {o.rank for o in d.outliers}


def test_triggers_are_validated_and_keyword_only():
    with pytest.raises(ConfigurationError, match="mad_threshold must be a positive number"):
        Triggers(mad_threshold=0)
    with pytest.raises(ConfigurationError, match="ewma_alpha must be in"):
        Triggers(ewma_alpha=1.5)
    with pytest.raises(ConfigurationError, match="min_interval must be an int >= 1"):
        Triggers(min_interval=0)
    with pytest.raises(TypeError):
        Triggers(True)  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match="triggers must be a certckpt.detect.Triggers"):
        AuditOptions(triggers={"enabled": False})  # type: ignore[arg-type]
    assert AuditOptions().triggers.enabled  # on by default
    assert AuditOptions.build(triggers=Triggers(enabled=False)).triggers.enabled is False


def test_the_drill_expects_large_one_time_faults_between_audits_caught_at_their_step():
    cases = matrix_cases(audit_every=10, ckpt_every=5)
    large = [c for c in cases if c.get("magnitude") == "large" and not c.get("saturated")]
    assert {c["fault"] for c in large} == {"forward", "backward"}
    assert {c["timing"] for c in large} == {"one-time-between-audits"}
    for c in large:
        assert expected_catch(c, audit_every=10, ckpt_every=5) == ("replay", c["injected_step"])
    escapes = [c for c in cases if c["timing"] == "one-time-between-audits" and c["fault"] in ("forward", "backward")]
    escapes = [c for c in escapes if "magnitude" not in c or c.get("saturated")]  # small, or saturated by a Tanh
    assert [expected_catch(c, audit_every=10, ckpt_every=5) for c in escapes] == [(None, None)] * 3


# --- without hand-over: a DDP bucket's layout, and its sum of squares from replayed gradients ---


def _bucket(shapes, *, channels_last=(), seed=0):
    """A flat bucket as DDP fills it: each gradient at its offset, a channels_last one with its own
    strides (DDP's layout contract); returns the buffer, the layout and each gradient row-major,
    as a replay's autograd hands it over."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(sum(math.prod(s) for s in shapes), dtype=torch.float32)
    views, grads, offset = [], {}, 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        grad = torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-3, 4, (), generator=g))
        if i in channels_last:
            strides = torch.empty(shape).to(memory_format=torch.channels_last).stride()
        else:
            strides = torch.empty(shape).stride()
        view = buf.as_strided(shape, strides, offset)
        view.copy_(grad)
        views.append(view)
        grads[i] = grad.contiguous()
        offset += n
    return buf, layout_of(0, buf, list(range(len(shapes))), views), grads


def test_a_replays_gradients_laid_out_as_the_bucket_give_the_hooks_sum_of_squares_bit_for_bit():
    shapes = [(3, 5), (4, 2, 3, 3), (7,), (2, 3, 2, 2)]
    buf, layout, grads = _bucket(shapes, channels_last=(1, 3))
    assert layout.offsets == (0, 15, 87, 94) and layout.strides[1] == (18, 1, 6, 2)  # channels_last kept
    trained = sum_of_squares(buf)  # what the hook takes before the all-reduce
    order = [2, 0, 3, 1]  # backward hands the gradients over in its own order
    squares = BucketSquares([layout], device=buf.device)
    for i in order[:-1]:
        squares.add(i, grads[i])
        assert squares.bufs[0] is not None  # the bucket's buffer lives until its last gradient ...
    squares.add(order[-1], grads[order[-1]])
    assert squares.bufs[0] is None  # ... and is reduced and freed then
    replayed = squares.result()
    assert replayed.view(torch.int32).tolist() == [trained.view(torch.int32).item()]
    assert torch.equal(lay_out(layout, grads, device=buf.device), buf)  # the very bytes of the bucket
    # the same gradients row-major (the parameters' strides ignored) are another buffer
    row_major = dataclasses.replace(layout, strides=tuple(torch.empty(s).stride() for s in layout.sizes))
    assert not torch.equal(lay_out(row_major, grads, device=buf.device), buf)
    # a parameter without a gradient is zeros in the bucket (as DDP zeroes an unused one's part)
    missing = {i: g for i, g in grads.items() if i != 2}
    buf[layout.offsets[2] : layout.offsets[2] + 7] = 0
    assert bucket_squares([layout], missing, device=buf.device).view(torch.int32).tolist() == [
        sum_of_squares(buf).view(torch.int32).item()
    ]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=6),
    st.integers(0, 2**31 - 1),
    st.randoms(use_true_random=False),
)
def test_bucket_squares_equal_the_flat_buffers_for_any_shapes_and_any_order(shapes, seed, rnd):
    shapes = [tuple(s) for s in shapes]
    four_d = tuple(i for i, s in enumerate(shapes) if len(s) == 4)
    buf, layout, grads = _bucket(shapes, channels_last=four_d, seed=seed)
    items = list(grads.items())
    rnd.shuffle(items)
    assert torch.equal(lay_out(layout, dict(items), device=buf.device), buf)
    got = bucket_squares([layout], dict(items), device=buf.device)
    assert got.view(torch.int32).tolist() == [sum_of_squares(buf).view(torch.int32).item()]


def test_sums_of_squares_compare_by_their_bits_or_as_norms_within_rtol():
    a = torch.tensor([4.0, float("inf"), float("nan"), 1.0])
    ulp = torch.nextafter(torch.tensor(4.0), torch.tensor(5.0))
    b = torch.tensor([ulp.item(), float("inf"), float("nan"), 1.0])
    assert squares_match(a, a.clone(), mode="deterministic", rtol=0) == [True, True, True, True]  # NaN: same bits
    assert squares_match(a, b, mode="deterministic", rtol=0) == [False, True, True, True]  # one ulp apart
    assert squares_match(a, b, mode="tolerance", rtol=1e-3) == [True, True, False, True]  # NaN never agrees
    # tolerance compares norms: 4 against 4.0161 is a norm of 2 against 2.004 (0.2 % off)
    c = torch.tensor([4.0161, 1e30, 1.0, 0.0])
    assert squares_match(a, c, mode="tolerance", rtol=1e-3) == [False, False, False, False]
    assert squares_match(a[:1], c[:1], mode="tolerance", rtol=3e-3) == [True]


def _ctx(**over):
    ctx = SimpleNamespace(
        options=AuditOptions(), grad_scaler=None, model=SimpleNamespace(mixed_precision=None), hook=None
    )
    for k, v in over.items():
        setattr(ctx, k, v)
    return ctx


def test_without_hand_over_the_sentinels_run_and_stay_off_for_ddp_mixed_precision_and_say_why():
    assert sentinels_off(_ctx(hook=SimpleNamespace(hand_over=False))) is None  # sums of squares instead
    mp = sentinels_off(_ctx(model=SimpleNamespace(mixed_precision=object())))
    assert mp is not None and "DDP mixed precision" in mp and "low-precision forward" in mp
    assert "gradient scaler" in sentinels_off(_ctx(grad_scaler=object()))
    assert "deferred" in sentinels_off(_ctx(options=AuditOptions(nonfinite_read="deferred")))


# --- one launched world of 3 gloo ranks: every scenario in turn (tests/support/sentinel_cases.py) ---

SCENARIOS = ["clean", "backward", "forward", "huge-element", "rate", "accumulated", "session", "off", "no-hand-over"]


@pytest.fixture(scope="module")
def world():
    from certckpt.detect.launch import run_ranks
    from tests.support import sentinel_cases

    return run_ranks(sentinel_cases.triggers_world, 3, {"scenarios": SCENARIOS, "clean_steps": 60}, timeout=300)


@pytest.mark.slow
def test_a_clean_run_has_no_detection_and_every_rank_decides_alike(world):
    clean = world[0]["clean"]
    assert clean["off"] is None and clean["names"] == ["grad_norm", "group0_norm", "loss"]
    assert clean["failures"] == []
    assert len(clean["decisions"]) == 60
    # (d) the decision of every step is the same on every rank: they enter the same collectives
    assert all(w["clean"]["decisions"] == clean["decisions"] for w in world)
    # (b) the number of triggers is reported: with the default thresholds this run raises none
    spent = {k: round(v, 2) for k, v in world[0].items() if k.endswith("_seconds")}
    print(f"clean run: {len(clean['triggered'])} triggered replay(s) in 60 steps; seconds on rank 0: {spent}")
    assert clean["triggered"] == []


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["backward", "forward", "huge-element"])
def test_a_large_one_time_fault_between_audits_is_replayed_at_its_step_and_names_rank_1(world, scenario):
    caught = world[0][scenario]["caught"]
    step = 14 if scenario == "huge-element" else 13  # audits every 10 steps: neither is an audit step
    assert caught is not None, scenario
    assert (caught["kind"], caught["step"], caught["suspects"]) == ("replay", step, [1])
    assert caught["trigger"]["flagged"] == [1]  # the sentinels asked for the replay ...
    assert all(w[scenario]["caught"] == caught for w in world)  # ... and every rank raised the same
    if scenario != "forward":
        assert caught["incident"] == f"inc-main-{step}-replay" and caught["contained"] is False


@pytest.mark.slow
def test_the_rate_limit_holds_and_forced_triggers_on_clean_runs_never_detect(world):
    rate = world[0]["rate"]
    # every step flagged (EAGER thresholds), min_interval=4: one replay per 4 steps, the rest counted
    assert rate["triggered"] == [1, 5, 9, 13, 17]
    assert (rate["replayed"], rate["suppressed"], rate["failures"]) == (5, 15, [])
    # the local gradients signed after the fact match the neighbours' replays: with accumulation
    # and through a user's loop at the session's hook points too
    assert world[0]["accumulated"]["triggered"] == [1, 5]
    assert world[0]["session"]["triggered"] == [1, 5, 9]
    assert world[0]["session"]["names"] == ["grad_norm", "group0_norm"]  # no loss at the hook points


@pytest.mark.slow
def test_the_sentinels_are_off_where_no_triggered_replay_can_run_and_say_why(world):
    off = world[0]["off"]
    assert "deferred" in off["deferred"]
    assert off["table"] is None  # nothing exchanged for them


@pytest.mark.slow
def test_without_hand_over_a_triggered_replay_compares_the_buckets_sums_of_squares(world):
    res = world[0]["no-hand-over"]
    # hand_over_grads=False: a gradient scaled by 1e3 on rank 1 at step 13 is replayed at its step,
    # the bucket's sum of squares differs, and arbitration names rank 1 on every rank
    caught = res["caught"]
    assert (caught["kind"], caught["step"], caught["suspects"]) == ("replay", 13, [1])
    assert caught["trigger"]["flagged"] == [1] and caught["compared"] == "sum of squares per bucket"
    assert list(caught["mismatched"]) == ["1->2"]
    assert all(w["no-hand-over"]["caught"] == caught for w in world)
    # forced triggers on clean steps all pass: gradient copies; bucket views with accumulation and
    # two buckets rebuilt after step 1; tolerance mode; an unused parameter; a static graph
    for name in ("copies", "views-accumulated", "tolerance", "unused", "static"):
        got = res[name]
        assert (got["off"], got["hand_over"]) == (None, False), name
        assert got["triggered"] == [1, 5] and got["failures"] == [], name
        assert got["compared"] == ["sum of squares per bucket"] * 2, name
    assert res["views-accumulated"]["buckets"] == 2
