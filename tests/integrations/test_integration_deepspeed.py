"""The DeepSpeed integration (issue 43): ``certify_engine`` makes ``engine.save_checkpoint`` and
``engine.load_checkpoint`` certified under ZeRO 1, 2 and 3 (every rank's files certified, a manifest
committed per tag, the tag verified whole before loading, latest-good resume on a new branch, no
pickle either way), ``export_fp32`` writes consolidated certified weights, and ``ZeroAudit`` names a
faulty rank under ZeRO-1/2. Multi-process cases run DeepSpeed's CPU accelerator on 3 gloo ranks
(``tests/support/deepspeed_cases.py``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
pytest.importorskip("deepspeed")

from collections.abc import Callable

import safetensors.torch
import torch
from click.testing import CliRunner

import certckpt
from certckpt.detect.launch import run_ranks
from certckpt.errors import CorruptCheckpointError, NotACheckpointError
from certckpt.integrations.deepspeed import MANIFEST_NAME, export_fp32, require_intact, verify_checkpoint
from certckpt.integrations.deepspeed.codecs import register_deepspeed_types
from certckpt.trust.ledger import Ledger
from certckpt_cli.main import main
from tests.support import deepspeed_cases


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def _verdicts(store: str) -> dict[str, str]:
    r = _cli("status", store, "--json")
    assert r.exit_code == 0, r.output
    return {c["ckpt_id"]: c["verdict"] for c in json.loads(r.output)["checkpoints"]}


def _ranks(target: Callable, args: dict, timeout: float = 300) -> list:
    return run_ranks(target, 3, args, timeout=timeout)


def _flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


# --- in one process ---------------------------------------------------------------------------


def test_the_deepspeed_objects_of_a_zero_state_round_trip_without_pickle(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    register_deepspeed_types()
    state = {
        "loss_scaler": LossScaler(scale=1),
        "dynamic": DynamicLossScaler(
            init_scale=2.0**16, scale_window=100, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
        ),
        "zero_stage": ZeroStageEnum.gradients,
        "mapping": [{"0.weight": fragment_address(numel=4, start=8)}],
        "flat": [torch.arange(6.0)],
    }
    certckpt.save(state, str(tmp_path / "z.pt"), step=1)
    back = certckpt.load(str(tmp_path / "z.pt"))
    assert type(back["loss_scaler"]) is LossScaler and back["loss_scaler"].cur_scale == 1
    assert type(back["dynamic"]) is DynamicLossScaler and vars(back["dynamic"]) == vars(state["dynamic"])
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert back["mapping"] == state["mapping"] and torch.equal(back["flat"][0], state["flat"][0])


def test_a_plain_deepspeed_directory_is_refused_naming_its_pickles_and_the_fix(tmp_path):
    tag = tmp_path / "global_step2"
    tag.mkdir()
    torch.save({"module": {"w": torch.ones(2)}}, str(tag / "mp_rank_00_model_states.pt"))
    torch.save({"optimizer_state_dict": {}}, str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    with pytest.raises(NotACheckpointError) as e:
        verify_checkpoint(str(tag))
    msg = str(e.value)
    assert "plain DeepSpeed" in msg and "mp_rank_00_model_states.pt and 1 more are pickles" in msg
    assert "never unpickled" in msg and "certify_engine(engine) and engine.save_checkpoint(NEW_DIR)" in msg
    assert "\n" not in msg


def test_audit_events_wait_for_the_run_store_and_the_written_weights_must_be_the_agreed_ones(tmp_path):
    from certckpt.detect.events import make_event
    from certckpt.format.fingerprinting import fingerprint
    from certckpt.integrations.deepspeed.audit import StoreSink
    from certckpt.integrations.deepspeed.engine import _weights_problem

    # ZeroAudit's sink keeps the events until the certified engine names the store, then writes them there.
    sink = StoreSink()
    ev = make_event(run="ds", branch="main", world=3, inventory={}, step=2, kind="replay", outcome="pass", details={})
    sink.emit(ev)
    sink.flush()  # no store yet: kept
    store = str(tmp_path / "ckpt")
    os.makedirs(store)
    assert sink.bind(Ledger(store)) and not sink.bind(Ledger(store))  # the same store twice: nothing new
    sink.flush()
    assert [(e["step"], e["kind"]) for e in Ledger(store).snapshot().events] == [(2, "replay")]

    # The module weights about to be written are compared with the fingerprints every replica agreed on.
    w = torch.arange(4.0)
    agreed = {"0.weight": f"{fingerprint(w):016x}"}
    assert _weights_problem({"0.weight": w}, agreed, "m.pt") is None
    problem = _weights_problem({"0.weight": w + 1}, agreed, "m.pt")
    assert problem is not None and "`module.0.weight` has fingerprint" in problem and "not committed" in problem
    assert "none of the weights" in str(_weights_problem({"other": w}, agreed, "m.pt"))


# --- 3 gloo ranks ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoints_are_certified_committed_verified_and_resume_bit_equal(tmp_path, stage):
    out = str(tmp_path / "ckpt")
    # 6 steps, a checkpoint every 2: main@2, main@4, main@6; under ZeRO-2 the audits run too.
    audit = 2 if stage < 3 else 0
    a = _ranks(deepspeed_cases.train, {"stage": stage, "out": out, "steps": 6, "save_every": 2, "audit": audit})
    assert [r["global_step"] for r in a] == [6, 6, 6]
    if audit:
        assert a[0]["passed"] == [
            ["replay", 2],
            ["consensus", 2],
            ["replay", 4],
            ["consensus", 4],
            ["replay", 6],
            ["consensus", 6],
        ]
    step4 = os.path.join(out, "step4")
    rank_files = (
        ["mp_rank_00_model_states.pt"]
        if stage < 3
        else [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)]
    ) + [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)]
    assert sorted(os.listdir(step4)) == sorted([MANIFEST_NAME, *rank_files])
    for name in rank_files:  # each rank's file is a certified safetensors file: no pickle in it
        assert certckpt.verify(os.path.join(step4, name)).ok
        with open(os.path.join(step4, name), "rb") as f:
            assert not f.read(4).startswith((b"PK\x03\x04", b"\x80"))
    assert verify_checkpoint(step4).files == sorted(rank_files)
    with open(os.path.join(out, "latest")) as f:
        assert f.read() == "step6"

    # The commands work on these checkpoints: audited (ZeRO-2), they are trusted; ZeRO-3's are verified.
    level = "trusted" if audit else "verified"
    assert _verdicts(out) == {"main@2": level, "main@4": level, "main@6": level}
    if audit:
        assert certckpt.find_latest_good(out)[1] == "main@6"  # the default accept: trusted only
        rec = Ledger(out).snapshot().records["main@4"]
        assert rec["step_range"] == [3, 4] and rec["consensus_fp"]
        lineage = certckpt.inspect(os.path.join(step4, MANIFEST_NAME)).record.lineage
        assert lineage["consensus"]["fp"] == rec["consensus_fp"] and lineage["last_clean_audit"] == 4
        audits = [(a["step"], a["kind"]) for a in lineage["audits"]]
        assert audits == [(4, "replay"), (4, "consensus"), (4, "nonfinite")]
    r = _cli("latest-good", out, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "step6", MANIFEST_NAME)
    r = _cli("latest-good", out, "--accept", "verified", "--dir")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "step6")
    assert _cli("verify", step4).exit_code == 0

    # Consolidated fp32 weights, certified, equal to the trained ones.
    path = str(tmp_path / "fp32.safetensors")
    export_fp32(os.path.join(out, "step6"), path)
    got = safetensors.torch.load_file(path)
    assert certckpt.verify(path).ok
    assert {n: t.reshape(-1).tolist() for n, t in got.items()} == a[0]["weights"]

    # Resume from step4 (explicit tag): a new branch; training to 6 equals the uninterrupted run.
    b = _ranks(
        deepspeed_cases.train, {"stage": stage, "out": out, "steps": 6, "save_every": 5, "resume": True, "tag": "step4"}
    )
    assert [(r["branch"], r["parent"], r["start"], r["global_step"]) for r in b] == [("main-r1", "main@4", 4, 6)] * 3
    assert b[0]["weights"] == a[0]["weights"]
    assert _verdicts(out)["main-r1@5"] == "verified"

    # One file edited, one rank's file missing: the whole directory fails, in one line.
    bad = str(tmp_path / "bad")
    shutil.copytree(step4, bad)
    _flip_last_byte(os.path.join(bad, rank_files[-1]))
    with pytest.raises(CorruptCheckpointError, match=rf"refusing to load .*{rank_files[-1]}.*xxh3 digest mismatch"):
        require_intact(bad)
    os.remove(os.path.join(os.path.join(out, "step2"), rank_files[1]))
    r = _cli("verify", os.path.join(out, "step2"))
    assert r.exit_code != 0 and f"{rank_files[1]}: missing (the manifest lists it)" in r.output


@pytest.mark.slow
def test_loads_of_plain_tampered_or_incomplete_directories_are_refused_on_every_rank(tmp_path):
    # One ZeRO-3 launch: a plain DeepSpeed checkpoint, a certified one and two damaged copies of it.
    got = _ranks(
        deepspeed_cases.refusals,
        {"stage": 3, "plain": str(tmp_path / "plain"), "out": str(tmp_path / "ckpt"), "tmp": str(tmp_path)},
    )
    # every rank raised, and the same error; a save refused on rank 0 names rank 0's error on the others
    others = [g.pop("over_plain") for g in got[1:]]
    assert all(o["error"] == "CertckptError" and "rank(s) [0]" in o["message"] for o in others), others
    assert got[0]["over_plain"]["message"] in others[0]["message"]
    assert {k: v for k, v in got[0].items() if k != "over_plain"} == got[1] == got[2]
    res = got[0]
    assert res["plain"]["error"] == "NotACheckpointError"
    assert "written by plain DeepSpeed" in res["plain"]["message"] and "never unpickled" in res["plain"]["message"]
    assert res["edited"]["error"] == "CorruptCheckpointError"
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in res["edited"]["message"]
    assert res["missing"]["error"] == "CorruptCheckpointError"
    assert "zero_pp_rank_2_mp_rank_00_optim_states.pt: missing (the manifest lists it)" in res["missing"]["message"]
    assert res["nothing"] == {"error": None}  # an empty store: nothing to load, as DeepSpeed without `latest`
    # a save never removes a directory it cannot prove its own: plain DeepSpeed's tag is refused, kept whole
    assert res["over_plain"]["error"] == "CheckpointExistsError" and res["plain_kept"]
    assert "not a leftover of this run's own save at step 1" in res["over_plain"]["message"]
    assert "a file certckpt did not write" in res["over_plain"]["message"]
    # this run's own leftover at this step is replaced by a whole certified tag
    assert res["redo"] == {"error": None} and MANIFEST_NAME in res["redo_files"]
    assert res["audit"]["error"] == "AuditSetupError" and "ZeRO-3 partitions the weights" in res["audit"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "fault", "kind", "step"),
    [
        # a unit that computes wrongly from step 3 on: the replay at step 4 names rank 1
        (2, {"kind": "forward", "rank": 1, "step": 3, "persistent": True}, "replay", 4),
        # one weight of rank 2's replica changed right after step 3: the consensus then names rank 2
        (1, {"kind": "post-optimizer", "rank": 2, "step": 3}, "consensus", 3),
    ],
)
def test_zero_audit_names_the_faulty_rank_in_an_incident_and_keeps_latest_good(tmp_path, stage, fault, kind, step):
    # A checkpoint every step, audits every 2 (consensus every step): main@1 and main@2 are covered by
    # the clean audit at 2; what follows it up to the detection is suspect.
    out = str(tmp_path / "c")
    args = {"stage": stage, "out": out, "steps": 6, "audit": 2, "consensus_every": 1, "save_every": 1}
    got = _ranks(deepspeed_cases.train, {**args, "faults": [fault]})
    assert [(g["detected"]["kind"], g["detected"]["step"], g["detected"]["suspect_ranks"]) for g in got] == [
        (kind, step, [fault["rank"]])
    ] * 3
    assert got[0]["passed"][:3] == [["consensus", 1], ["replay", 2], ["consensus", 2]]
    (incident,) = {g["incident"] for g in got}  # the same incident on every rank, opened by rank 0
    assert incident == f"inc-main-{step}-{kind}"
    assert Ledger(out).snapshot().open_incidents()
    suspect = {"main@3": "suspect"} if step == 4 else {}  # a detection at 3 stops before the save at 3
    assert _verdicts(out) == {"main@1": "trusted", "main@2": "trusted", **suspect}
    assert certckpt.find_latest_good(out)[1] == "main@2"  # the default accept: trusted only
    r = _cli("latest-good", out, "--dir")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "step2")
    r = _cli("status", out)
    assert f"step {step} on main: {kind} failed, suspect rank(s) [{fault['rank']}]" in r.output, r.output


@pytest.mark.slow
def test_accelerates_deepspeed_plugin_saves_a_certified_tag(tmp_path):
    pytest.importorskip("accelerate")
    out = str(tmp_path / "state")
    (got,) = run_ranks(deepspeed_cases.accelerate_save, 1, {"out": out}, timeout=300)
    assert got["engine"] == "DeepSpeedEngine" and got["step"] == 4
    # accelerate's own RNG file beside the tag is its business (a pickle it writes with torch.save)
    assert {"pytorch_model", "latest", "_ledger"} <= set(got["files"])
    assert verify_checkpoint(os.path.join(out, "pytorch_model")).ok
    assert _verdicts(out) == {"main@4": "verified"}


@pytest.mark.slow
def test_zero_audit_proves_a_resume_holds_the_weights_loaded_and_checks_them_when_a_replay_fails(tmp_path):
    # One ZeRO-2 launch: 4 audited steps (checkpoints at 2 and 4), then three loads of step2.
    out = str(tmp_path / "c")
    got = _ranks(
        deepspeed_cases.resume_proof,
        {"stage": 2, "out": out, "steps": 4, "save_every": 2, "audit": 2, "tag": "step2"},
    )
    recorded = Ledger(out).snapshot().records["main@2"]["consensus_fp"]
    assert recorded

    # Rank 1's weights changed after the load: refused on every rank before the first update, rank 1 named.
    altered = [g["altered"] for g in got]
    assert [(a["error"], a.get("kind"), a.get("found_by"), a.get("suspects"), a["at"]) for a in altered] == [
        ("FaultDetectedError", "consensus", "resume", [1], 2)
    ] * 3
    assert "the weights loaded differ across replicas" in altered[0]["message"]

    # Every rank's changed alike (they agree, on other weights): refused at the audit's construction.
    every = [g["all"] for g in got]
    assert [(e["error"], e["at"]) for e in every] == [("AuditSetupError", 2)] * 3
    assert len({e["message"] for e in every}) == 1
    msg = every[0]["message"]
    assert msg.startswith("the weights loaded for step 2 have consensus fingerprint ")
    assert f"but the checkpoint loaded (main@2) recorded {recorded}" in msg and "\n" not in msg

    # A clean resume is proven and trains on: the audits at 4 pass, the weights are the first run's.
    clean = [g["clean"] for g in got]
    assert [(c["error"], c["at"]) for c in clean] == [(None, 4)] * 3
    assert clean[0]["passed"] == [["replay", 4], ["consensus", 4]]
    assert clean[0]["weights"] == got[0]["weights"]

    # It trains on; rank 2's weights change before the audit step 6: the failed replay runs the consensus
    # first (as the DDP session does), which names rank 2 before any arbitration or update.
    drifted = [g["drifted"] for g in got]
    assert [(d["error"], d.get("kind"), d.get("found_by"), d.get("suspects"), d["at"]) for d in drifted] == [
        ("FaultDetectedError", "consensus", "replay precondition", [2], 5)
    ] * 3
    assert "the replay failed, and the weights it ran on differ across replicas" in drifted[0]["message"]
