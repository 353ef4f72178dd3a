"""Audit coverage (certckpt.trust.coverage): figures from the events that ran, never configuration."""

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.trust.certify import CheckpointEntry
from certckpt.trust.coverage import coverage, lineage_of, parents_of


def ev(step, kind, outcome="pass", *, branch="main", ranks=3, **details):
    return {
        "run": "r",
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "ranks": list(range(ranks)),
        "suspect_ranks": [],
        "contained": False,
        "details": details,
        "inventory": {},
    }


def audit(step, *, branch="main", ranks=3, every=10, **replay):
    return [
        ev(step, "replay", branch=branch, ranks=ranks, comparisons=ranks, mode="deterministic", **replay),
        ev(step, "consensus", branch=branch, ranks=ranks, params=6, buffers=2, fp="ab" * 8),
        ev(step, "nonfinite", branch=branch, ranks=ranks, steps_checked=every),
    ]


def ckpts(*steps, branch="main", parent=None):
    return [
        CheckpointEntry(ckpt_id=f"{branch}@{s}", branch=branch, step=s, parent=parent, committed_at=float(s))
        for s in steps
    ]


def test_audit_every_10_checkpoint_every_5():
    events = [e for a in (10, 20, 30) for e in audit(a)]
    cov = coverage(ckpts(5, 10, 15, 20, 25, 30), events, branch_parents={})
    c10, c15, c30 = cov["main@10"], cov["main@15"], cov["main@30"]
    assert (c10.parent, c10.window.start, c10.window.end) == ("main@5", 5, 10)
    assert c10.window.replay_steps == {10: 3} and c10.one_time_replayed == Fraction(1, 5)
    assert c10.window.consensus_steps == [10] and c10.window.consensus_covered == {"params": 6, "buffers": 2}
    assert c10.window.nonfinite_steps == 5
    # a persistent fault from step 6 is replayed at 10: its 5th step; from 11, at 20: its 10th
    assert (c10.persistent_within, c10.rank_named, c10.world) == (5, True, 3)
    assert c15.one_time_replayed == 0 and c15.persistent_within == 10  # vouched for by the audit at 20
    assert c30.lineage_replayed == Fraction(1, 10) and c30.lineage_steps == 30 and c30.lineage == 6
    assert cov["main@5"].parent is None and cov["main@5"].window.start == 0


def test_no_replay_after_the_checkpoint_is_no_bound():
    cov = coverage(ckpts(10, 15), audit(10), branch_parents={})
    assert cov["main@15"].persistent_within is None and not cov["main@15"].rank_named
    assert cov["main@15"].to_json()["bound"]["persistent_within"] is None
    assert "no replay over steps 11-15" in cov["main@15"].summary() and "no bound" in cov["main@15"].summary()


def test_two_ranks_bound_the_fault_but_name_nobody():
    cov = coverage(ckpts(10), audit(10, ranks=2), branch_parents={})
    assert cov["main@10"].persistent_within == 10 and not cov["main@10"].rank_named
    assert "rank not named" in cov["main@10"].summary()


def test_a_clean_triggered_replay_is_reported_and_vouches_for_nothing_else():
    # issue 46: the sentinels had step 13 replayed between the audits at 10 and 20, and it was right
    trig = ev(13, "triggered-replay", comparisons=3, mode="deterministic", micro_batches=1, replayed_micro_batches=1)
    with_trigger = coverage(ckpts(10, 15, 20), [*audit(10), trig, *audit(20)], branch_parents={})
    without = coverage(ckpts(10, 15, 20), [*audit(10), *audit(20)], branch_parents={})
    c15 = with_trigger["main@15"]
    assert c15.window.triggered_steps == [13] and with_trigger["main@20"].window.triggered_steps == []
    assert c15.to_json()["replay"]["triggered_steps"] == [13] and "1 triggered replay(s) clean" in c15.summary()
    # it is no audit: the replayed steps, the one-time figure and the persistent bound are unchanged
    for cid in ("main@10", "main@15", "main@20"):
        a, b = with_trigger[cid], without[cid]
        assert (a.window.replay_steps, a.one_time_replayed, a.persistent_within, a.lineage_replayed) == (
            b.window.replay_steps,
            b.one_time_replayed,
            b.persistent_within,
            b.lineage_replayed,
        )


def test_sampled_micro_batches_count_their_share():
    events = [*audit(10, micro_batches=8, replayed_micro_batches=2), *audit(20, micro_batches=8)]
    cov = coverage(ckpts(10, 20), events, branch_parents={})
    assert cov["main@10"].window.sampled_steps == {10: "1/4"}
    assert cov["main@10"].one_time_replayed == Fraction(1, 40)
    assert cov["main@20"].one_time_replayed == Fraction(1, 10)  # no sample recorded: the whole step
    assert cov["main@20"].lineage_replayed == Fraction(1 + Fraction(1, 4), 20)
    # a persistent fault shows in every block: the bound does not depend on the sample
    assert cov["main@10"].persistent_within == 10


def test_checks_that_do_not_count():
    """A precondition check, an overflow, malformed events and configuration cover nothing."""
    bad = [
        ev(10, "consensus", found_by="replay precondition", params=6),
        ev(10, "overflow", pre_ranks=[1]),
        {**ev(10, "replay"), "step": "10"},
        {**ev(10, "replay"), "ranks": "all"},
        ev(10, "replay", micro_batches=2, replayed_micro_batches=3),
        "not an event",
        {"audit_every": 1},
    ]
    cov = coverage(ckpts(10), bad, branch_parents={})
    w = cov["main@10"].window
    assert w.replay_steps == {} and w.consensus_steps == [] and cov["main@10"].persistent_within is None


def test_a_failed_check_ran():
    events = [ev(10, "replay", "fail", comparisons=3), ev(7, "nonfinite-pre", "fail")]
    cov = coverage(ckpts(10), events, branch_parents={})
    assert cov["main@10"].window.replay_steps == {10: 3} and cov["main@10"].window.nonfinite_steps == 1


def test_branches_follow_their_fork_point():
    events = [e for a in (10, 20) for e in audit(a)] + [e for a in (30, 40) for e in audit(a, branch="b2")]
    cps = ckpts(10, 20, 30) + ckpts(30, 40, branch="b2", parent="main@20")
    cov = coverage(cps, events, branch_parents={"b2": "main@20"})
    b30 = cov["b2@30"]
    assert b30.parent == "main@20" and (b30.window.start, b30.window.end) == (20, 30)
    assert b30.window.replay_steps == {30: 3}  # b2's audit, not main's
    parents = parents_of(cps, {"b2": "main@20"})
    assert lineage_of("b2@40", parents) == ["b2@40", "b2@30", "main@20", "main@10"]
    assert cov["b2@40"].lineage == 4 and cov["b2@40"].lineage_replayed == Fraction(1, 10)


def test_a_run_without_the_auditor_covers_nothing():
    cov = coverage(ckpts(100), [], branch_parents={})
    c = cov["main@100"]
    assert not c.audited and c.one_time_replayed == 0 and c.lineage_replayed == 0 and c.window.steps == 100


@settings(max_examples=60, deadline=None)
@given(
    every=st.integers(1, 12),
    ck_every=st.integers(1, 12),
    n=st.integers(1, 6),
)
def test_lineage_fraction_is_one_over_audit_every(every, ck_every, n):
    """Audits every K, checkpoints anywhere: at a step that is a multiple of K the lineage's
    one-time figure is exactly 1/K, and the persistent bound never exceeds K."""
    last = every * ck_every * n
    events = [e for a in range(every, last + every, every) for e in audit(a, every=every)]
    cov = coverage(ckpts(*range(ck_every, last + 1, ck_every)), events, branch_parents={})
    for cid, c in cov.items():
        step = int(cid.rpartition("@")[2])
        if step % every == 0:
            assert c.lineage_replayed == Fraction(1, every)
        assert c.persistent_within is not None and c.persistent_within <= every
        assert c.window.nonfinite_steps == c.window.steps


@settings(max_examples=200, deadline=None)
@given(
    checks=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 20), st.booleans()), min_size=0, max_size=12),
    cuts=st.lists(st.integers(1, 70), min_size=1, max_size=8, unique=True),
)
def test_windows_count_the_non_finite_steps_a_scan_of_every_event_would(checks, cuts):
    # the bisection over merged spans against the definition: each summary covers the steps since the
    # previous one (its last steps_checked), a failure its own step; counted per window by a plain scan
    events = [
        ev(step, "nonfinite-pre", "fail", tensors=["w"]) if failed else ev(step, "nonfinite", steps_checked=n)
        for step, n, failed in checks
    ]
    cov = coverage(ckpts(*sorted(cuts)), events, branch_parents={})
    covered: set[int] = set()
    prev = 0
    for step, n, failed in sorted(checks, key=lambda c: c[0]):
        if failed:
            covered.add(step)
        else:
            covered.update(range(max(prev, step - n) + 1, step + 1))
            prev = max(prev, step)
    start = 0
    for cut in sorted(cuts):
        assert cov[f"main@{cut}"].window.nonfinite_steps == len([s for s in covered if start < s <= cut])
        start = cut
