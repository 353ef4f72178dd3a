"""The ring replay audit under FSDP2 / HSDP (certckpt.detect.sharded_replay): every layer's local
gradient signed at its reduce-scatter, every rank replaying its predecessor's micro-batches through
the sharded model. On 4 gloo ranks: an audited run is bit-for-bit plain FSDP (with and without
accumulation under no-sync) and its DCP checkpoints become trusted; a persistent fault on one rank
is named by its two failed comparisons; a one-time fault is arbitrated by a third rank; a replay that
cannot reproduce training, a shard dimension of size 1 and a loop without begin_micro_batch are
refused. Fast: the pure comparison and arbitration functions."""

from __future__ import annotations

import os
import struct

import pytest
import torch

from certckpt.detect import AuditOptions, Triggers
from certckpt.detect.sentinel import scalars_of
from certckpt.detect.sharded_replay import LayerDigest, arbitrate, compare_ring, signed, sync_pattern
from certckpt.detect.sharded_trigger import layer_groups, sentinels_off
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from tests.support import fsdp_cases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _run(tmp_path, world=4, target=fsdp_cases.replay_audit, **args):
    from certckpt.detect.launch import run_ranks

    args = {"store": str(tmp_path / "run"), **args}
    out = run_ranks(target, world, args, timeout=240)
    return out, Ledger(args["store"]).snapshot().events if os.path.isdir(args["store"]) else []


def _of(events, kind, outcome=None):
    return [e for e in events if e["kind"] == kind and (outcome is None or e["outcome"] == outcome)]


# --- on 4 gloo ranks ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh,micro,nosync,dropout",
    [([2, 2], 2, True, 0.0), ([4], 3, False, 0.3)],
    ids=["hsdp-2x2-accumulate-without-sync", "fsdp-4-sync-every-micro-batch-dropout"],
)
def test_audited_run_is_plain_fsdp_bit_for_bit_and_its_checkpoints_are_trusted(tmp_path, mesh, micro, nosync, dropout):
    args = {"mesh": mesh, "micro": micro, "nosync": nosync, "dropout": dropout}
    out, events = _run(tmp_path, **args, audit_every=2, steps=6, ckpt_steps=[2, 3, 4])
    for r in out:
        assert [s["applied"] and s["agreed"] and s["as_plain"] for s in r["steps"]] == [True] * 6
    replays = [e for e in _of(events, "replay") if e["details"].get("phase") != "update"]
    assert [(e["step"], e["outcome"]) for e in replays] == [(2, "pass"), (4, "pass"), (6, "pass")]
    updates = [(e["step"], e["outcome"]) for e in _of(events, "replay") if e["details"].get("phase") == "update"]
    # the optimizer step is recomputed by the next rank where no replica can check it (1-D FSDP only)
    assert updates == ([] if len(mesh) == 2 else [(2, "pass"), (4, "pass"), (6, "pass")])
    per_micro = 1 if nosync else micro  # layers reduce-scatter once per step, or after every micro-batch
    assert all(e["details"]["layers"] == 2 * per_micro and e["details"]["micro_batches"] == micro for e in replays)
    for step in (2, 4, 6):  # a full audit: replay, non-finite and consensus passed at the same step
        assert {e["kind"] for e in events if e["step"] == step and e["outcome"] == "pass"} >= {
            "replay",
            "nonfinite",
            "consensus",
        }
    status = certify_store(str(tmp_path / "run"), verify_bytes=True, write_certificates=False)
    verdicts = {k: (v.trusted, v.reasons) for k, v in status.certification.verdicts.items()}
    assert verdicts == {"main@2": (True, ()), "main@3": (True, ()), "main@4": (True, ())}
    assert status.certification.latest_good == "main@4"
    (record,) = [r for r in [Ledger(str(tmp_path / "run")).snapshot().records["main@4"]]]
    assert record["url"] == "step4"


@pytest.mark.slow
def test_a_persistent_fault_on_one_rank_fails_both_its_comparisons_and_is_named(tmp_path):
    fault = {"kind": "persistent", "rank": 1, "step": 3}
    out, events = _run(tmp_path, mesh=[4], audit_every=3, steps=4, fault=fault, on_fault="raise")
    for r in out:  # every rank raised at step 3, before its optimizer step, naming rank 1
        assert [s["step"] for s in r["steps"]] == [1, 2]
        assert r["raised"]["type"] == "FaultDetectedError" and r["raised"]["suspects"] == [1]
        assert "replay audit failed (rank(s) [1])" in r["raised"]["message"]
    assert len({r["raised"]["incident"] for r in out}) == 1
    (ev,) = _of(events, "replay", "fail")
    assert ev["step"] == 3 and ev["suspect_ranks"] == [1] and ev["contained"] is False
    # rank 1 replayed rank 0 wrongly, and rank 2's replay of rank 1 disagrees with what rank 1 trained
    assert ev["details"]["failed"] == [{"origin": 0, "replayer": 1}, {"origin": 1, "replayer": 2}]
    assert ev["details"]["arbitration"] == {} and ev["details"]["arbitrated"] is False
    assert set(ev["details"]["mismatched"]["1->2"]) == {"0", "2"}  # the layers named by their module path
    # the precondition passed: the replicas held the same weights, so the replay could be trusted
    (pre,) = [e for e in _of(events, "consensus") if e["details"].get("found_by") == "replay precondition"]
    assert pre["outcome"] == "pass" and pre["step"] == 2
    assert Ledger(str(tmp_path / "run")).snapshot().open_incidents()


@pytest.mark.slow
def test_a_one_time_fault_is_arbitrated_by_a_third_rank_and_the_run_goes_on(tmp_path):
    fault = {"kind": "transient", "rank": 2, "step": 2}
    out, events = _run(tmp_path, mesh=[2, 2], audit_every=2, steps=4, fault=fault)
    for r in out:
        assert [s["applied"] for s in r["steps"]] == [True, False, True, True]  # step 2's update dropped
        assert all(s["agreed"] for s in r["steps"])
    fail, later = _of(events, "replay")
    assert fail["step"] == 2 and fail["outcome"] == "fail" and fail["suspect_ranks"] == [2]
    assert fail["details"]["failed"] == [{"origin": 2, "replayer": 3}]
    # rank 0 (after the replayer) recomputed rank 2's micro-batch and agreed with rank 3's replay
    assert fail["details"]["arbitration"] == {"2->3": "replayer"} and fail["details"]["arbitrated"] is True
    assert later["step"] == 4 and later["outcome"] == "pass"


@pytest.mark.slow
def test_a_wrong_optimizer_step_on_a_1d_mesh_is_caught_by_the_update_replay_and_arbitrated(tmp_path):
    # no replicas: the consensus compares nothing, and every rank all-gathers the wrong shard alike
    fault = {"kind": "update", "rank": 1, "step": 4}
    out, events = _run(tmp_path, mesh=[4], audit_every=2, steps=5, fault=fault)
    assert all(all(s["agreed"] for s in r["steps"]) for r in out)  # the consensus never noticed
    _check_update_failure(tmp_path, events)


@pytest.mark.slow
def test_on_two_replicas_the_update_replay_names_the_rank_a_consensus_tie_cannot(tmp_path):
    fault = {"kind": "update", "rank": 1, "step": 4}
    out, events = _run(tmp_path, mesh=[2, 2], audit_every=2, steps=4, fault=fault, audit_updates=True)
    (tie,) = [e for e in events if e["kind"] == "consensus" and e["outcome"] == "fail"]
    assert tie["step"] == 4 and tie["suspect_ranks"] == [] and tie["details"]["candidates"] == [1, 3]
    _check_update_failure(tmp_path, events)


def _check_update_failure(tmp_path, events):
    (ev,) = [e for e in events if e["outcome"] == "fail" and e["kind"] == "replay"]
    assert ev["kind"] == "replay" and ev["details"]["phase"] == "update" and ev["step"] == 4
    assert ev["suspect_ranks"] == [1] and ev["contained"] is False  # the update was applied
    assert ev["details"]["failed"] == [{"origin": 1, "replayer": 2}]
    assert ev["details"]["mismatched"] == {"1->2": ["0.weight"]}
    # rank 3 recomputed rank 1's step too and agreed with rank 2's recomputation
    assert ev["details"]["arbitration"] == {"1->2": "replayer"}
    assert Ledger(str(tmp_path / "run")).snapshot().open_incidents()


@pytest.mark.slow
def test_non_finite_local_gradients_are_named_before_the_reduce_scatter(tmp_path):
    fault = {"kind": "nan", "rank": 3, "step": 2}
    out, events = _run(tmp_path, mesh=[2, 2], audit_every=5, steps=3, fault=fault)
    for r in out:  # every rank raised at step 2 (on_nonfinite="raise"), naming rank 3
        assert [s["step"] for s in r["steps"]] == [1]
        assert r["raised"]["type"] == "FaultDetectedError" and r["raised"]["suspects"] == [3]
        assert "non-finite local gradients on rank(s) [3] before the reduce-scatter" in r["raised"]["message"]
    (ev,) = [e for e in events if e["outcome"] == "fail"]
    assert ev["kind"] == "nonfinite-pre" and ev["step"] == 2 and ev["contained"] is True
    # the reduce-scatter spread rank 3's NaN into every rank's reduced shard; only rank 3's own was bad
    assert ev["details"]["pre_ranks"] == [3] and ev["details"]["post_ranks"] == [0, 1, 2, 3]
    assert not Ledger(str(tmp_path / "run")).snapshot().open_incidents()  # contained: the update was dropped


@pytest.mark.slow
def test_a_replay_that_cannot_reproduce_training_is_refused_at_the_first_step(tmp_path):
    out, events = _run(tmp_path, mesh=[4], audit_every=2, steps=2, replay_scale=2.0)
    for r in out:  # loss_fn computes twice the loss the loop back-propagates
        assert r["steps"] == [] and r["raised"]["type"] == "AuditSetupError"
        assert "the replay check refused on every rank; rank(s) [0, 1, 2, 3]" in r["raised"]["message"]
        assert "signs other local gradients than training did (layers ['0', '2'])" in r["raised"]["message"]
    assert not _of(events, "replay")


@pytest.mark.slow
def test_a_shard_dimension_of_one_a_loop_without_begin_micro_batch_and_a_replaced_reduce_scatter_are_refused(tmp_path):
    out, _ = _run(tmp_path, mesh=[4, 1], audit_every=2, steps=1)
    assert all("not sharded over 2 or more ranks" in r["setup_error"] for r in out)
    out, _ = _run(tmp_path, world=2, target=fsdp_cases.forgotten_begin)
    assert all("call session.begin_micro_batch(unit) before each micro-batch" in r["error"] for r in out)
    out, _ = _run(tmp_path, world=2, target=fsdp_cases.replaced_reduce_scatter, when="after")
    for r in out:  # an audit with nothing signed would compare two empty lists and pass: refused
        assert r["step"] == 2 and "the replay audit refused on every rank" in r["error"]
        assert "no reduce-scatter was signed" in r["error"]


# Every step flagged (any spread is an outlier on both tests, from the first step), one replay in two.
EAGER = {"mad_threshold": 1e-9, "band": 1e-9, "floor": 1e-9, "warmup_steps": 1, "min_interval": 2}


@pytest.mark.slow
def test_sentinels_replay_the_step_of_a_large_backward_fault_between_audits_and_clean_triggers_pass(tmp_path):
    """One world of 3 ranks on a 1-D FSDP2 mesh, audits every 10 steps: a clean run of 13 steps
    (default triggers), a run whose every step is flagged (accumulation without sync), and a
    backward fault scaling rank 1's largest local gradient element by about 1e3 at step 13."""
    from certckpt.detect.launch import run_ranks

    fault = {"kind": "backward", "rank": 1, "step": 13, "scale": 1e3}
    scenarios = {
        "clean": {"store": str(tmp_path / "clean"), "steps": 13},
        "eager": {
            "store": str(tmp_path / "eager"),
            "steps": 5,
            "micro": 2,
            "nosync": True,
            "triggers": EAGER,
            "ckpt_steps": [4],
        },
        "fault": {"store": str(tmp_path / "fault"), "steps": 14, "faults": [fault], "on_fault": "raise"},
    }
    args = {"mesh": [3], "audit_every": 10, "scenarios": scenarios}
    out = run_ranks(fsdp_cases.triggered_world, 3, args, timeout=240)
    events = {name: Ledger(sc["store"]).snapshot().events for name, sc in scenarios.items()}

    # clean: nothing detected, every update applied and bit-for-bit plain FSDP; the triggers that
    # fired (if any) were clean replays
    clean = [r["clean"] for r in out]
    assert all(s["applied"] and s["as_plain"] for r in clean for s in r["steps"]) and len(clean[0]["steps"]) == 13
    assert not [e for e in events["clean"] if e["outcome"] == "fail"]
    triggered = [e["step"] for e in _of(events["clean"], "triggered-replay")]
    assert clean[0]["sentinels"]["off"] is None
    assert clean[0]["sentinels"]["names"] == ["grad_norm", "group0_norm", "group1_norm"]  # layers 0 and 2
    assert len(triggered) == clean[0]["sentinels"]["triggered"]
    print(f"clean run: {len(triggered)} triggered replay(s) in 13 steps at {triggered}")

    # every step flagged: replays at steps 1, 3 and 5 (the rate limit), each clean; the sums of
    # squares a neighbour recomputes equal the trained ones exactly, sync pattern included
    eager = [r["eager"] for r in out]
    assert all(s["applied"] and s["as_plain"] for r in eager for s in r["steps"])
    passes = _of(events["eager"], "triggered-replay", "pass")
    assert [e["step"] for e in passes] == [1, 3, 5] and not [e for e in events["eager"] if e["outcome"] == "fail"]
    assert passes[1]["details"]["compared"] == "sum of squares per layer"
    assert passes[1]["details"]["layers"] == 2 and passes[1]["details"]["micro_batches"] == 2
    assert passes[1]["details"]["trigger"]["suppressed_before"] == 1
    assert eager[0]["sentinels"]["suppressed"] == 2
    # coverage reports them on their own, as under DDP: each vouches for its own step only
    window = certify_store(scenarios["eager"]["store"], write_certificates=False).coverage()["main@4"].window
    assert window.triggered_steps == [1, 3] and window.replay_steps == {}

    # the fault: replayed at its own step, before its update, and rank 1 named by arbitration
    for r in out:
        f = r["fault"]
        assert [s["step"] for s in f["steps"]] == list(range(1, 13))
        assert f["raised"]["type"] == "FaultDetectedError" and f["raised"]["suspects"] == [1]
    assert len({r["fault"]["raised"]["incident"] for r in out}) == 1
    (ev,) = [e for e in events["fault"] if e["outcome"] == "fail"]
    assert ev["kind"] == "replay" and ev["step"] == 13 and ev["suspect_ranks"] == [1]
    assert ev["details"]["trigger"]["flagged"] == [1]
    assert ev["details"]["failed"] == [{"origin": 1, "replayer": 2}]
    assert ev["details"]["mismatched"] == {"1->2": ["0"]}  # the layer the fault hit, by module path
    assert ev["details"]["arbitration"] == {"1->2": "replayer"}
    assert not _of(events["fault"], "triggered-replay", "pass") or all(
        e["step"] < 13 for e in _of(events["fault"], "triggered-replay")
    )


# --- pure functions -------------------------------------------------------------------------------


def _lists(*rows):
    return [[[m, layer, v] for m, layer, v in row] for row in rows]


def test_compare_ring_names_failed_pairs_and_the_layers_that_differ():
    trained = _lists([(0, "b", 1), (0, "a", 2)], [(0, "b", 3), (0, "a", 4)], [(0, "b", 5), (0, "a", 6)])
    good = [trained[2], trained[0], trained[1]]  # rank r replays rank r - 1
    assert compare_ring(trained, good).passed
    bad = [trained[2], [[0, "b", 1], [0, "a", 99]], trained[1]]
    result = compare_ring(trained, bad)
    assert result.failed == ((0, 1),) and result.mismatched == {"0->1": ["a"]}
    misaligned = [trained[2], [[0, "b", 1]], trained[1]]  # a layer missing: the sequences do not line up
    assert compare_ring(trained, misaligned).mismatched == {"0->1": ["*"]}


def test_arbitrate_says_which_side_the_third_rank_agrees_with():
    trained = _lists([(0, "x", 1)], [(0, "x", 2)], [(0, "x", 3)], [(0, "x", 4)])
    replayed = [trained[3], [[0, "x", 9]], trained[1], trained[2]]  # rank 1's replay of rank 0 is off
    # the arbiter of (0, 1) is rank 2, whose replay (two hops) recomputes rank 0's micro-batch
    assert arbitrate(4, [(0, 1)], trained, replayed, [None, None, trained[0], None]) == {(0, 1): "origin"}
    assert arbitrate(4, [(0, 1)], trained, replayed, [None, None, [[0, "x", 9]], None]) == {(0, 1): "replayer"}
    assert arbitrate(4, [(0, 1)], trained, replayed, [None, None, [[0, "x", 7]], None]) == {(0, 1): "neither"}
    assert arbitrate(2, [(0, 1)], trained[:2], replayed[:2], [None, None]) == {}  # two ranks: no third


def test_sync_pattern_lists_the_layers_that_reduced_after_each_micro_batch():
    calls = [LayerDigest(0, "2", 1), LayerDigest(2, "2", 5), LayerDigest(2, "0", 6)]
    assert sync_pattern(calls) == {0: {"2"}, 2: {"2", "0"}}


@pytest.mark.slow
def test_a_reduce_scatter_the_user_installed_before_the_session_keeps_communicating(tmp_path):
    out, _ = _run(tmp_path, world=2, target=fsdp_cases.replaced_reduce_scatter, when="before")
    for r in out:  # 2 layers x 2 steps through the user's collective (the replays communicate nothing)
        assert r["error"] is None and r["own_calls"] == 4
    assert out[0]["replays"] == [["gradients", "pass"], ["update", "pass"]]  # rank 0 publishes the events


def test_layers_are_grouped_consecutively_into_at_most_max_groups():
    layers = [f"layers.{i}" for i in range(10)]
    groups = layer_groups(layers, 4)
    assert [groups[x] for x in layers] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert layer_groups(["0", "2"], 8) == {"0": 0, "2": 1}  # fewer layers than groups: one each
    assert layer_groups([], 8) == {}


def test_sums_of_squares_are_compared_by_their_bits_so_nan_equals_itself():
    nan = torch.tensor(float("nan"))
    calls = [(0, "2", torch.tensor(4.0)), (0, "0", nan), (1, "0", torch.tensor(-0.0))]
    got = signed(calls)
    assert [(d.micro, d.layer) for d in got] == [(0, "2"), (0, "0"), (1, "0")]
    assert got[0].value == struct.unpack("<i", struct.pack("<f", 4.0))[0]
    assert signed(calls) == got  # a NaN sum compares equal to the same NaN (float == would not)
    assert got[2].value != signed([(1, "0", torch.tensor(0.0))])[0].value  # and -0.0 is not 0.0
    digests = [(0, "x", torch.tensor(123, dtype=torch.int64))]
    assert signed(digests)[0].value == 123  # a digest as it is


def test_the_exchanged_squares_become_norms_and_the_flags_are_skipped():
    table = [[0.0, 1.0, 16.0, 9.0, 2.5], [0.0, 0.0, float("nan"), -1.0, 2.0]]
    assert scalars_of(table, ("grad_norm", "group0_norm", "loss"), skip=2) == [
        [4.0, 3.0, 2.5],
        pytest.approx([float("nan"), -1.0, 2.0], nan_ok=True),
    ]


def test_the_sharded_sentinels_are_off_without_loss_fn_or_with_deferred_reads_and_say_why():
    assert sentinels_off(AuditOptions(), replays=True) is None
    assert "no loss_fn" in sentinels_off(AuditOptions(), replays=False)
    assert "deferred" in sentinels_off(AuditOptions(nonfinite_read="deferred"), replays=True)
    assert "turned off" in sentinels_off(AuditOptions(triggers=Triggers(enabled=False)), replays=True)


def test_the_sharded_session_plants_only_the_faults_it_has_a_place_for():
    from certckpt.detect import Fault
    from certckpt.detect.sharded import _faults_problem

    assert _faults_problem([Fault(kind="backward", rank=1, step=3)], replays=True) is None
    assert "only forward, backward, non-finite" in _faults_problem(
        [Fault(kind="post-optimizer", rank=0, step=1)], replays=True
    )
    assert "needs loss_fn" in _faults_problem([Fault(kind="forward", rank=0, step=1)], replays=False)
