"""Detection under FSDP2 / HSDP (certckpt.detect.sharded): the weight consensus per shard across the
replicas of a 2 x 2 HSDP mesh on 4 gloo ranks, composed into the state fingerprint certckpt.dcp
records; a DCP checkpoint carrying the agreed fingerprint (manifest record and ledger commit) and the
verdict it reaches; a NaN planted in one rank's reduced gradient and a value flipped in one replica's
weight shard, caught and named; and (fast) CertifiedWriter's consensus arguments in one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from certckpt.dcp import CertifiedWriter, inspect_checkpoint, state_fingerprints, verify_checkpoint
from certckpt.detect.session import CheckpointEvidence
from certckpt.errors import ArgumentTypeError, ConfigurationError
from certckpt.trust.certify import certify
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from tests.support import fsdp_cases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CLEAN = 6  # clean steps, then a NaN in rank 2's reduced gradient (step 7), a flipped weight on rank 1 (step 8)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """One audited 2 x 2 HSDP run on 4 gloo ranks, with a certified DCP checkpoint at step 4."""
    from certckpt.detect.launch import run_ranks

    root = tmp_path_factory.mktemp("fsdp")
    store = str(root / "run")
    args = {
        "mesh": [2, 2],
        "store": store,
        "dir": os.path.join(store, "step4"),
        "steps": CLEAN + 2,
        "ckpt_step": 4,
        "nan_step": CLEAN + 1,
        "nan_rank": 2,
        "flip_step": CLEAN + 2,
        "flip_rank": 1,
    }
    out = run_ranks(fsdp_cases.hsdp_audit, 4, args, timeout=240)
    return {**args, "ranks": out, "events": Ledger(store).snapshot().events}


def _events(hsdp, kind, step):
    return [e for e in hsdp["events"] if e["kind"] == kind and e["step"] == step]


@pytest.mark.slow
def test_consensus_passes_every_clean_step_and_composes_the_dcp_state_fingerprint(hsdp):
    ranks = hsdp["ranks"]
    assert ranks[0]["placements"] == ["R", "S(0)"]  # replicate x shard
    for step in range(CLEAN):
        fps = {r["steps"][step]["state_fp"] for r in ranks}
        assert len(fps) == 1  # every rank composed the same state fingerprint
        for r in ranks:
            s = r["steps"][step]
            assert s["agreed"] and s["applied"] and s["disputed"] == []
            assert s["state_fp"] == s["live"]  # == certckpt.dcp.state_fingerprints of the same state
        (ev,) = [e for e in _events(hsdp, "consensus", step + 1) if "state_fp" in e["details"]]
        assert ev["outcome"] == "pass" and ev["details"]["state_fp"] == ranks[0]["steps"][step]["state_fp"]
        assert ev["details"]["regions"] == 9  # 4 parameters x 2 shards + the replicated buffer
    assert len({r["steps"][i]["state_fp"] for r in ranks[:1] for i in range(CLEAN)}) == CLEAN  # weights moved


@pytest.mark.slow
def test_dcp_checkpoint_carries_the_agreed_fingerprint(hsdp):
    ck = hsdp["ranks"][0]["ckpt"]
    assert all(r["ckpt"]["consensus_fp"] == ck["consensus_fp"] for r in hsdp["ranks"])
    assert ck["step"] == 4 and ck["step_range"] == [1, 4] and ck["ckpt_id"] == "main@4"
    manifest, record = inspect_checkpoint(hsdp["dir"])
    assert manifest.state_fp == ck["consensus_fp"] == ck["live"]  # model and optimizer state, as saved
    assert record.consensus_fp == ck["consensus_fp"] and record.step == 4 and record.step_range == [1, 4]
    written = {t.fqn: t.fp for t in manifest.tensors}
    assert written == ck["tensor_fps"]
    assert {k: written[k] for k in ck["full"]} == ck["full"]  # == fingerprints of full_tensor()
    assert verify_checkpoint(hsdp["dir"], deep=True).ok
    commit = Ledger(hsdp["store"]).snapshot().records["main@4"]
    assert commit["consensus_fp"] == ck["consensus_fp"] and commit["url"] == "step4"
    (ev,) = [e for e in _events(hsdp, "consensus", 4) if "fp" in e["details"]]
    assert ev["outcome"] == "pass" and ev["details"]["fp"] == ck["consensus_fp"]


@pytest.mark.slow
def test_without_a_replay_the_checkpoint_is_verified_not_trusted(hsdp):
    snap = Ledger(hsdp["store"]).snapshot()
    before_faults = [e for e in snap.events if e["step"] <= CLEAN]
    verdict = certify(snap.checkpoints, before_faults).verdicts["main@4"]
    assert (verdict.trusted, verdict.verified, verdict.reasons) == (False, True, ("awaiting-audit",))
    # the consensus failure at step 8 has no clean audit point before it: every checkpoint since the
    # branch started is suspect (certify_store also re-verifies the directory against its commit record)
    status = certify_store(hsdp["store"], verify_bytes=True, write_certificates=False)
    assert status.certification.verdicts["main@4"].reasons == ("after-fault",)


@pytest.mark.slow
def test_evidence_for_another_state_is_refused(hsdp):
    refused = hsdp["ranks"][0]["ckpt"]["refused"]
    assert "is not the state the replicas agreed on" in refused and "optim.state.0.bias.exp_avg" in refused
    assert not os.path.exists(os.path.join(hsdp["dir"] + "-other", "manifest.safetensors"))


@pytest.mark.slow
def test_nan_in_one_ranks_reduced_gradient_is_caught_and_named(hsdp):
    step = CLEAN + 1
    for r in hsdp["ranks"]:
        s = r["steps"][step - 1]
        assert s["applied"] is False  # every rank dropped the update
        assert s["agreed"] and s["state_fp"] == r["steps"][CLEAN - 1]["state_fp"]  # weights untouched
    (ev,) = _events(hsdp, "nonfinite-post", step)
    assert ev["outcome"] == "fail" and ev["contained"] is True
    assert ev["suspect_ranks"] == [2] and ev["details"]["post_ranks"] == [2]  # its replica (rank 0) was finite
    assert ev["details"]["tensors"] == {"2": ["2.weight@0,0"]}
    assert ev["inventory"]["2"]["host"]


@pytest.mark.slow
def test_corrupted_shard_on_one_replica_is_caught_naming_the_shard_and_its_holders(hsdp):
    step = CLEAN + 2
    for r in hsdp["ranks"]:
        s = r["steps"][step - 1]
        assert s["agreed"] is False and s["disputed"] == ["model.0.weight@17,0"]  # rank 1 holds rows 17-33
        assert s["candidates"] == [1, 3] and s["suspects"] == []  # two replicas: a tie, no majority
    (ev,) = _events(hsdp, "consensus", step)
    assert ev["outcome"] == "fail" and ev["details"]["tensors"] == ["model.0.weight"]
    values = ev["details"]["regions_disputed"]["model.0.weight@17,0"]
    assert sorted(values) == ["1", "3"] and values["1"] != values["3"]
    assert "attribution needs >= 3 replicas" in ev["details"]["note"]
    assert Ledger(hsdp["store"]).snapshot().open_incidents()  # an uncontained detection opens an incident


@pytest.mark.slow
def test_a_majority_of_replicas_names_the_corrupted_one(tmp_path):
    from certckpt.detect.launch import run_ranks

    args = {"mesh": [4, 1], "store": str(tmp_path / "run"), "steps": 2, "flip_step": 2, "flip_rank": 1}
    out = run_ranks(fsdp_cases.hsdp_audit, 4, {**args, "on_fault": "raise"}, timeout=240)
    assert all(r["steps"][0]["agreed"] and len(r["steps"]) == 1 for r in out)
    for r in out:  # every rank raised FaultDetectedError at step 2, naming rank 1 alone
        assert r["raised"]["suspects"] == [1] and "outvoted: [1]" in r["raised"]["message"]
    assert len({r["raised"]["incident"] for r in out}) == 1
    (ev,) = [e for e in Ledger(args["store"]).snapshot().events if e["outcome"] == "fail"]
    assert ev["kind"] == "consensus" and ev["suspect_ranks"] == [1]


@pytest.mark.slow
def test_the_default_consensus_runs_at_checkpoints_and_a_resume_must_load_the_checkpoint():
    from certckpt.detect.launch import run_ranks

    out = run_ranks(fsdp_cases.cheap_default_and_resume_check, 4, {}, timeout=240)
    assert out[0]["consensus_steps"] == [3]  # (rank 0 emits) three steps, no per-step consensus: the checkpoint's
    for r in out:
        assert r["refused"] is not None and "recorded" in r["refused"] and "resume_state" in r["refused"]
    assert len({r["refused"] for r in out}) == 1  # every rank refused with the same line


@pytest.mark.slow
def test_deferred_nonfinite_reads_under_hsdp():
    from certckpt.detect.launch import run_ranks

    out = run_ranks(fsdp_cases.deferred_read, 4, {}, timeout=240)
    for r in out:
        assert r["equal"]  # a deferred read changes no clean step
        # found at step 7's before_update: step 6's NaN in rank 3's shard (its replica, rank 1, holds
        # finite values), applied, so not contained
        assert r["late"] == [7, 6, "nonfinite-post", [3], "deferred", 7, False, True]
        # a checkpoint right after the non-finite step 3 reads it first and raises: no evidence
        assert r["at_ckpt"] == [3, 3, "nonfinite-post", [3], "deferred", 3, False, True]
        assert r["refused"] is not None and "on_nonfinite='raise'" in r["refused"]


@pytest.mark.slow
def test_a_model_without_dtensors_is_refused_on_every_rank():
    from certckpt.detect.launch import run_ranks

    out = run_ranks(fsdp_cases.plain_model_refused, 2, {}, timeout=120)
    assert out[0]["error"] == out[1]["error"]
    assert "rank(s) [0, 1]: no parameter is a DTensor: apply fully_shard" in out[0]["error"]


# --- CertifiedWriter's consensus arguments, one process ------------------------------------------------


def _evidence(step, fp, **kw):
    return CheckpointEvidence(
        step=step,
        run="r",
        branch="b",
        parent=None,
        step_range=[1, step],
        lineage={"consensus": {"step": step, "fp": fp}},
        consensus_fp=fp,
        known_fingerprints={},
        **kw,
    )


def test_writer_commits_the_agreed_fingerprint(tmp_path):
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}}
    fp = state_fingerprints(state).state_fp
    store = str(tmp_path / "run")
    writer = CertifiedWriter(os.path.join(store, "s3"), evidence=_evidence(3, fp), ledger=store)
    dcp.save(state, storage_writer=writer)
    assert writer.ckpt_id == "b@3"
    manifest, record = inspect_checkpoint(os.path.join(store, "s3"))
    assert manifest.state_fp == fp == record.consensus_fp and record.run == "r" and record.step_range == [1, 3]
    assert Ledger(store).snapshot().records["b@3"]["consensus_fp"] == fp


def test_writer_refuses_a_state_other_than_the_agreed_one(tmp_path):
    state = {"model": {"w": torch.arange(12.0)}}
    fp = state_fingerprints(state).state_fp
    agreed = {"model.w": state_fingerprints(state).tensors["model.w"]}
    state["model"]["w"][0] = 7.0  # changed after the consensus
    store = str(tmp_path / "run")
    # dcp.save wraps the coordinator's error in a CheckpointException, in one process too
    with pytest.raises(dcp.api.CheckpointException, match=r"not the state the replicas agreed on.*\['model.w'\]"):
        dcp.save(
            state,
            storage_writer=CertifiedWriter(
                str(tmp_path / "c"), evidence=_evidence(2, fp, tensor_fps=agreed), ledger=store
            ),
        )
    assert not os.path.exists(os.path.join(store, "_ledger", "checkpoints"))  # nothing committed


def test_writer_checks_its_consensus_arguments(tmp_path):
    with pytest.raises(ArgumentTypeError, match="16 lowercase hex"):
        CertifiedWriter(str(tmp_path / "a"), consensus_fp="xyz")
    with pytest.raises(ArgumentTypeError, match="CheckpointEvidence"):
        CertifiedWriter(str(tmp_path / "a"), evidence={"step": 1})
    with pytest.raises(ConfigurationError, match="evidence is of step 5"):
        CertifiedWriter(str(tmp_path / "a"), step=4, evidence=_evidence(5, "0" * 16))
    w = CertifiedWriter(str(tmp_path / "a"), evidence=_evidence(5, "0" * 16), branch="other")
    assert (w.step, w.branch, w.run, w.consensus_fp) == (5, "other", "r", "0" * 16)
