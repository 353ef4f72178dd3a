"""Detection hooks in real torch.distributed processes (gloo on 127.0.0.1, CPU)."""

import os

import pytest

import certckpt
from certckpt.detect.drill import matrix_cases, run_matrix
from certckpt.detect.launch import run_ranks
from certckpt.format.record import state_fingerprint
from tests.support import ddp_cases
from tests.support.helpers import ROOT

pytestmark = pytest.mark.slow


def ranks(fn, world, args=None, timeout=180):
    return run_ranks(fn, world, args or {}, timeout=timeout)


def test_fault_matrix_on_three_ranks(tmp_path):
    m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=str(tmp_path / "drill"))
    assert len(m["cases"]) == 15  # 4 kinds x 3 timings, and large one-time faults between audits (3 cases)
    for c in m["cases"]:
        where = f"{c['fault']}/{c['timing']}/{c.get('magnitude', 'small')}"
        assert c["fired"] >= 1, where  # the fault really happened
        assert (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"]), (
            where
        )
        if c["caught_by"] is not None:
            assert c["suspect_ranks"] == [1], where
            assert c["updates_before_detection"] == c["detected_step"] - c["injected_step"]
    by = {(c["fault"], c["timing"]): c for c in m["cases"] if "magnitude" not in c}
    large = {c["fault"]: c for c in m["cases"] if c.get("magnitude") == "large" and not c.get("saturated")}
    # the designed outcomes, spelled out
    assert (
        by[("backward", "persistent")]["caught_by"] == "replay"
        and by[("backward", "persistent")]["detected_step"] == 20
    )
    assert by[("forward", "persistent")]["caught_by"] == "replay"
    assert by[("post-optimizer", "persistent")]["caught_by"] == "consensus"
    assert by[("non-finite", "one-time-between-audits")]["caught_by"] == "nonfinite-pre"
    assert by[("forward", "one-time-between-audits")]["caught_by"] is None  # the documented escape
    assert by[("backward", "one-time-between-audits")]["caught_by"] is None
    # large ones between audits: the sentinels flag the step, the replay runs there and names rank 1
    for kind in ("forward", "backward"):
        c = large[kind]
        assert (c["caught_by"], c["triggered"], c["detected_step"]) == ("replay", True, c["injected_step"]), kind
        assert c["updates_before_detection"] == 0 and c["suspect_ranks"] == [1], kind
    # the same large forward fault before the Tanh, which saturates: too small a change for the sentinels
    (saturated,) = [c for c in m["cases"] if c.get("saturated")]
    assert saturated["caught_by"] is None
    # run stores are kept for the other commands: checkpoints verify, events are there
    store = by[("backward", "persistent")]["store"]
    path = store[len("file://") :]
    assert os.path.exists(os.path.join(path, "events.jsonl"))
    assert certckpt.verify(os.path.join(path, "step000015.safetensors"), deep=True).ok


def test_two_ranks_detect_without_attribution():
    cases = [
        c
        for c in matrix_cases(audit_every=10, ckpt_every=5, rank=1)
        if (c["fault"], c["timing"])
        in {("backward", "persistent"), ("forward", "one-time-audit-step"), ("post-optimizer", "persistent")}
    ]
    m = run_matrix(ranks=2, cases=cases)
    for c in m["cases"]:
        assert c["caught_by"] == c["expected"]["caught_by"] and c["detected_step"] == c["expected"]["detected_step"], c
        assert c["suspect_ranks"] == [], c
    replay = [c for c in m["cases"] if c["caught_by"] == "replay"]
    assert all(any("needs >= 3 ranks" in n for n in c["notes"]) for c in replay)


def test_single_rank_replay_catches_only_transient_faults():
    cases = [
        c
        for c in matrix_cases(audit_every=10, ckpt_every=5, rank=0)
        if c["fault"] == "backward" and c["timing"] in ("persistent", "one-time-audit-step")
    ]
    m = run_matrix(ranks=1, cases=cases)
    by = {c["timing"]: c for c in m["cases"]}
    assert by["one-time-audit-step"]["caught_by"] == "replay" and by["one-time-audit-step"]["suspect_ranks"] == [0]
    assert any("transient faults only" in n for n in by["one-time-audit-step"]["notes"])
    assert by["persistent"]["caught_by"] is None  # the fault reproduces itself in the replay: the documented limit


def test_tolerance_mode_and_reduction_faults():
    cases = [
        c
        for c in matrix_cases(audit_every=10, ckpt_every=5)
        if c["fault"] == "backward" and c["timing"] == "persistent"
    ]
    cases.append({"fault": "reduction", "timing": "one-time-between-audits", "rank": -1, "injected_step": 7})
    m = run_matrix(ranks=3, cases=cases, mode="tolerance")
    assert m["mode"] == "tolerance"
    back, red = m["cases"]
    assert (back["caught_by"], back["detected_step"], back["suspect_ranks"]) == ("replay", 20, [1])
    # every local gradient finite, the reduced ones non-finite: the reduction is blamed, no rank named
    assert (red["caught_by"], red["detected_step"], red["suspect_ranks"]) == ("nonfinite-post", 7, [])


def test_grads_are_handed_over_only_where_that_is_what_ddp_would_produce():
    for res in ranks(ddp_cases.hand_over_conditions, 2):
        # a parameter outside the optimizer is cleared by the auditor's own zero_grad, so its
        # gradient is still one step's (the replays agree) and it can be handed over too
        for name in ("default", "optimizer_owns_part"):
            assert res[name]["hand_over"] is True and all(res[name]["views"]), name
        # opted out, or unused parameters possible: DDP copies, as without the auditor
        for name in ("opted_out", "find_unused"):
            assert res[name]["hand_over"] is False, name
            assert not any(res[name]["views"]), name
        assert res.pop("guard") == {"intact_after_step": True, "intact_after_reset": False}
        for case in res.values():
            assert case["outcomes"] == [["consensus", "pass"], ["nonfinite", "pass"], ["replay", "pass"]]


@pytest.mark.parametrize(
    ("view", "model"),
    [(False, "mlp"), (True, "mlp"), (False, "conv-channels-last")],
    ids=["grad-copies", "bucket-views", "channels-last-conv"],
)
def test_the_hook_averages_like_plain_ddp(view, model):
    out = ranks(ddp_cases.trains_like_plain_ddp, 3, {"view": view, "model": model})
    for res in out:
        # bucket views force the eager pre-reduce check; gradient copies on CPU allow the lazy one
        assert res["eager_pre"] is view
        # with gradient copies the callback hands each .grad its view of the reduced bucket (DDP's
        # copy skipped); with bucket views DDP already does
        assert res["hand_over"] is not view
        assert all(res["grad_is_bucket_view"])
        # a channels_last weight's gradient keeps its layout (DDP's layout contract), and its local
        # signature is taken in that layout: the replays agree, no false alarm
        assert all(res["channels_last_grads"]) and len(res["channels_last_grads"]) == (2 if model != "mlp" else 0)
        assert res["audits"] == 2  # replays scale their loss as training does: both pass
        assert res["outcomes"] == [["consensus", "pass"], ["nonfinite", "pass"], ["replay", "pass"]]
        assert max(res["grad_diffs"]) < 1e-6  # averaged, not summed: the sum would be 3x
        assert res["weight_diff"] < 1e-6
        for plain_loss, audited_loss in res["losses"]:
            assert audited_loss == pytest.approx(plain_loss, rel=1e-5)  # the unscaled loss is returned


@pytest.mark.parametrize("view", [False, True], ids=["lazy-pre-check", "eager-pre-check"])
def test_nonfinite_names_the_rank_with_lazy_and_eager_pre_checks(view):
    out = ranks(ddp_cases.nonfinite_attribution, 3, {"view": view})
    for res in out:
        assert res["eager_pre"] is view
    # rank 1's Inf is named before the all-reduce; a reduction delivering NaN to all names no rank
    assert out[0]["events"] == [[2, "nonfinite-pre", [1], [1]], [5, "nonfinite-post", [], []]]


@pytest.mark.parametrize("world", [2, 3])
def test_ring_shift_delivers_the_previous_ranks_payload_intact(world):
    for res in ranks(ddp_cases.ring_shift_payloads, world):
        assert res["same"] == {k: True for k in res["same"]} and len(res["same"]) == 9


def test_replay_signs_tied_weights_once_and_unused_parameters_as_zeros():
    out = ranks(ddp_cases.replay_tied_and_unused, 3)
    for res in out:
        # steps 2 and 4 audit clean (the shared weight's summed gradient, the spare's zeros), then the
        # persistent fault on rank 2 is caught at step 6 in exactly the tensor it corrupts
        assert ["replay", "pass"] in res["outcomes"] and ["consensus", "pass"] in res["outcomes"]
        step, kind, suspects, mismatched = res["caught"]
        assert (step, kind, suspects) == (6, "replay", [2])
        assert set(mismatched) == {"2->0", "1->2"} and all(v == ["inp.weight"] for v in mismatched.values())


def test_every_step_flag_exchange_contains_a_reduction_fault_seen_by_one_rank():
    out = ranks(ddp_cases.one_rank_reduction_fault, 3)
    for res in out:
        assert res["applied"] == [True, False, True, True, True, True]  # every rank dropped step 2
        assert res["consensus"]  # so the replicas still agree
    assert out[0]["events"] == [[2, "nonfinite-post", [], [1]]]


def test_setup_errors_are_clear_and_early():
    out = ranks(ddp_cases.setup_errors, 3)
    for res in out:
        assert "DistributedDataParallel" in res["not_ddp"]
        assert "disagree on parameters or audit settings" in res["mismatch"]
        assert (
            "differ between two identical computations" in res["nondeterministic"]
            and "mode='tolerance'" in res["nondeterministic"]
        )
        assert "obj['batch']['sampler']:" in res["unshippable"]


def test_checkpoint_through_the_auditor_carries_lineage_and_reuses_fingerprints(tmp_path):
    out = ranks(ddp_cases.checkpoint_lineage, 3, {"dir": str(tmp_path)})
    r0 = out[0]
    assert r0["saved"] and not out[1]["saved"]
    # the weights were fingerprinted once, for consensus; the writer only fingerprinted the rest
    assert sum(r0["fingerprinted"]) == 2 * r0["params"] - r0["params"]  # momentum buffers only
    rec = certckpt.inspect(tmp_path / "step10.safetensors").record
    assert (rec.run, rec.step, rec.step_range, rec.branch) == ("lin", 10, [1, 10], "main")
    lineage = rec.lineage
    assert lineage["last_clean_audit"] == 10 and lineage["audit_every"] == 5 and lineage["world"] == 3
    assert {(a["step"], a["kind"], a["outcome"]) for a in lineage["audits"]} >= {
        (5, "replay", "pass"),
        (10, "consensus", "pass"),
        (10, "nonfinite", "pass"),
    }
    mapping = lineage["consensus"]["tensors"]
    fps = {p: rec.tensors[t]["fp"] for p, t in mapping.items()}
    assert fps == r0["consensus"]
    assert state_fingerprint(fps) == rec.consensus_fp == lineage["consensus"]["fp"]
    assert certckpt.verify(tmp_path / "step10.safetensors", deep=True).ok  # reused fingerprints are the true ones


def test_skip_policy_contains_a_non_finite_step():
    out = ranks(ddp_cases.skip_policy, 3)
    for res in out:
        assert res["applied"] == [True, True, False, True, True, True, True, True]
        assert res["consensus"] and res["finite"]
    assert out[0]["events"] == [[3, "nonfinite-pre", "fail", [2], True]]


@pytest.mark.parametrize("view", [False, True])  # lazy and eager pre-reduce checks
def test_deferred_nonfinite_reads_detect_one_step_late_and_never_vouch_for_an_unread_step(tmp_path, view):
    out = ranks(ddp_cases.deferred_read, 3, {"view": view, "dir": str(tmp_path)})
    immediate, deferred = out[0]["checked"]  # rank 0 emits the events
    assert immediate == deferred == [[4, 4], [8, 4]]  # every step checked before each audit's evidence
    for res in out:
        assert res["equal"]  # a deferred read changes no clean step
        # the NaN of rank 1's step 6 reaches the weights (the update was applied) ...
        assert res["step6_applied"] is True and res["weights_finite_after_6"] is False
        # ... and step 7 raises, naming rank 1 and step 6, and drops step 7's update
        step, kind, suspects, read, detected_at, message = res["raised"]
        assert (step, kind, suspects, read, detected_at) == (6, "nonfinite-pre", [1], "deferred", 7)
        assert "step 6's update was applied" in message and "latest good checkpoint" in message
        assert res["step7_applied"] is False
        assert res["contained"] is False  # step 6's update reached the weights: not a contained detection
        # on a consensus step the flags are read before the update: caught at once, contained, weights finite
        assert res["on_consensus_step"] == [6, 6, True, None] and res["finite_after_consensus_step"]
        # a checkpoint right after an unread non-finite step: refused on every rank, nothing written
        assert res["save"] == [6, [2]] and res["file_exists"] is False
        assert res["closed_quietly"]
        assert res["refusals"][0] is not None and "on_nonfinite='raise'" in res["refusals"][0]
        assert res["refusals"][1] is not None and "grad_scaler" in res["refusals"][1]
        assert res["refusals"][2] is not None and "every-step" in res["refusals"][2]
        assert res["refusals"][3] is not None and "'immediate' or 'deferred'" in res["refusals"][3]


def test_deferred_reads_at_the_hook_points_of_a_users_loop():
    for res in ranks(ddp_cases.deferred_hook_points, 3):
        assert res["bit_equal"]
        # raised in step 7's before_update, about step 6, naming rank 2
        assert res["raised"] == [7, 6, "nonfinite-pre", [2], "deferred", 7]


def test_raise_policy_stops_before_the_update_with_evidence():
    out = ranks(ddp_cases.raise_detected, 3)
    for res in out:
        assert res["step"] == 5 and res["kind"] == "replay" and res["suspects"] == [0]
        assert res["update_dropped"] and "replay audit failed" in res["message"]
        assert res["inventory_ranks"] == ["0", "1", "2"]


def test_readme_example_runs_as_written(tmp_path):
    import subprocess
    import sys

    from certckpt.detect.launch import free_port

    root = str(ROOT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "3",
            "--master-port",
            str(free_port()),
            os.path.join(root, "examples", "audited_ddp.py"),
            "--dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "last clean audit at step 40" in out.stdout
    assert certckpt.verify(tmp_path / "run" / "main@40.safetensors").ok
    rec = certckpt.inspect(tmp_path / "run" / "main@40.safetensors").record
    assert rec.step_range == [21, 40] and rec.lineage["last_clean_audit"] == 40


def test_rollback_to_latest_good_continues_on_a_new_branch(tmp_path):
    import json

    from click.testing import CliRunner

    from certckpt_cli.main import main

    store = tmp_path / "run"
    store.mkdir()
    out = ranks(ddp_cases.rollback, 3, {"store": str(store)})
    assert [(o["caught"], o["good"]) for o in out] == [(20, "main@10")] * 3
    # one log line per passed audit and one at the resume, on rank 0 only
    log = [line for line in out[0]["log"] if line.startswith(("audit at", "resumed"))]  # test_log_lines: the rest
    assert [line.split(":")[0] for line in log] == [
        "audit at step 10 on main passed",
        "resumed from main@10",
        "audit at step 20 on b2 passed",
        "audit at step 30 on b2 passed",
    ], log
    assert "replay and weight consensus across 3 ranks" in log[0] and log[0].endswith(" ms)")
    assert "new checkpoints go on branch b2" in log[1]
    assert out[1]["log"] == [] and out[2]["log"] == []
    doc = json.loads(CliRunner().invoke(main, ["status", str(store), "--json"]).output)
    verdicts = {c["ckpt_id"]: (c["verdict"], c["reasons"], c["parent"]) for c in doc["checkpoints"]}
    assert verdicts["main@10"][0] == "trusted" and verdicts["main@15"] == ("suspect", ["after-fault"], None)
    for s in (15, 20, 25, 30):  # step numbers repeat on the new branch, judged by its own audits
        assert verdicts[f"b2@{s}"] == ("trusted", [], "main@10"), s
    assert doc["latest_good"] == "b2@30"
    (det,) = doc["detections"]
    assert (det["branch"], det["step"], det["suspect_interval"]) == ("main", 20, [10, 20])
    lg = CliRunner().invoke(main, ["latest-good", str(store)])
    assert lg.exit_code == 0 and lg.output.strip().endswith("b2-0030.safetensors")


def test_the_drill_on_cuda_is_refused_in_one_line_without_a_gpu(tmp_path):
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the drill runs there (test_the_drill_matrix_on_cuda)")
    run = subprocess.run(
        [sys.executable, "-m", "certckpt_cli.main", "drill", "faults", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "no CUDA device is available here" in run.stderr


def test_the_drill_matrix_on_cuda(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=str(tmp_path / "drill"), device="cuda")
    assert m["device"] == "cuda"
    for c in m["cases"]:  # the same designed outcomes as on the CPU, gradients computed on the GPU
        assert (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"]), c
        assert c["caught_by"] is None or c["suspect_ranks"] == [1], c


def test_async_checkpoints_through_the_auditor_on_three_ranks(tmp_path):
    import torch

    out = ranks(ddp_cases.async_checkpoints, 3, {"dir": str(tmp_path)})
    # the background failure at step 5 is raised on every rank at the next save, together
    assert (
        out[0]["raised"] and out[0]["raised"][0].startswith("AsyncSaveError: ") and "missing-dir" in out[0]["raised"][0]
    )
    assert all(o["raised"] and "rank 0 could not write" in o["raised"][0] for o in out[1:])
    assert out[0]["locations"] == [str(tmp_path / "main@15.safetensors"), str(tmp_path / "main@20.safetensors")]
    assert out[1]["locations"] == []  # rank 0 writes
    for s in (15, 20):
        path = tmp_path / f"main@{s}.safetensors"
        assert certckpt.verify(path, deep=True).ok
        rec = certckpt.inspect(path).record
        assert (rec.run, rec.step, rec.branch) == ("as", s, "main")
        mapping = rec.lineage["consensus"]["tensors"]  # the consensus fingerprints, reused by the writer
        assert {p: rec.tensors[t]["fp"] for p, t in mapping.items()} == out[0][f"consensus{s}"]
        loaded = certckpt.load(path)["model"]  # the weights of that step, not of a later one
        assert all(torch.equal(loaded[k], torch.tensor(v)) for k, v in out[0][f"weights{s}"].items())
    # nothing was committed before step 15: its record reaches back to step 1, over the failed saves'
    # steps, and its lineage holds their audits (every 5 steps)
    first = certckpt.inspect(tmp_path / "main@15.safetensors").record
    assert first.step_range == [1, 15]
    assert sorted({a["step"] for a in first.lineage["audits"] if a["kind"] == "replay"}) == [5, 10, 15], first.lineage
    assert certckpt.inspect(tmp_path / "main@20.safetensors").record.step_range == [16, 20]
    _, latest = certckpt.find_latest_good(str(tmp_path), write_certificates=False)
    assert latest == "main@20"
