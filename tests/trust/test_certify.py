"""The certifier: the five trust rules, the worked example, and invariants on random histories."""

from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.trust.certify import CheckpointEntry, Revocation, certify
from tests.support.helpers import ROOT


def ev(step, kind, outcome="pass", *, branch="main", fp=None, contained=False, suspects=()):
    return {
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "details": {"fp": fp} if fp else {},
        "suspect_ranks": list(suspects),
        "contained": contained,
    }


def full_audit(step, branch="main"):
    return [
        ev(step, "replay", branch=branch),
        ev(step, "nonfinite", branch=branch),
        ev(step, "consensus", branch=branch, fp=f"{branch}{step}"),
    ]


def ckpt(step, branch="main", parent=None, fp=None):
    return CheckpointEntry(
        ckpt_id=f"{branch}@{step}",
        branch=branch,
        step=step,
        parent=parent,
        consensus_fp=fp if fp is not None else f"{branch}{step}",
        committed_at=float(step),
    )


def worked_example(one_time=False):
    """DESIGN.md: audits every 10, checkpoints every 5; a persistent fault on rank 1 from step 23."""
    events = full_audit(10) + full_audit(20)
    for s in (5, 15, 25):
        events.append(ev(s, "consensus", fp=f"main{s}"))
    if one_time:
        events += full_audit(30)  # the averaged one-time fault escapes: the audit at 30 passes
    else:
        events.append(ev(30, "replay", "fail", suspects=[1]))
    return [ckpt(s) for s in (5, 10, 15, 20, 25)] + ([ckpt(30)] if one_time else []), events


def test_worked_example_persistent_fault():
    cks, events = worked_example()
    cert = certify(cks, events)
    assert [cert.verdicts[f"main@{s}"].trusted for s in (5, 10, 15, 20)] == [True] * 4
    assert cert.verdicts["main@25"].reasons == ("after-fault",)
    assert cert.latest_good == "main@20"
    (d,) = cert.detections
    assert (d.interval, d.rollback_window, d.suspect_ranks, d.last_clean) == ((20, 30), 10, (1,), 20)


def test_worked_example_one_time_fault_is_the_documented_escape():
    cks, events = worked_example(one_time=True)
    cert = certify(cks, events)
    assert all(v.trusted for v in cert.verdicts.values()) and cert.latest_good == "main@30"


def test_rollback_branch_is_judged_by_its_own_audits():
    cks, events = worked_example()
    # resume from main@20 on branch b2; its steps repeat main's numbers
    events += (
        [ev(25, "consensus", branch="b2", fp="b225")]
        + full_audit(30, "b2")
        + [ev(35, "consensus", branch="b2", fp="b235")]
    )
    cks += [ckpt(25, "b2", parent="main@20"), ckpt(30, "b2", parent="main@20"), ckpt(35, "b2", parent="main@20")]
    cert = certify(cks, events)
    assert cert.verdicts["main@25"].trusted is False  # main's 25 stays suspect
    assert cert.verdicts["b2@25"].trusted and cert.verdicts["b2@30"].trusted
    assert cert.verdicts["b2@35"].reasons == ("awaiting-audit",)  # no full audit on b2 at or after 35 yet
    assert cert.latest_good == "b2@30"


def test_each_reason():
    events = full_audit(10) + full_audit(20) + [ev(5, "consensus", fp="main5"), ev(12, "consensus", fp="other")]
    cks = [ckpt(5), ckpt(10, fp="wrong"), ckpt(12), ckpt(15), ckpt(20), ckpt(25)]
    cert = certify(cks, events, corrupt=["main@5"])
    assert cert.verdicts["main@5"].reasons == ("corrupt",)
    assert cert.verdicts["main@10"].reasons == ("fingerprint-mismatch",)
    assert cert.verdicts["main@12"].reasons == ("fingerprint-mismatch",)
    assert cert.verdicts["main@15"].reasons == ("no-consensus",)
    assert cert.verdicts["main@20"].trusted
    assert set(cert.verdicts["main@25"].reasons) == {"no-consensus", "awaiting-audit"}


def test_contained_detection_taints_nothing():
    events = (
        full_audit(10)
        + full_audit(20)
        + [ev(13, "nonfinite-pre", "fail", contained=True, suspects=[2]), ev(15, "consensus", fp="main15")]
    )
    cert = certify([ckpt(10), ckpt(15), ckpt(20)], events)
    assert all(v.trusted for v in cert.verdicts.values())
    (d,) = cert.detections
    assert d.contained and d.interval is None and d.rollback_window == 0


def test_revocation_taints_descendants_across_branches():
    events = full_audit(10) + full_audit(20) + full_audit(30) + full_audit(30, "b2") + full_audit(40, "b2")
    cks = [ckpt(10), ckpt(20), ckpt(30), ckpt(30, "b2", parent="main@20"), ckpt(40, "b2", parent="main@20")]
    cert = certify(cks, events, [Revocation(ckpt_id="main@20", reason="bad data")])
    assert cert.verdicts["main@10"].trusted
    assert cert.verdicts["main@20"].reasons == ("revoked",)
    assert cert.verdicts["main@30"].reasons == ("tainted-parent",)
    assert cert.verdicts["b2@30"].reasons == ("tainted-parent",) and cert.verdicts["b2@40"].reasons == (
        "tainted-parent",
    )
    assert cert.latest_good == "main@10"


def test_suspect_fork_point_taints_the_branch_but_later_corruption_does_not():
    events = full_audit(10) + [ev(15, "consensus", fp="main15")] + full_audit(20, "b2")
    cks = [ckpt(10), ckpt(15), ckpt(20, "b2", parent="main@15")]
    cert = certify(cks, events)
    assert cert.verdicts["main@15"].reasons == ("awaiting-audit",)
    assert cert.verdicts["b2@20"].reasons == ("tainted-parent",)
    events2 = full_audit(10) + full_audit(20, "b2")
    cert2 = certify([ckpt(10), ckpt(20, "b2", parent="main@10")], events2, corrupt=["main@10"])
    assert cert2.verdicts["main@10"].reasons == ("corrupt",) and cert2.verdicts["b2@20"].trusted


def test_a_fork_chain_deeper_than_the_recursion_limit_is_certified_not_crashed():
    """A hostile store can record thousands of branches, each forked from the last: the lineage walk
    is iterative, and a revoked root still taints every descendant."""
    import sys

    depth = sys.getrecursionlimit() + 500
    cks = [ckpt(10)] + [
        ckpt(10 + i, f"b{i}", parent="main@10" if i == 1 else f"b{i - 1}@{9 + i}") for i in range(1, depth)
    ]
    events = full_audit(10) + [e for i in range(1, depth) for e in full_audit(10 + i, f"b{i}")]
    cert = certify(cks, events)
    deepest = f"b{depth - 1}@{9 + depth}"
    assert cert.verdicts[deepest].trusted and cert.latest_good == deepest
    revoked = certify(cks, events, revocations=[Revocation(ckpt_id="main@10", reason="bad node")])
    assert revoked.verdicts[deepest].reasons == ("tainted-parent",) and revoked.latest_good is None


def test_newest_commit_wins_ties():
    events = full_audit(10) + full_audit(10, "b2")
    a = CheckpointEntry(ckpt_id="main@10", branch="main", step=10, consensus_fp="main10", committed_at=1.0)
    b = CheckpointEntry(ckpt_id="b2@10", branch="b2", step=10, consensus_fp="b210", committed_at=2.0)
    assert certify([a, b], events).latest_good == "b2@10"


# --- random histories ------------------------------------------------------------------------------

KINDS = ("replay", "nonfinite", "consensus")


@st.composite
def histories(draw):
    k = draw(st.integers(2, 8))
    c = draw(st.integers(1, 8))
    n = draw(st.integers(1, 50))
    fails = draw(
        st.lists(st.tuples(st.integers(1, n), st.sampled_from(KINDS + ("nonfinite-pre",)), st.booleans()), max_size=3)
    )
    events = []
    for t in range(1, n + 1):
        if t % k == 0:
            events += full_audit(t)
        elif t % c == 0:
            events.append(ev(t, "consensus", fp=f"main{t}"))
    for t, kind, contained in fails:
        events.append(ev(t, kind, "fail", contained=contained and kind == "nonfinite-pre", suspects=[1]))
    cks = [ckpt(t, fp=f"main{t}" if draw(st.integers(0, 9)) else "bad") for t in range(c, n + 1, c)]
    revoked = draw(st.lists(st.sampled_from([x.ckpt_id for x in cks]), max_size=1)) if cks else []
    return cks, events, [Revocation(ckpt_id=r, reason="r") for r in revoked], n


@settings(max_examples=200, deadline=None)
@given(histories())
def test_no_trusted_checkpoint_in_or_after_a_suspect_interval(h):
    cks, events, revs, _ = h
    cert = certify(cks, events, revs)
    for d in cert.detections:
        if d.interval is None:
            continue
        for c in cks:
            if c.branch == d.branch and cert.verdicts[c.ckpt_id].trusted:
                assert c.step <= d.interval[0]


@settings(max_examples=200, deadline=None)
@given(histories())
def test_latest_good_is_trusted_and_newest(h):
    cks, events, revs, _ = h
    cert = certify(cks, events, revs)
    trusted = [c for c in cks if cert.verdicts[c.ckpt_id].trusted]
    if not trusted:
        assert cert.latest_good is None
        return
    best = cert.latest_good
    assert cert.verdicts[best].trusted
    assert max(c.step for c in trusted) == next(c.step for c in cks if c.ckpt_id == best)


@settings(max_examples=200, deadline=None)
@given(histories(), st.data())
def test_passing_events_never_make_trusted_suspect(h, data):
    cks, events, revs, n = h
    before = certify(cks, events, revs)
    t = data.draw(st.integers(1, n))
    kind = data.draw(st.sampled_from(KINDS))
    after = certify(cks, events + [ev(t, kind, fp=f"main{t}" if kind == "consensus" else None)], revs)
    for cid, v in before.verdicts.items():
        if v.trusted:
            assert after.verdicts[cid].trusted, cid


@settings(max_examples=200, deadline=None)
@given(histories(), st.data())
def test_failing_events_never_make_suspect_trusted(h, data):
    cks, events, revs, n = h
    before = certify(cks, events, revs)
    t = data.draw(st.integers(1, n))
    kind = data.draw(st.sampled_from(KINDS + ("nonfinite-pre",)))
    contained = data.draw(st.booleans()) and kind == "nonfinite-pre"
    after = certify(cks, events + [ev(t, kind, "fail", contained=contained)], revs)
    for cid, v in before.verdicts.items():
        if not v.trusted:
            assert not after.verdicts[cid].trusted, cid


def test_contained_failure_on_an_audit_step_fails_no_audit():
    events = full_audit(10) + [ev(10, "nonfinite-pre", "fail", contained=True)]
    assert certify([ckpt(10)], events).verdicts["main@10"].trusted


def test_a_new_branch_intervals_start_at_its_fork_point():
    events = full_audit(10) + full_audit(20) + [ev(27, "replay", "fail", branch="b2", suspects=[0])]
    cert = certify([ckpt(10), ckpt(20)], events, branch_parents={"b2": "main@20"})
    (d,) = cert.detections
    assert (d.branch, d.interval, d.rollback_window) == ("b2", (20, 27), 7)


def test_a_checkpoint_matches_the_fingerprint_consensus_beside_an_audits_digest_consensus():
    # at an audit step the replicas first agree on digests (no fp); saving there agrees on fingerprints
    digest_pass = ev(10, "consensus")
    for order in ((digest_pass, ev(10, "consensus", fp="main10")), (ev(10, "consensus", fp="main10"), digest_pass)):
        events = [ev(10, "replay"), ev(10, "nonfinite"), *order] + full_audit(20)
        assert certify([ckpt(10)], events).verdicts["main@10"].trusted
    events = [ev(10, "replay"), ev(10, "nonfinite"), digest_pass, ev(10, "consensus", fp="other")] + full_audit(20)
    assert certify([ckpt(10)], events).verdicts["main@10"].reasons == ("fingerprint-mismatch",)
    # a digest consensus alone names no fingerprint to vouch for the file with
    events = [ev(10, "replay"), ev(10, "nonfinite"), digest_pass] + full_audit(20)
    assert certify([ckpt(10)], events).verdicts["main@10"].reasons == ("no-consensus",)


# --- verdict levels: trusted > verified > suspect ----------------------------------------------------


def plain(step, branch="main", parent=None):
    """A checkpoint committed without the auditor: no consensus fingerprint."""
    return CheckpointEntry(
        ckpt_id=f"{branch}@{step}", branch=branch, step=step, parent=parent, committed_at=float(step)
    )


def test_a_run_without_the_auditor_is_verified_never_trusted():
    cert = certify([plain(10), plain(20), plain(30, "b2", parent="main@20")], [])
    assert {cid: v.label for cid, v in cert.verdicts.items()} == dict.fromkeys(
        ("main@10", "main@20", "b2@30"), "verified"
    )
    assert set(cert.verdicts["main@10"].reasons) == {"no-consensus", "awaiting-audit"}
    assert cert.latest_good is None and cert.order == []
    assert cert.candidates("verified") == ["b2@30", "main@20", "main@10"]
    assert cert.candidates("trusted") == []


def test_verified_needs_intact_bytes_lineage_and_no_revocation_or_fault():
    events = [ev(25, "replay", "fail", suspects=[0])]
    cks = [plain(10), plain(20), plain(30), plain(40, "b2", parent="main@30"), plain(50, "b3", parent="gone@1")]
    cert = certify(cks, events, [Revocation(ckpt_id="main@10", reason="bad data")], corrupt=["main@20"])
    assert cert.verdicts["main@10"].label == "suspect" and "revoked" in cert.verdicts["main@10"].reasons
    assert cert.verdicts["main@20"].label == "suspect" and "corrupt" in cert.verdicts["main@20"].reasons
    assert cert.verdicts["main@30"].label == "suspect" and "after-fault" in cert.verdicts["main@30"].reasons
    assert cert.verdicts["b2@40"].label == "suspect"  # forked from a checkpoint after the fault
    assert cert.verdicts["b3@50"].label == "suspect"  # descends from a checkpoint the store does not know
    assert cert.candidates("verified") == []


def test_a_trusted_checkpoint_beats_a_newer_verified_one():
    events = full_audit(10)
    cert = certify([ckpt(10), plain(20)], events)
    assert cert.verdicts["main@10"].label == "trusted" and cert.verdicts["main@10"].verified
    assert cert.verdicts["main@20"].label == "verified"
    assert cert.candidates("verified") == ["main@10", "main@20"]


def test_accept_takes_trusted_or_verified_only():
    import pytest

    from certckpt.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="'trusted'.*'verified'"):
        certify([], []).candidates("suspect")


def _full_audit_passed_at_or_after(events, branch, step):
    parts = {}
    for e in events:
        if e["branch"] != branch or e["step"] < step or e["contained"]:
            continue  # a contained failure never reached the weights: it fails no audit
        kind = "nonfinite" if e["kind"].startswith("nonfinite") else e["kind"]
        parts.setdefault(e["step"], {}).setdefault(kind, set()).add(e["outcome"])
    return any(all(k in kinds and kinds[k] == {"pass"} for k in KINDS) for kinds in parts.values())


@settings(max_examples=300, deadline=None)
@given(histories(), st.lists(st.tuples(st.integers(1, 50), st.sampled_from(KINDS), st.booleans()), max_size=6))
def test_nothing_is_trusted_without_a_passing_full_audit(h, extra):
    cks, events, revs, _ = h
    # any further events, passing or failing, but never all three parts of an audit at a new step
    events = events + [ev(t, kind, "pass" if ok else "fail", fp=f"main{t}") for t, kind, ok in extra]
    cert = certify(cks, events, revs)
    for c in cks:
        if cert.verdicts[c.ckpt_id].trusted:
            assert _full_audit_passed_at_or_after(events, c.branch, c.step), c.ckpt_id
    plain_cks = [plain(c.step) for c in cks]
    no_audits = [e for e in events if e["kind"] != "replay"]  # without replays no audit is full
    assert not certify(plain_cks, no_audits, revs).order


@settings(max_examples=200, deadline=None)
@given(histories(), st.booleans())
def test_verified_never_outranks_trusted_and_trusted_implies_verified(h, mix_plain):
    cks, events, revs, _ = h
    if mix_plain:  # every other checkpoint saved without the auditor
        cks = [plain(c.step) if i % 2 else c for i, c in enumerate(cks)]
    cert = certify(cks, events, revs)
    levels = [cert.verdicts[c].level.rank for c in cert.candidates("verified")]
    assert levels == sorted(levels, reverse=True)  # every trusted one before every verified one
    if cert.order:
        assert cert.candidates("verified")[0] == cert.latest_good
    for v in cert.verdicts.values():
        assert not v.trusted or v.verified
        assert v.label in ("trusted", "verified", "suspect")


@settings(max_examples=200, deadline=None)
@given(histories(), st.data())
def test_a_failing_event_never_raises_a_level(h, data):
    cks, events, revs, n = h
    if data.draw(st.booleans()):
        cks = [plain(c.step) if data.draw(st.booleans()) else c for c in cks]
    before = certify(cks, events, revs)
    t = data.draw(st.integers(1, n))
    kind = data.draw(st.sampled_from(KINDS + ("nonfinite-pre",)))
    contained = data.draw(st.booleans()) and kind == "nonfinite-pre"
    after = certify(cks, events + [ev(t, kind, "fail", contained=contained, suspects=[0])], revs)
    for cid, v in before.verdicts.items():
        assert after.verdicts[cid].level.rank <= v.level.rank, (cid, v, after.verdicts[cid])


def test_reason_is_the_one_list_of_reasons_and_docs_trust_tabulates_every_one():
    import re

    import pytest

    from certckpt.trust.certify import PENDING_REASONS, REASONS, Reason, Verdict

    assert tuple(r.value for r in Reason) == REASONS and {"no-consensus", "awaiting-audit"} == PENDING_REASONS
    with pytest.raises(ValueError):
        Verdict(False, ("not-a-reason",))  # certify can only emit members
    text = (ROOT / "docs" / "trust.md").read_text()
    rules = text[text.index("## The five rules") : text.index("## Resuming")]
    named = set(re.findall(r"`([a-z-]+)`", rules))
    resuming = text[text.index("## Resuming") : text.index("## Verdict levels")]
    assert set(REASONS) - {"superseded"} <= named and "`superseded`" in resuming
