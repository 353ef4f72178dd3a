"""TorchTitan's CheckpointManager writing certified DCP (certckpt.integrations.torchtitan), on TorchTitan's
llama3 debug model fully sharded over 3 gloo ranks (tests/support/torchtitan_cases.py says what of it
runs on CPU). One launched world checks saving (sync with audit evidence, async), rotation keeping
latest-good, resuming from it on a new branch, and a plain TorchTitan checkpoint refused; a second
compares TorchTitan's same-rank SDC replay with certckpt's cross-rank replay on a persistent fault."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchtitan.components.checkpoint", reason="needs torchtitan: pip install 'certckpt[torchtitan]'")

from certckpt.trust.runstore import certify_store
from tests.support import torchtitan_cases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_config_refuses_an_uncertified_export_and_an_unknown_level():
    from certckpt.errors import ConfigurationError
    from certckpt.integrations.torchtitan import CertifiedCheckpointManager

    with pytest.raises(ConfigurationError, match="uncertified Hugging Face export"):
        CertifiedCheckpointManager.Config(enable=True, last_save_in_hf=True, last_save_model_only=True)
    with pytest.raises(ConfigurationError, match="'trusted' or 'verified'"):
        CertifiedCheckpointManager.Config(enable=True, accept="maybe")


@pytest.mark.slow
def test_torchtitan_checkpoints_are_certified_rotated_around_latest_good_resumed_and_plain_ones_refused(tmp_path):
    from certckpt.detect.launch import run_ranks

    out = run_ranks(torchtitan_cases.checkpoints, 3, {"root": str(tmp_path)}, timeout=600)
    store = str(tmp_path / "ckpt")
    status = certify_store(store, write_certificates=False)
    labels = {cid: status.certification.verdicts[cid].label for cid in status.snapshot.records}
    # step 2 carries the agreed fingerprint and the audit at step 2 passed; later ones carry none
    assert labels["main@2"] == "trusted"
    assert out[0]["last_ckpt_id"] == "main@8" and out[0]["async_ckpt_id"] == "main@9"
    # keep_latest_k=2 wanted steps 2 and 4 gone: 4 went (retired in the ledger), latest-good 2 stayed
    assert out[0]["dirs"] == ["_ledger", "step-2", "step-6", "step-8"]
    retired = status.snapshot.retired
    assert set(retired) == {"main@4"} and retired["main@4"]["policy"] == "torchtitan"
    for r in out:
        # resumed from latest-good (step 2, not the newest step 8), bit for bit, on a new branch
        assert r["loaded"] is True
        assert r["resumed"] == {"fp": r["fps"]["2"], "branch": "main-r1", "parent": "main@2", "step": 2}
        assert "step-3-main-r1" in r["dirs_after_resume"]
        # a checkpoint written by plain TorchTitan: one line, how to bring it in, nothing unpickled
        refused = r["plain_refused"]
        assert refused.startswith("NotACheckpointError: ") and "\n" not in refused
        assert "written by plain TorchTitan" in refused and "certckpt certify" in refused
    assert status.certification.verdicts["main-r1@3"].label in ("verified", "suspect")
    assert os.path.isfile(tmp_path / "ckpt" / "step-2" / "manifest.safetensors")


@pytest.mark.slow
def test_hsdp_checkpoints_are_certified_with_the_audits_evidence_and_resume_from_latest_good(tmp_path):
    # TorchTitan's Trainer itself does not start on CPU (docs/integrations.md, "What runs where"): its HSDP
    # path, apply_fsdp_to_decoder on a 2 x 2 (dp_replicate, fsdp) mesh, runs here on 4 gloo ranks
    from certckpt.detect.launch import run_ranks
    from certckpt.format.sharded.check import verify_checkpoint

    out = run_ranks(torchtitan_cases.hsdp_checkpoints, 4, {"root": str(tmp_path)}, timeout=600)
    store = str(tmp_path / "ckpt")
    for r in out:
        assert r["placements"] == ["(Replicate(), Shard(dim=0))"], r["placements"]  # HSDP, not FSDP
        assert r["fps"] == out[0]["fps"] and r["steps"] == 4
    # both checkpoints verify whole; each carries the fingerprint the replicas agreed on, and the audits
    # at steps 2 and 4 passed: trusted
    for step in (2, 4):
        report = verify_checkpoint(os.path.join(store, f"step-{step}"))
        assert report.ok, report.problems
    status = certify_store(store, write_certificates=False)
    labels = {cid: status.certification.verdicts[cid].label for cid in status.snapshot.records}
    assert labels == {"main@2": "trusted", "main@4": "trusted"}, labels
    # a fresh HSDP model resumes from latest-good (step 4), every byte checked, bit for bit
    for r in out:
        assert r["loaded"] is True
        assert r["resumed"] == {"fp": out[0]["fps"]["4"], "parent": "main@4", "step": 4}
        # the resumed session proves the parent's agreed state, and refuses one shard changed after the load
        assert r["resumed_fp_known"] is True
        assert r["altered"] is not None, r
    assert len({r["altered"] for r in out}) == 1, out  # refused together, the same way on every rank


@pytest.mark.slow
def test_a_persistent_fault_escapes_the_same_rank_replay_and_is_named_by_the_cross_rank_replay():
    from certckpt.detect.launch import run_ranks

    fault = {"kind": "persistent", "rank": 1, "step": 3}
    out = run_ranks(torchtitan_cases.replay_comparison, 3, {"fault": fault, "steps": 4}, timeout=600)
    for r in out:
        assert r["titan"] is None  # the same wrong answer twice: every same-rank comparison passed
        assert r["certckpt"]["step"] == 3 and r["certckpt"]["suspects"] == [1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device (benchmarks/gpu_session.sh runs it)")
def test_on_one_cuda_gpu_every_async_mode_writes_certified_checkpoints_that_load_back(tmp_path):
    from certckpt.detect.launch import run_ranks

    (out,) = run_ranks(torchtitan_cases.gpu_checkpoints, 1, {"root": str(tmp_path)}, timeout=600)
    assert sorted(out) == ["async", "async_with_pinned_mem", "disabled"]
    for mode, r in out.items():
        assert r == {"verified": True, "problems": [], "loaded": True, "same": True, "device": "cuda:0"}, (mode, r)
