"""Training-loop shapes under the auditor, on 3 gloo ranks: accumulation, clipping, set-up refusals."""

import pytest

from certckpt.detect.launch import run_ranks
from tests.support import loop_cases

pytestmark = pytest.mark.slow


def ranks(fn, world, args=None, timeout=300):
    return run_ranks(fn, world, args or {}, timeout=timeout)


def test_accumulation_and_clipping_train_like_plain_ddp_and_detect():
    out = ranks(loop_cases.accumulation_and_clipping, 3)
    assert out[0]["nonfinite"]["suspects"] == [[4, "nonfinite-pre", [2]]]  # rank 0 emits the events
    for rank, res in enumerate(out):
        for view in (False, True):
            case = res[f"accumulate_view={view}"]
            # micro-batches under no_sync, loss / n, averaged in the all-reduce as DDP does: the same bits
            assert case["bit_equal"], (rank, view)
            assert case["replays"] == [["replay", "pass"]] and case["failures"] == []
            assert case["loss_is_mean"]
        shared = res["shared_gradient"]  # two parameters handed one gradient tensor: replayed apart
        assert shared == {"bit_equal": True, "replays": [["replay", "pass"]], "failures": []}, (rank, shared)
        for name in ("clip", "clip+transform"):
            assert res[name]["bit_equal"] and res[name]["clipped"], (rank, name)
            assert res[name]["failures"] == []
        assert res["clip_one_batch_max_diff"] < 1e-6  # the averaging folded into the loss: within rounding
        assert res["clean_100"] == {"failures": [], "replay_passes": 10, "last_clean_audit": 100}
        # the persistent fault from step 13 on rank 1 is caught by the audit at 20, rank 1 named
        assert res["fault"] == [20, "replay", [1], 3]
        assert res["sampled"] == {"bit_equal": True, "failures": [], "last_clean": 30, "fault": [20, "replay", [1]]}
        assert res["nonfinite"]["failures"] == [[4, "nonfinite-pre"]]
        assert res["nonfinite"]["applied"] == [True, True, True, False, True, True]


def test_set_up_refusals_are_collective_and_the_same_on_every_rank():
    out = ranks(loop_cases.collective_refusals, 3)
    for name in (
        "bad_option_on_one_rank",
        "not_ddp_on_one_rank",
        "settings_differ",
        "python_random",
        "unshippable_on_one_rank",
        "replay_path_differs",
    ):
        got = [res[name] for res in out]
        assert all(g is not None for g in got), name  # every rank raised ...
        assert all(g == got[0] for g in got), (name, got)  # ... the same error, the same message
    kind, msg = out[0]["bad_option_on_one_rank"]
    assert kind == "AuditSetupError" and "rank(s) [1]" in msg and "mode must be" in msg
    kind, msg = out[0]["not_ddp_on_one_rank"]
    assert kind == "AuditSetupError" and "rank(s) [2]" in msg and "DistributedDataParallel" in msg
    kind, msg = out[0]["settings_differ"]
    assert kind == "AuditSetupError" and "[0] vs [1, 2]" in msg
    kind, msg = out[0]["python_random"]
    assert kind == "AuditSetupError" and "rank(s) [1, 2]" in msg
    for cause in ("Python's random", "numpy.random", "use_deterministic_algorithms", "mode='tolerance'"):
        assert cause in msg, cause
    kind, msg = out[0]["replay_path_differs"]
    assert kind == "AuditSetupError" and "rank(s) [0, 1, 2]" in msg and "DDP(torch.compile(model))" in msg
    kind, msg = out[0]["unshippable_on_one_rank"]
    assert kind == "UnsupportedObjectError" and "rank(s) [1]" in msg and "obj['batch'][1]['x']" in msg


def test_compiled_models_in_either_order_train_like_plain_ddp_and_detect():
    out = ranks(loop_cases.compiled_models, 3)
    for res in out:
        for order in ("compile(DDP)", "DDP(compile)"):
            case = res[order]
            assert case["bit_equal_at_10"] and case["failures_to_10"] == [], order  # no_sync honoured, no alarm
            assert case["caught"] == [15, "replay", [2]], order


def test_amp_overflows_are_the_scalers_business_and_faults_still_detections():
    out = ranks(loop_cases.amp_loops, 3)
    for res in out:
        # the scaler's overflow steps are skipped and back the scale off exactly as in plain DDP + GradScaler
        assert res["skipped_plain"] and res["overflow_steps"] == res["skipped_plain"]
        assert res["bit_equal_at_34"] and res["scales_at_34"][0] == res["scales_at_34"][1]
        assert res["failures_to_34"] == []  # no overflow was a detection
        # a NaN on rank 1 that its neighbour recomputes finite is a detection, and the scale stays
        assert res["scale_kept_at_fault"]
        assert res["failures"] == [[35, "nonfinite-pre"], [50, "replay"]]
        assert res["caught"] == [50, "replay", [2]]  # replays keep auditing under AMP
        assert res["bf16"] == {"failures": [], "last_clean_audit": 20}
    assert out[0]["suspects"][0] == [35, "nonfinite-pre", [1]]
    assert all(pre and shrank for _, pre, shrank in out[0]["overflow_events"])


def test_buffers_join_the_consensus_and_the_checkpoint_fingerprints(tmp_path):
    out = ranks(loop_cases.buffers, 3, {"dir": str(tmp_path)})
    for res in out:
        assert res["bit_equal_at_20"]
        assert res["clean_100"] == {
            "failures": [],
            "buffers": ["shift", "bn.running_mean", "bn.running_var"],
            "last_clean": 100,
        }
        # rank 0 corrupts its running_var after step 25; DDP broadcasts it at 26; the consensus at 30
        # names rank 0 (its buffers changed outside a forward, before DDP's broadcast)
        step, kind, suspects, tensors = res["bn_fault"]
        assert (step, kind, suspects) == (30, "consensus", [0])
        assert tensors == ["bn.running_var (changed on the broadcast source outside a forward)"]
        # the forward reads `shift`, so rank 2's replay at 20 fails first; its precondition, the
        # consensus on the weights and buffers of step 19, names rank 2 and the buffer
        assert res["no_broadcast"] == {"buffers": ["shift"], "caught": [19, "consensus", [2], ["shift"]]}
    ckpt = out[0]["ckpt"]
    assert ckpt["verifies"]  # the buffers' reused fingerprints are the true ones
    assert {"bn.running_mean", "bn.running_var", "shift"} <= set(ckpt["consensus_tensors"])
