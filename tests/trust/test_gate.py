"""The deletion gate (certckpt.trust.gate): the one pure rule every deletion asks. Doubt may lower a
verdict; it never frees space."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from certckpt.trust.certify import Reason, Verdict
from certckpt.trust.chain import Break
from certckpt.trust.gate import DOUBT_REASONS, gate_deletions, rotation_keeps, store_doubt
from certckpt.trust.snapshot import LedgerSnapshot

TRUSTED = Verdict(trusted=True)


def suspect(*reasons: Reason) -> Verdict:
    return Verdict(trusted=False, reasons=tuple(reasons))


def test_a_copy_goes_only_on_authenticated_evidence_that_frees_it():
    verdicts = {
        "a@1": TRUSTED,
        "a@2": suspect(Reason.AFTER_FAULT),
        "a@3": suspect(Reason.REVOKED),
        "a@4": suspect(Reason.TAMPERED),
        "a@5": suspect(Reason.DEVICE_CONVICTED),
        "a@6": suspect(Reason.CORRUPT),
        "a@9": TRUSTED,
    }
    out = gate_deletions(
        ["a@1", "a@2", "a@3", "a@4", "a@5", "a@6", "a@7", "a@9"],
        verdicts=verdicts,
        doubt=None,
        protected={"a@9": "latest-good"},
    )
    assert out.delete == ["a@1", "a@2", "a@3"]
    assert "tampered" in out.keep["a@4"] and "device-convicted" in out.keep["a@5"] and "corrupt" in out.keep["a@6"]
    assert "no authenticated commit record" in out.keep["a@7"]  # absence is not evidence
    assert out.keep["a@9"] == "latest-good"


def test_a_store_in_doubt_deletes_nothing_and_says_why():
    snap = LedgerSnapshot(breaks=[Break(writer="w1", seq=3, scope="store", why="entry 3 is missing")])
    doubt = store_doubt(snap)
    assert doubt is not None and "entry 3 is missing" in doubt
    out = gate_deletions(["a@1"], verdicts={"a@1": TRUSTED}, doubt=doubt, protected={})
    assert out.delete == [] and "nothing is deleted on doubt" in out.keep["a@1"]
    # a break of the certificate cache proves nothing missing: certificates are re-derived
    assert store_doubt(LedgerSnapshot(breaks=[Break(writer="w2", seq=1, scope="cache", why="x")])) is None


def test_a_rotation_keeps_latest_good_and_everything_while_in_doubt_but_not_its_own_unsealed_commit():
    snap = LedgerSnapshot()
    assert rotation_keeps("a@5", snap=snap, verdicts={"a@5": TRUSTED}, latest_good="a@5") is not None
    assert rotation_keeps("a@5", snap=snap, verdicts={"a@5": TRUSTED}, latest_good="a@10") is None
    assert rotation_keeps("a@5", snap=snap, verdicts={}, latest_good="a@10") is None  # committed, not sealed yet
    assert rotation_keeps("a@5", snap=snap, verdicts={"a@5": suspect(Reason.TAMPERED)}, latest_good=None)
    broken = LedgerSnapshot(breaks=[Break(writer="w1", seq=1, scope="branch:main", why="x")])
    assert rotation_keeps("a@5", snap=broken, verdicts={}, latest_good=None) is not None


REASONS = st.lists(st.sampled_from(list(Reason)), max_size=3, unique=True)
VERDICT = st.one_of(st.none(), st.builds(lambda r: suspect(*r) if r else TRUSTED, REASONS))


@given(
    copies=st.dictionaries(st.sampled_from([f"m@{i}" for i in range(12)]), VERDICT, max_size=12),
    protected=st.sets(st.sampled_from([f"m@{i}" for i in range(12)]), max_size=3),
    doubt=st.one_of(st.none(), st.just("the ledger is tampered")),
)
def test_the_gate_never_releases_what_is_protected_unproven_or_doubtful(copies, protected, doubt):
    verdicts = {c: v for c, v in copies.items() if v is not None}
    out = gate_deletions(list(copies), verdicts=verdicts, doubt=doubt, protected={p: "kept" for p in protected})
    assert set(out.delete) | set(out.keep) == set(copies) and not set(out.delete) & set(out.keep)
    for cid in out.delete:
        assert doubt is None and cid not in protected and cid in verdicts
        assert not set(verdicts[cid].reasons) & DOUBT_REASONS
