"""The magnitude sweep (``certckpt drill faults --sweep``): its pure parts (cases, outcomes, table,
picture, the injector's new perturbations), then one tiny sweep through the CLI on 3 gloo ranks."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.detect.inject import Fault, Injector, perturb_
from certckpt.detect.sweep import KINDS, PERTURBATIONS, magnitude_label, parse_magnitudes, select_kinds, sweep_cases
from certckpt.detect.sweep_table import Outcome, clean_summary, outcome, table_rows, tally, thresholds
from certckpt.errors import ConfigurationError
from certckpt.ops.sweep_chart import sweep_svg
from certckpt_cli.main import main

SVG = "{http://www.w3.org/2000/svg}"


# --- kinds and cases --------------------------------------------------------------------------------


def test_kinds_expand_from_perturbations_and_sites_and_unknown_names_are_refused():
    assert select_kinds(None) == list(KINDS) == select_kinds("all")
    assert select_kinds("scale") == ["forward-scale", "backward-scale"]
    assert select_kinds("backward") == [k for k in KINDS if k.startswith("backward-")]
    assert select_kinds("backward-zero, set") == ["forward-set", "backward-set", "backward-zero"]
    with pytest.raises(ConfigurationError, match="unknown kind 'bitflip'.*bitflip-fp32"):
        select_kinds("bitflip")


def test_magnitudes_are_numbers_and_bit_flips_take_bits_the_dtype_has():
    assert parse_magnitudes(None, ["backward-scale"]) is None
    assert parse_magnitudes("1e-6,1e3", ["backward-scale", "forward-zero"]) == (1e-6, 1e3)
    assert parse_magnitudes("0,15", ["forward-bitflip-bf16"]) == (0.0, 15.0)
    with pytest.raises(ConfigurationError, match="bit indexes 0-15"):
        parse_magnitudes("16", ["forward-bitflip-bf16"])
    with pytest.raises(ConfigurationError, match="expected numbers"):
        parse_magnitudes("big", ["backward-scale"])


def test_every_fault_lands_strictly_between_two_audits_and_runs_with_and_without_sentinels():
    k = 10
    cases = sweep_cases(kinds=list(KINDS), trials=4, audit_every=k, clean_steps=50)
    clean = [c for c in cases if c.kind == "clean"]
    faulty = [c for c in cases if c.kind != "clean"]
    # one clean run per trial and per dtype in use, sentinels on, the length asked for
    assert sorted((c.dtype, c.trial) for c in clean) == sorted(
        (d, t) for d in ("float32", "bfloat16") for t in range(4)
    )
    assert all(c.sentinels and c.steps == 50 and c.fault is None for c in clean)
    assert all(k < c.injected_step < 2 * k and c.steps == 2 * k for c in faulty)
    assert {c.rank for c in faulty} == {0, 1, 2}  # the faulty rank rotates with the trial
    pairs: dict[tuple, list] = {}
    for c in faulty:
        pairs.setdefault((c.kind, c.magnitude if not math.isnan(c.magnitude) else "nan", c.trial), []).append(c)
    assert all(sorted(x.sentinels for x in p) == [False, True] and p[0].fault == p[1].fault for p in pairs.values())
    assert len({c.name for c in cases}) == len(cases)
    expected = sum(len(PERTURBATIONS[k.split("-", 1)[1]].magnitudes) for k in KINDS) * 4 * 2
    assert len(faulty) == expected
    # every case's fault is one the injector accepts, hitting the site and rank it names
    for c in faulty:
        f = Fault(**c.fault)
        assert (f.kind, f.rank, f.step, f.persistent) == (c.kind.split("-")[0], c.rank, c.injected_step, False)
    assert {c.dtype for c in faulty if "bf16" in c.kind} == {"bfloat16"}


def test_a_sweep_without_bf16_kinds_has_no_bf16_clean_runs_and_fewer_than_3_ranks_is_refused():
    cases = sweep_cases(kinds=["backward-scale"], trials=2, magnitudes=[1e3])
    assert [c.dtype for c in cases if c.kind == "clean"] == ["float32", "float32"]
    with pytest.raises(ConfigurationError, match="3 ranks or more"):
        sweep_cases(kinds=["backward-scale"], trials=1, ranks=2)
    with pytest.raises(ConfigurationError, match="audit_every >= 3"):
        sweep_cases(kinds=["backward-scale"], trials=1, audit_every=2)


def test_magnitude_labels():
    assert [magnitude_label("backward-scale", m) for m in (1e-6, 0.3, 1e3)] == ["1e-06", "0.3", "1000"]
    assert magnitude_label("forward-bitflip-fp32", 30.0) == "bit30"
    assert (magnitude_label("backward-zero", math.nan), magnitude_label("forward-zero", math.nan)) == (
        "bucket",
        "output",
    )


# --- outcomes and the table -------------------------------------------------------------------------


def _result(kind="backward-scale", magnitude=1e3, *, on=True, rank=1, step=13, det=None, fired=1, effect=None):
    return {
        "name": f"{kind}-{magnitude}-{on}-{rank}-{det}",
        "kind": kind,
        "magnitude": magnitude,
        "sentinels": on,
        "rank": rank,
        "injected_step": step,
        "fired": fired,
        "detected": det,
        "effect": effect,
    }


def _det(kind="replay", step=13, suspects=(1,), triggered=True):
    return {"kind": kind, "step": step, "suspects": list(suspects), "triggered": triggered}


def test_caught_means_at_its_own_step_with_the_faulty_rank_named():
    assert outcome(_result(det=_det())) is Outcome.CAUGHT_REPLAY
    assert outcome(_result(det=_det(kind="nonfinite-pre", triggered=False))) is Outcome.CAUGHT_NONFINITE
    assert outcome(_result(det=_det(step=20))) is Outcome.LATE  # the next audit, or a later non-finite
    assert outcome(_result(det=_det(suspects=(0,)))) is Outcome.LATE  # the wrong rank named
    assert outcome(_result(det=_det(suspects=(0, 1)))) is Outcome.LATE
    assert outcome(_result(det=_det(kind="consensus"))) is Outcome.LATE
    assert outcome(_result()) is Outcome.ESCAPED
    assert outcome(_result(fired=0)) is Outcome.NOT_FIRED
    assert Outcome.CAUGHT_NONFINITE.caught and not Outcome.LATE.caught


def test_the_table_counts_catches_per_kind_magnitude_and_sentinels():
    results = [
        _result(det=_det(), effect=[0.5, 500.5]),
        _result(det=_det(triggered=False), effect=[0.25, 250.25]),  # a scheduled audit's replay
        _result(on=False, effect=[0.5, 500.5]),
        _result(on=False, det=_det(kind="nonfinite-pre", step=15, triggered=False), effect=[0.5, 500.5]),
        _result(magnitude=1e-6, det=None, effect=[0.5, 0.5000005]),
        _result(kind="forward-bitflip-fp32", magnitude=30.0, det=_det(kind="nonfinite-pre"), effect=[1.5, "inf"]),
        _result(
            kind="forward-bitflip-fp32", magnitude=30.0, on=False, det=_det(kind="nonfinite-pre"), effect=[1.5, "nan"]
        ),
        {
            "kind": "clean",
            "name": "clean",
            "dtype": "float32",
            "steps_run": 100,
            "triggered_replays": 1,
            "suppressed": 0,
            "detected": None,
        },
    ]
    rows = tally(results)
    assert [(r["kind"], r["label"]) for r in rows] == [
        ("backward-scale", "1000"),
        ("backward-scale", "1e-06"),
        ("forward-bitflip-fp32", "bit30"),
    ]
    big = rows[0]
    assert big["on"] == {
        "runs": 2,
        "caught": 2,
        "rate": 1.0,
        "caught_replay": 2,
        "triggered": 1,
        "caught_nonfinite": 0,
        "late": 0,
        "escaped": 0,
    }
    assert (big["off"]["runs"], big["off"]["caught"], big["off"]["late"], big["off"]["escaped"]) == (2, 0, 1, 1)
    assert big["effect"] == {"min": 1001.0, "max": 1001.0, "nan": 0}
    assert rows[2]["effect"] == {"min": "inf", "max": "inf", "nan": 1} and rows[2]["on"]["caught_nonfinite"] == 1
    assert table_rows(rows)[0] == (
        "backward-scale",
        "1000",
        "1e+03",
        "2/2 100%",
        "1 triggered, 1 audit",
        "0/2 0%",
        "-",
        "0/1",
    )
    assert (table_rows(rows)[2][2], table_rows(rows)[2][4]) == ("inf, NaN x1", "1 non-finite")
    with pytest.raises(ConfigurationError, match="never fired"):
        tally([_result(fired=0)])


def test_clean_runs_give_triggers_per_thousand_steps_and_count_detections():
    runs = [
        {
            "kind": "clean",
            "dtype": "float32",
            "steps_run": 100,
            "triggered_replays": 1,
            "suppressed": 2,
            "detected": None,
        },
        {
            "kind": "clean",
            "dtype": "float32",
            "steps_run": 60,
            "triggered_replays": 0,
            "suppressed": 0,
            "detected": _det(),
        },
        _result(det=_det()),
    ]
    assert clean_summary(runs) == {
        "float32": {"runs": 2, "steps": 160, "triggered": 1, "suppressed": 2, "detections": 1, "per_1000_steps": 6.25}
    }


def _row(kind, m, caught, runs=3):
    cell = {"runs": runs, "caught": caught, "rate": caught / runs}
    return {"kind": kind, "perturbation": kind.split("-", 1)[1], "magnitude": m, "on": cell, "off": cell}


def test_thresholds_name_where_the_sentinels_stop_seeing_a_fault():
    rows = [_row("backward-scale", m, c) for m, c in ((1e-6, 0), (1.0, 0), (3.0, 1), (10.0, 3), (1e3, 3))]
    rows += [_row("backward-bitflip-fp32", 30.0, 3)]  # bits have no order of size: no threshold
    rows += [_row("forward-set", m, c) for m, c in ((1.0, 3), (10.0, 2), (1e30, 3))]
    assert thresholds(rows) == [
        {"kind": "backward-scale", "largest_never_caught": 1.0, "always_caught_from": 10.0},
        {"kind": "forward-set", "largest_never_caught": None, "always_caught_from": 1e30},
    ]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.sampled_from(["hit", "late", "none", "nonfinite"])), min_size=1, max_size=30)
)
def test_every_run_lands_in_exactly_one_column(runs):
    dets = {
        "hit": _det(),
        "late": _det(step=20),
        "none": None,
        "nonfinite": _det(kind="nonfinite-post", triggered=False),
    }
    (row,) = tally([_result(on=on, det=dets[what]) for on, what in runs])
    for side in ("on", "off"):
        c = row[side]
        assert c["runs"] == sum(1 for on, _ in runs if on == (side == "on"))
        assert c["caught"] + c["late"] + c["escaped"] == c["runs"]
        assert c["caught"] == c["caught_replay"] + c["caught_nonfinite"]
        assert c["rate"] == (c["caught"] / c["runs"] if c["runs"] else None)


def test_the_picture_draws_one_point_per_measured_cell_with_its_counts():
    results = [_result(det=_det()), _result(on=False)]
    results += [_result(kind="forward-scale", on=on) for on in (True, False)]
    results += [
        _result(kind="backward-zero", magnitude=math.nan, det=_det()),
        _result(kind="backward-zero", magnitude=math.nan, on=False),
    ]
    doc = {"table": tally(results), "trials": 1, "ranks": 3, "audit_every": 10}
    svg = sweep_svg(doc)
    assert svg == sweep_svg(doc)  # the same table, the same bytes
    root = ET.fromstring(svg)
    tips = sorted(c.find(f"{SVG}title").text for c in root.iter(f"{SVG}circle") if c.find(f"{SVG}title") is not None)
    assert tips == [
        "backward-scale 1000, sentinels off: 0/1 caught",
        "backward-scale 1000, sentinels on: 1/1 caught (1 by a triggered replay)",
        "backward-zero bucket, sentinels off: 0/1 caught",
        "backward-zero bucket, sentinels on: 1/1 caught (1 by a triggered replay)",
        "forward-scale 1000, sentinels off: 0/1 caught",
        "forward-scale 1000, sentinels on: 0/1 caught",
    ]
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "a tensor scaled by (1 + eps): eps" in texts and "forward, sentinels off" in texts


# --- the injector's perturbations -------------------------------------------------------------------


def test_the_new_perturbations_and_their_reported_effect():
    t = torch.tensor([0.5, -2.0, 1.0])
    assert perturb_(t, Fault(kind="backward", rank=0, step=1, factor=3.0)) == (-2.0, -6.0)
    assert t.tolist() == [1.5, -6.0, 3.0]
    assert perturb_(t, Fault(kind="backward", rank=0, step=1, set_to=1e6)) == (-6.0, 1e6)
    assert perturb_(t, Fault(kind="forward", rank=0, step=1, zero=True)) == (1e6, 0.0) and t.abs().sum() == 0
    t = torch.tensor([1.0], dtype=torch.bfloat16)
    old, new = perturb_(t, Fault(kind="backward", rank=0, step=1, bit=14))  # bf16's top exponent bit
    assert (old, new) == (1.0, math.inf)  # 1.0 has a zero mantissa: Inf (1.5 would give NaN)
    with pytest.raises(ConfigurationError, match="one way"):
        Fault(kind="backward", rank=0, step=1, bit=3, factor=2.0)
    with pytest.raises(ConfigurationError, match="does not apply"):
        Fault(kind="non-finite", rank=0, step=1, zero=True)


def test_a_zeroed_bucket_zeroes_every_gradient_of_the_bucket_that_holds_its_target():
    inj = Injector([Fault(kind="backward", rank=0, step=2, zero=True, target="b")], rank=0)
    inj.begin(2, "train")
    bucket = [torch.ones(2), torch.full((3,), 2.0)]
    other = [torch.ones(4)]
    inj.on_local_grads(["c"], other)  # not its bucket
    inj.on_local_grads(["a", "b"], bucket)
    assert [g.abs().sum().item() for g in bucket] == [0.0, 0.0] and other[0].sum().item() == 4.0
    assert inj.fired == [("backward", 2, "train")] and inj.effects == [(2.0, 0.0)]


# --- the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--trials", "3", "--svg", "a.svg"], "--trials, --svg only apply to the sweep: add --sweep"),  # 3: the default
        (["--sweep", "--kinds", "bogus"], "unknown kind 'bogus'"),
        (["--sweep", "--dir", "x"], "the sweep keeps none"),
        (["--sweep", "--svg", "x.png"], "name a .svg file"),
        (["--sweep", "--ranks", "2"], "3 ranks or more"),
    ],
)
def test_bad_sweep_options_are_one_line_and_exit_2(argv, says):
    r = CliRunner().invoke(main, ["drill", "faults", *argv])
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_tiny_sweep_through_the_cli_catches_a_large_fault_only_with_the_sentinels(tmp_path):
    svg = tmp_path / "sweep.svg"
    argv = ["drill", "faults", "--sweep", "--kinds", "backward-scale", "--magnitudes", "1e-6,1e3"]
    argv += ["--trials", "1", "--clean-steps", "30", "--json", "--svg", str(svg)]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output + r.stderr
    doc = json.loads(r.stdout)
    assert "1/5 clean float32" in r.stderr and "5/5 backward-scale 1000 sentinels off" in r.stderr  # progress
    by = {(row["label"]): row for row in doc["table"]}
    large, small = by["1000"], by["1e-06"]
    # the large one: a replay triggered by the sentinels at its own step names the faulty rank ...
    assert (large["on"]["caught"], large["on"]["triggered"]) == (1, 1)
    (run,) = [c for c in doc["cases"] if c["magnitude"] == 1e3 and c["sentinels"]]
    assert (run["detected"]["step"], run["detected"]["suspects"]) == (run["injected_step"], [run["rank"]])
    # ... and nothing catches it without them; the small one escapes both ways
    assert (large["off"]["caught"], large["off"]["escaped"]) == (0, 1)
    assert (small["on"]["escaped"], small["off"]["escaped"]) == (1, 1)
    assert doc["clean"]["float32"] == {
        "runs": 1,
        "steps": 30,
        "triggered": 0,
        "suppressed": 0,
        "detections": 0,
        "per_1000_steps": 0.0,
    }
    assert "caught = stopped at its own step" in doc["caught_means"]
    circles = list(ET.parse(svg).getroot().iter(f"{SVG}circle"))
    assert len(circles) == 4 + 4  # 2 magnitudes x sentinels on/off, and the legend's 4 marks
