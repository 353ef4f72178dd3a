"""The policy planner: formulas by hand, against a brute-force simulation and the real certifier,
the warnings, the cost model, ``--from`` on a real ledger, and the ``certckpt plan`` command."""

import json
import math
import subprocess
import sys
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.ops.planner import (
    DEFAULT_COSTS,
    CostInputs,
    detection_facts,
    expected_cost,
    overhead_from_envelope,
    plan,
    plan_warnings,
    resolve_inputs,
    retention_facts,
    rollback_facts,
)
from certckpt.trust.certify import CheckpointEntry, certify
from certckpt.trust.ledger import Ledger
from certckpt_cli.main import main

# --- brute force: walk every fault start step, apply the detection and trust rules directly ---------


def simulate(k, c, periods=3):
    """Per fault start step f (uniform over whole periods of lcm(K, C) steps): the rollback d - x and
    the checkpoints on node storage from the rollback target up to detection, found by scanning."""
    period = k * c // math.gcd(k, c)
    out = []
    for f in range(1, periods * period + 1):
        d = next(s for s in range(f, f + k) if s % k == 0)  # the first audit at or after the fault start
        last_clean = d - k
        ckpts = [s for s in range(0, d, c)]  # training stops before it would save at d
        # trusted: the first audit at or after it ran before d (and so passed)
        trusted = [s for s in ckpts if next(a for a in range(s, s + k + 1) if a % k == 0) <= last_clean]
        x = max(trusted)
        out.append((d - x, len([s for s in ckpts if s >= x])))
    return out


def cert_delay(k, c):
    return max(-s % k for s in range(0, 3 * k * c + 1, c))


# --- known answers ---------------------------------------------------------------------------------

# (K, C): worst, expected, n_min, aligned
KNOWN = {
    (10, 10): (10, 10.0, 1, True),  # every checkpoint on an audit step
    (10, 5): (10, 10.0, 2, True),  # C divides K: DESIGN's worked example (rollback 30 -> 20)
    (10, 2): (10, 10.0, 5, True),
    (5, 20): (20, 12.5, 1, True),  # K divides C: the rollback goes back up to one checkpoint interval
    (7, 3): (9, 8.0, 3, False),  # coprime: K + C - 1, residues 0, 1, 2
    (10, 4): (12, 11.0, 3, False),  # gcd 2: residues 0, 2 -> expected 10 + 1
    (6, 4): (8, 7.0, 2, False),
}


@pytest.mark.parametrize("kc", sorted(KNOWN))
def test_known_answers(kc):
    k, c = kc
    worst, expected, n_min, aligned = KNOWN[kc]
    r = rollback_facts(audit_every=k, ckpt_every=c)
    assert (r.worst_steps, r.expected_steps, r.aligned) == (worst, expected, aligned)
    assert r.gcd == math.gcd(k, c) and r.max_certification_delay == k - math.gcd(k, c)
    ret = retention_facts(audit_every=k, ckpt_every=c, keep=n_min)
    assert ret.needed == ret.smallest_keep == n_min and ret.keeps_known_good
    assert not retention_facts(audit_every=k, ckpt_every=c, keep=n_min - 1).keeps_known_good


def test_worked_example_in_gpu_hours_and_detection():
    r = rollback_facts(audit_every=10, ckpt_every=5, step_time=1.8, gpus=8)
    assert r.worst_gpu_hours == pytest.approx(10 * 1.8 * 8 / 3600) and r.expected_gpu_hours == pytest.approx(
        10 * 1.8 * 8 / 3600
    )
    assert rollback_facts(audit_every=10, ckpt_every=5).worst_gpu_hours is None
    d = detection_facts(audit_every=10)
    assert (d.max_contaminated_updates, d.mean_contaminated_updates, d.suspect_interval_updates) == (10, 5.5, 10)
    assert d.transient_escape_fraction == pytest.approx(0.9)
    assert detection_facts(audit_every=1).transient_escape_fraction == 0


@pytest.mark.parametrize("kc", sorted(KNOWN))
def test_known_answers_match_the_simulation(kc):
    k, c = kc
    sim = simulate(k, c)
    worst, expected, n_min, _ = KNOWN[kc]
    assert max(r for r, _ in sim) == worst
    assert Fraction(sum(r for r, _ in sim), len(sim)) == Fraction(expected)
    assert max(n for _, n in sim) == n_min


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 24), c=st.integers(1, 24), keep=st.integers(0, 12))
def test_formulas_against_brute_force(k, c, keep):
    sim = simulate(k, c)
    r = rollback_facts(audit_every=k, ckpt_every=c)
    assert r.worst_steps == max(x for x, _ in sim) == k + c - math.gcd(k, c)
    mean = Fraction(sum(x for x, _ in sim), len(sim))
    assert Fraction(r.expected_steps) == mean
    g = math.gcd(k, c)
    assert mean == k + Fraction(sum((m * k) % c for m in range(c // g)), c // g)  # the definition, literally
    assert r.max_certification_delay == cert_delay(k, c)
    ret = retention_facts(audit_every=k, ckpt_every=c, keep=keep)
    assert ret.needed == max(n for _, n in sim)
    assert ret.keeps_known_good == all(n <= keep for _, n in sim)


def _audit(step, outcome="pass"):
    base = {
        "run": "r",
        "branch": "main",
        "step": step,
        "ranks": [0, 1, 2],
        "suspect_ranks": [],
        "contained": False,
        "inventory": {},
    }
    return [
        {
            **base,
            "kind": "replay",
            "outcome": outcome,
            "details": {},
            "suspect_ranks": [1] if outcome == "fail" else [],
        },
        {**base, "kind": "nonfinite", "outcome": "pass", "details": {}},
        {**base, "kind": "consensus", "outcome": "pass", "details": {"fp": f"fp{step}"}},
    ]


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 12), c=st.integers(1, 12), data=st.data())
def test_rollback_target_is_what_the_certifier_picks(k, c, data):
    """The planner's rollback target is latest-good as certckpt.trust.certify decides it."""
    f = data.draw(st.integers(1, 3 * k * c))
    d = -(-f // k) * k
    events = [e for a in range(k, d, k) for e in _audit(a)] + _audit(d, "fail")
    steps = list(range(c, d, c))
    events += [
        {
            "run": "r",
            "branch": "main",
            "step": s,
            "kind": "consensus",
            "outcome": "pass",
            "ranks": [0, 1, 2],
            "suspect_ranks": [],
            "contained": False,
            "details": {"fp": f"fp{s}"},
            "inventory": {},
        }
        for s in steps
        if s % k
    ]
    ckpts = [CheckpointEntry(ckpt_id=f"main@{s}", branch="main", step=s, consensus_fp=f"fp{s}") for s in steps]
    cert = certify(ckpts, events)
    target = int(cert.latest_good.split("@")[1]) if cert.latest_good else 0  # none: back to the initial state
    assert cert.detections[0].interval == (d - k, d)
    assert d - target <= rollback_facts(audit_every=k, ckpt_every=c).worst_steps
    assert target == (d - k) // c * c
    held = [s for s in [0, *steps] if s >= target]
    assert len(held) <= retention_facts(audit_every=k, ckpt_every=c, keep=0).needed


# --- warnings --------------------------------------------------------------------------------------


def codes(**kw):
    args = {"audit_every": 10, "ckpt_every": 5, "keep": 2, "run_steps": 1000, **kw}
    return {w.code: w.indefensible for w in plan_warnings(**args)}


def test_no_warnings_for_a_good_policy():
    assert codes() == {}
    assert codes(audit_every=5, ckpt_every=10, keep=1) == {}


def test_not_aligned():
    ws = plan_warnings(audit_every=10, ckpt_every=4, keep=3, run_steps=1000)
    assert [(w.code, w.indefensible) for w in ws] == [("not-aligned", True)]
    assert "--ckpt-every 2 or 10" in ws[0].message and "12 steps" in ws[0].message and "\n" not in ws[0].message
    assert "not-aligned" not in codes(audit_every=12, ckpt_every=4, keep=3)


def test_keep_too_small():
    assert codes(keep=1) == {"keep-too-small": True}
    assert "at least 2" in plan_warnings(audit_every=10, ckpt_every=5, keep=1, run_steps=1000)[0].message
    assert codes(keep=0, audit_every=5, ckpt_every=5) == {"keep-too-small": True}


def test_audit_beyond_run():
    assert codes(audit_every=2000, ckpt_every=1000) == {"audit-beyond-run": True}
    assert codes(audit_every=1000, ckpt_every=1000, keep=1) == {}


def test_ckpt_sparse_is_advice():
    assert codes(audit_every=10, ckpt_every=40, keep=1) == {"ckpt-sparse": False}
    assert codes(audit_every=10, ckpt_every=30, keep=1) == {}


def test_ckpt_beyond_run_is_advice():
    assert codes(audit_every=10, ckpt_every=2000, keep=1) == {"ckpt-sparse": False, "ckpt-beyond-run": False}


def test_indefensible_plan():
    assert plan(audit_every=10, ckpt_every=4, keep=3).indefensible
    assert not plan(audit_every=10, ckpt_every=40, keep=1).indefensible  # advice only


def test_bad_inputs_are_value_errors():
    for kw in (
        {"audit_every": 0, "ckpt_every": 5, "keep": 1},
        {"audit_every": 10, "ckpt_every": 5, "keep": -1},
        {"audit_every": 2.5, "ckpt_every": 5, "keep": 1},
    ):
        with pytest.raises(ValueError):
            plan(**kw)
    with pytest.raises(ValueError, match="probability"):
        CostInputs(transient_fraction=1.5)
    with pytest.raises(ValueError):
        CostInputs(step_time=0)


# --- cost ------------------------------------------------------------------------------------------


def test_cost_components_by_hand():
    costs = CostInputs(
        step_time=2.0,
        gpus=16,
        gpu_hour_cost=3.0,
        audit_overhead=0.1,
        false_positive_rate=1e-3,
        investigation_cost=200.0,
        defect_cost=50_000.0,
        fault_rate=1e-4,
        transient_fraction=0.25,
        run_steps=36_000,
    )
    cost = expected_cost(audit_every=10, ckpt_every=4, costs=costs)
    # H = 36000 * 2 * 16 / 3600 = 320 GPU-hours; E = 1e-4 * 320 = 0.032 faults
    assert cost.gpu_hours == pytest.approx(320) and cost.expected_faults == pytest.approx(0.032)
    assert cost.extra_compute == pytest.approx(0.1 * 320 * 3.0)  # 96
    assert cost.false_positives == pytest.approx(3600 * 1e-3 * 200)  # 720
    assert cost.rollback_waste == pytest.approx(0.032 * 11 * 2 * 16 / 3600 * 3.0)  # expected rollback 11 steps
    assert cost.undetected_defects == pytest.approx(0.032 * 0.25 * 0.9 * 50_000)  # 360
    assert cost.total == pytest.approx(96 + 720 + 360 + 0.032 * 11 * 32 / 3600 * 3)
    assert cost.per_1000_steps == pytest.approx(cost.total / 36)
    assert set(cost.components) == {"extra_compute", "false_positives", "rollback_waste", "undetected_defects"}


def test_defaults_are_the_documented_ones():
    assert (DEFAULT_COSTS.run_steps, DEFAULT_COSTS.step_time, DEFAULT_COSTS.gpus, DEFAULT_COSTS.gpu_hour_cost) == (
        100_000,
        1.0,
        8,
        2.0,
    )
    assert (DEFAULT_COSTS.audit_overhead, DEFAULT_COSTS.false_positive_rate, DEFAULT_COSTS.investigation_cost) == (
        0.05,
        1e-4,
        500.0,
    )
    assert (DEFAULT_COSTS.defect_cost, DEFAULT_COSTS.fault_rate, DEFAULT_COSTS.transient_fraction) == (
        100_000.0,
        1e-6,
        0.5,
    )


def test_resolve_inputs_order_and_missing():
    with pytest.raises(ValueError, match="--audit-every"):
        resolve_inputs(flags={"ckpt_every": 5, "keep": 2})
    env = overhead_from_envelope({"combinations": [{"premium": 0.03}, {"premium": 0.08}]}, origin="env.json")
    got = resolve_inputs(flags={"audit_every": 10, "ckpt_every": 5, "keep": 2, "gpus": 4}, found=[env])
    assert got["audit_overhead"].value == 0.08 and got["audit_overhead"].source == "from"
    assert got["gpus"].source == "flag" and got["run_steps"].source == "default"
    got = resolve_inputs(flags={"audit_every": 10, "ckpt_every": 5, "keep": 2, "audit_overhead": 0.2}, found=[env])
    assert got["audit_overhead"].value == 0.2 and got["audit_overhead"].source == "flag"
    with pytest.raises(ValueError, match="envelope"):
        overhead_from_envelope({"rows": []}, origin="x.json")


# --- --from on a real ledger -----------------------------------------------------------------------


def _event(step, kind="replay", outcome="pass", branch="main"):
    return {
        "run": "r",
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "ranks": [0, 1],
        "suspect_ranks": [],
        "contained": False,
        "details": {},
        "inventory": {},
    }


@pytest.fixture
def store(tmp_path):
    """A run store with audits every 10 (one irregular gap), checkpoints every 5, two pruned."""
    root = tmp_path / "run"
    root.mkdir()
    ledger = Ledger(str(root))
    for s in range(5, 65, 5):
        ledger.commit_checkpoint(branch="main", step=s, location=str(root / f"step{s:06d}.safetensors"))
    ledger.append_events([_event(s) for s in (10, 20, 30, 40, 50, 55)] + [_event(s, "nonfinite") for s in (10, 20, 30)])
    ledger.append_events([_event(s, "replay", "fail") for s in (60,)])  # a failing audit is not cadence
    for s in range(5, 50, 5):
        ledger.retire(f"main@{s}", reason="keep last 3")
    return root


def test_from_store_cli_json(store):
    r = CliRunner().invoke(main, ["plan", "--from", str(store), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    inputs = doc["inputs"]
    assert (inputs["audit_every"]["value"], inputs["ckpt_every"]["value"], inputs["keep"]["value"]) == (10, 5, 3)
    assert all(
        inputs[n]["source"] == "from" and inputs[n]["origin"] == str(store)
        for n in ("audit_every", "ckpt_every", "keep")
    )
    assert "replay" in inputs["audit_every"]["note"] and "3 of 12" in inputs["keep"]["note"]
    assert inputs["gpus"] == {"value": 8, "source": "default"}
    assert doc["retention"]["keeps_known_good"] and doc["warnings"] == [] and not doc["indefensible"]


def test_from_store_flags_override(store):
    r = CliRunner().invoke(main, ["plan", "--from", str(store), "--keep", "1", "--json"])
    doc = json.loads(r.output)
    assert r.exit_code == 1 and doc["inputs"]["keep"] == {"value": 1, "source": "flag"}
    assert doc["warning_codes"] == ["keep-too-small"]


def test_from_store_and_envelope(store, tmp_path):
    env = tmp_path / "envelope.json"
    env.write_text(json.dumps({"combinations": [{"premium": 0.04, "batch": 32}, {"premium": 0.11, "batch": 8}]}))
    r = CliRunner().invoke(main, ["plan", "--from", str(store), "--from", str(env), "--json"])
    doc = json.loads(r.output)
    assert r.exit_code == 0 and doc["inputs"]["audit_overhead"]["value"] == 0.11
    assert doc["inputs"]["audit_overhead"]["origin"] == str(env)
    assert doc["cost"]["components"]["extra_compute"] == pytest.approx(0.11 * 100_000 * 8 / 3600 * 2.0)


def test_from_a_store_that_cannot_tell_needs_flags(tmp_path):
    root = tmp_path / "young"
    root.mkdir()
    ledger = Ledger(str(root))
    ledger.commit_checkpoint(branch="main", step=5, location=str(root / "a.safetensors"))
    ledger.append_events([_event(10)])
    r = CliRunner().invoke(main, ["plan", "--from", str(root)])
    assert r.exit_code == 2 and "--audit-every is needed" in r.output and "1 passing replay" in r.output
    r = CliRunner().invoke(main, ["plan", "--from", str(root), "--audit-every", "10", "--ckpt-every", "10", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["inputs"]["keep"]["value"] == 1


@pytest.mark.parametrize("make", ["missing", "empty-dir", "bad-json", "not-envelope"])
def test_from_errors_are_one_line_exit_2(tmp_path, make):
    target = tmp_path / make
    if make == "empty-dir":
        target.mkdir()
    elif make == "bad-json":
        target = tmp_path / "bad.json"
        target.write_text("{not json")
    elif make == "not-envelope":
        target = tmp_path / "other.json"
        target.write_text(json.dumps({"cases": []}))
    r = CliRunner().invoke(
        main, ["plan", "--from", str(target), "--audit-every", "10", "--ckpt-every", "5", "--keep", "2"]
    )
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("certckpt: ") and str(target) in lines[0]


# --- the command -----------------------------------------------------------------------------------


def test_cli_json_report():
    r = CliRunner().invoke(
        main, ["plan", "--audit-every", "10", "--ckpt-every", "5", "--keep", "2", "--step-time", "1.8", "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert set(doc) >= {"inputs", "detection", "rollback", "retention", "warnings", "cost"}
    assert (
        doc["inputs"]["step_time"] == {"value": 1.8, "source": "flag"} and doc["inputs"]["gpus"]["source"] == "default"
    )
    assert doc["rollback"]["worst_steps"] == 10 and doc["rollback"]["worst_gpu_hours"] is None  # G was defaulted
    assert doc["retention"] == {"keep": 2, "needed": 2, "keeps_known_good": True, "smallest_keep": 2}
    assert doc["detection"]["max_contaminated_updates"] == 10
    assert doc["cost"]["total"] == pytest.approx(sum(doc["cost"]["components"].values()))
    r = CliRunner().invoke(
        main,
        [
            "plan",
            "--audit-every",
            "10",
            "--ckpt-every",
            "5",
            "--keep",
            "2",
            "--step-time",
            "1.8",
            "--gpus",
            "8",
            "--json",
        ],
    )
    assert json.loads(r.output)["rollback"]["worst_gpu_hours"] == pytest.approx(0.04)


def test_cli_text_and_exit_codes():
    r = CliRunner().invoke(main, ["plan", "--audit-every", "10", "--ckpt-every", "5", "--keep", "2"])
    assert (
        r.exit_code == 0 and "no warnings" in r.output and "default" in r.output and "defaults used: S, G" in r.output
    )
    r = CliRunner().invoke(main, ["plan", "--audit-every", "10", "--ckpt-every", "4", "--keep", "2"])
    assert r.exit_code == 1 and r.output.count("INDEFENSIBLE:") == 2
    r = CliRunner().invoke(main, ["plan", "--audit-every", "10", "--ckpt-every", "40", "--keep", "1"])
    assert r.exit_code == 0 and "warning: checkpoints every 40" in r.output  # advice only
    for args in (
        ["--ckpt-every", "5", "--keep", "2"],
        ["--audit-every", "0", "--ckpt-every", "5", "--keep", "2"],
        ["--audit-every", "10", "--ckpt-every", "5", "--keep", "2", "--transient-fraction", "2"],
    ):
        r = CliRunner().invoke(main, ["plan", *args])
        assert r.exit_code == 2 and "Traceback" not in r.output


def test_plan_does_not_import_torch():
    code = (
        "import sys\nfrom certckpt_cli.main import main\n"
        "try:\n    main(['plan', '--audit-every', '10', '--ckpt-every', '5', '--keep', '2'])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\nprint('exit', code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "exit 0" in out.stdout, out.stderr
