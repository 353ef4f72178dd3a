"""The Hugging Face Accelerate integration (issue 43): ``CertifiedAccelerator``'s certified, committed
``save_state`` directories (one process, in this process), their verification as a whole on
``load_state``, bit-exact resume on a new branch, refusal of plain Accelerate's pickles, the CLI on
these checkpoints, and (slow, 3 gloo ranks) ``AcceleratorAudit`` catching a planted fault, naming
rank 1, ``total_limit=1`` keeping latest-good, the resume continuing bit-identically, and
``certckpt run -- accelerate launch`` exiting 86."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner

from certckpt.detect.launch import free_port, run_ranks
from certckpt.errors import (
    AuditSetupError,
    CheckpointExistsError,
    ConfigurationError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from certckpt.integrations.accelerate import (
    MANIFEST_NAME,
    AcceleratorAudit,
    verify_state_dir,
)
from certckpt.integrations.accelerate import accelerator as accelerator_module
from certckpt.trust.ledger import Ledger
from certckpt_cli.main import main
from tests.support import accelerate_cases
from tests.support.accelerate_cases import ACCUMULATION, batch_for, build, loop, weights_digest
from tests.support.helpers import ROOT, console_script

CERTIFIED = {
    "model.safetensors",
    "optimizer.safetensors",
    "scheduler.safetensors",
    "random_states_0.safetensors",
    MANIFEST_NAME,
}


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def _verdicts(store: str) -> dict[str, str]:
    r = _cli("status", store, "--json")
    assert r.exit_code == 0, r.output
    return {c["ckpt_id"]: c["verdict"] for c in json.loads(r.output)["checkpoints"]}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons: each test starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _run(project: str, *, steps: int, save_every: int = 2, resume: bool = False, total_limit=None, async_save=False):
    accelerator, model, opt, sched, audit = build(
        project, total_limit=total_limit, resume=resume, async_save=async_save
    )
    losses: list[float] = []
    loop(accelerator, model, opt, sched, audit, max_steps=steps, save_every=save_every, losses=losses)
    return accelerator, model, losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One certified run, one process: 6 optimizer steps, checkpoints at 2, 4 and 6."""
    from accelerate.state import AcceleratorState, GradientState

    project = str(tmp_path_factory.mktemp("acc") / "proj")
    _run(project, steps=6)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return project


@pytest.fixture
def project_copy(saved, tmp_path):
    dst = str(tmp_path / "proj")
    shutil.copytree(saved, dst)
    return dst


def test_save_state_writes_certified_files_only_and_commits_each_step(saved):
    checkpoints = os.path.join(saved, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    for name in os.listdir(checkpoints):
        assert set(os.listdir(os.path.join(checkpoints, name))) == CERTIFIED  # no .bin, no .pkl
        assert verify_state_dir(os.path.join(checkpoints, name)).ok
    with safetensors.safe_open(os.path.join(checkpoints, "checkpoint_2", "model.safetensors"), "pt") as f:
        assert "0.weight" in set(f.keys())  # any safetensors reader opens the weights
    assert _verdicts(saved) == {"main@2": "verified", "main@4": "verified", "main@6": "verified"}


def test_status_latest_good_and_verify_work_on_these_checkpoints(saved):
    newest = os.path.join(saved, "checkpoints", "checkpoint_2")
    r = _cli("latest-good", saved, "--accept", "verified", "--dir")
    assert r.exit_code == 0 and r.output.strip() == newest, r.output
    r = _cli("verify", newest)
    assert r.exit_code == 0 and r.output.startswith("OK") and "step 6" in r.output, r.output
    r = _cli("status", newest)  # a checkpoint's directory answers for its store
    assert r.exit_code == 0 and "main@6" in r.output, r.output


def test_resume_continues_bit_identically_to_an_uninterrupted_run(tmp_path):
    # Dropout draws from torch's RNG every step: equal weights need the restored RNG states too.
    _, whole, whole_losses = _run(str(tmp_path / "whole"), steps=8, save_every=4)
    reference = weights_digest(whole)
    from accelerate.state import AcceleratorState, GradientState

    project = str(tmp_path / "cut")
    _, _, first = _run(project, steps=4, save_every=4)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator, model, rest = _run(project, steps=8, save_every=4, resume=True)
    assert (accelerator.certckpt.branch, accelerator.certckpt.parent) == ("main-r1", "main@4")
    assert weights_digest(model) == reference
    assert first + rest == whole_losses
    assert _verdicts(project) == {"main@4": "verified", "main-r1@8": "verified"}


def test_load_state_on_a_first_run_starts_from_scratch(tmp_path):
    accelerator, *_ = build(str(tmp_path / "proj"), total_limit=None, resume=True)
    assert accelerator.certified_step == 0 and accelerator.certckpt.branch == "main"


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("missing-rng", ["random_states_0.safetensors", "missing"]),
        ("edited-optimizer", ["optimizer.safetensors", "digest"]),
        ("swapped-model", ["model.safetensors", "another certified file"]),
        ("added-pickle", ["extra.bin", "not listed"]),
    ],
)
def test_a_damaged_directory_is_one_error_and_nothing_is_loaded(project_copy, damage, words):
    target = os.path.join(project_copy, "checkpoints", "checkpoint_1")
    if damage == "missing-rng":
        os.remove(os.path.join(target, "random_states_0.safetensors"))
    elif damage == "edited-optimizer":
        path = os.path.join(target, "optimizer.safetensors")
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte ^ 0x40]))
    elif damage == "swapped-model":
        other = os.path.join(project_copy, "checkpoints", "checkpoint_0", "model.safetensors")
        shutil.copyfile(other, os.path.join(target, "model.safetensors"))
    else:
        torch.save({"x": 1}, os.path.join(target, "extra.bin"))
    accelerator, model, *_ = build(str(tmp_path_for(project_copy)), total_limit=None)
    before = weights_digest(model)
    with pytest.raises(CorruptCheckpointError) as e:
        accelerator.load_state(target)
    text = str(e.value)
    assert text.startswith(f"refusing to load {target}") and "load another checkpoint" in text, text
    assert all(w in text for w in words), text
    assert weights_digest(model) == before and accelerator.certckpt.branch is None


def tmp_path_for(project: str) -> str:
    return os.path.join(os.path.dirname(project), "other")


def test_an_rng_state_that_fails_to_restore_is_one_error(tmp_path, monkeypatch):
    states = accelerator_module._rng_states()
    states["python"] = (3, (1, 2, 3), None)  # not a Mersenne Twister state: random.setstate refuses it
    monkeypatch.setattr(accelerator_module, "_rng_states", lambda: states)
    _run(str(tmp_path / "proj"), steps=2)
    monkeypatch.undo()
    accelerator, *_ = build(str(tmp_path / "other"), total_limit=None)
    with pytest.raises(CorruptCheckpointError, match="the RNG state did not restore") as e:
        accelerator.load_state(str(tmp_path / "proj" / "checkpoints" / "checkpoint_0"))
    assert "random_states_0.safetensors" in str(e.value)


def test_a_plain_accelerate_directory_is_refused_without_unpickling(tmp_path, monkeypatch):
    from accelerate import Accelerator

    plain = Accelerator(cpu=True)
    model = plain.prepare(torch.nn.Linear(4, 2))
    opt = plain.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    plain.save_state(str(tmp_path / "plain"))
    assert {"optimizer.bin", "random_states_0.pkl"} <= set(os.listdir(tmp_path / "plain"))
    del opt

    def never(*a, **k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    monkeypatch.setattr(torch, "load", never)
    accelerator, *_ = build(str(tmp_path / "proj"), total_limit=None)
    with pytest.raises(NotACheckpointError) as e:
        accelerator.load_state(str(tmp_path / "plain"))
    text = str(e.value)
    assert "\n" not in text and "plain Accelerate" in text and "optimizer.bin" in text, text
    assert "random_states_0.pkl" in text and "never unpickles" in text and "certckpt certify" in text, text


@pytest.mark.parametrize("async_save", [False, True])
def test_registered_objects_round_trip_and_unstorable_ones_are_refused(tmp_path, async_save):
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, s):
            self.n = s["n"]

    accelerator, model, opt, sched, _ = build(str(tmp_path / "proj"), total_limit=None, async_save=async_save)
    counter = Counter()
    counter.n = 7
    accelerator.register_for_checkpointing(counter)
    directory = accelerator.save_state()
    accelerator.certckpt_wait()  # async_save: the files are published in the background
    assert "custom_checkpoint_0.safetensors" in os.listdir(directory)
    counter.n = 0
    accelerator.certckpt.branch = None  # a new process would start undecided
    accelerator.load_state(directory)
    assert counter.n == 7

    class Opaque(Counter):
        def state_dict(self):
            return {"fn": lambda: 0}

    accelerator.register_for_checkpointing(Opaque())
    with pytest.raises(Exception, match="register_for_checkpointing object 1") as e:
        accelerator.save_state()  # refused at the snapshot, by save_state itself, with async_save too
    assert "without pickle" in str(e.value)
    accelerator.certckpt_wait()  # nothing of the refused save is left in flight to fail later


def test_total_limit_rotates_and_retires_what_it_deletes(tmp_path):
    project = str(tmp_path / "proj")
    _run(project, steps=8, save_every=2, total_limit=2)
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(os.path.join(project, "_ledger", "retired"))) == ["main@2.json", "main@4.json"]


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path)


def test_async_save_commits_the_checkpoints_the_synchronous_one_does(saved, tmp_path):
    project = str(tmp_path / "async")
    accelerator, model, _ = _run(project, steps=6, async_save=True)
    accelerator.end_training()  # waits for the checkpoint in flight
    assert not accelerator.certckpt.pipeline.in_flight
    for name in ("checkpoint_0", "checkpoint_1", "checkpoint_2"):
        a, s = os.path.join(project, "checkpoints", name), os.path.join(saved, "checkpoints", name)
        assert set(os.listdir(a)) == CERTIFIED and verify_state_dir(a).ok
        for file in CERTIFIED - {MANIFEST_NAME}:  # snapshotted at their step
            got, want = _tensors(os.path.join(a, file)), _tensors(os.path.join(s, file))
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (name, file)
    assert _verdicts(project) == _verdicts(saved)
    newest, saved_files = os.path.join(project, "checkpoints", "checkpoint_2"), CERTIFIED - {MANIFEST_NAME}
    data = sum(t.nbytes for f in saved_files for t in _tensors(os.path.join(newest, f)).values())
    files = sum(os.path.getsize(os.path.join(newest, f)) for f in saved_files)
    assert data <= accelerator.certckpt.pipeline.staging_bytes < files  # one snapshot per file, reused

    rotated = str(tmp_path / "rotated")
    accelerator, *_ = _run(rotated, steps=8, save_every=2, total_limit=2, async_save=True)
    accelerator.certckpt_wait()
    assert sorted(os.listdir(os.path.join(rotated, "checkpoints"))) == ["checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(os.path.join(rotated, "_ledger", "retired"))) == ["main@2.json", "main@4.json"]


def test_an_async_checkpoint_that_fails_in_the_background_is_raised_at_the_next_save(tmp_path):
    from certckpt.errors import AsyncSaveError

    project = str(tmp_path / "proj")
    accelerator, model, opt, sched, audit = build(project, total_limit=None, async_save=True)

    def plants_a_pickle(models, weights, directory):
        if accelerator.certified_step == 4:  # the background manifest writer refuses the directory
            torch.save({"w": torch.ones(1)}, os.path.join(directory, "extra.bin"))

    accelerator.register_save_state_pre_hook(plants_a_pickle)
    with pytest.raises(AsyncSaveError, match=r"checkpoint_1: the asynchronous checkpoint failed .*pickle") as e:
        loop(accelerator, model, opt, sched, audit, max_steps=8, save_every=2, losses=[])
    assert "latest-good still names the checkpoint before it" in str(e.value)
    assert accelerator.certified_step == 6  # training went on until the next checkpoint asked for it
    checkpoints = os.path.join(project, "checkpoints")
    assert not os.path.exists(os.path.join(checkpoints, "checkpoint_1", MANIFEST_NAME))
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1"]  # step 6's not started
    assert _verdicts(project) == {"main@2": "verified"}
    accelerator.certckpt_wait()  # the failure was raised once; nothing is left in flight

    # Training goes on (the hook fixed): the next save reuses checkpoint_1, whose leftover files (the
    # pickle among them) are removed first, and its record's step range reaches back over step 4's.
    accelerator._save_model_state_pre_hook.clear()
    loop(accelerator, model, opt, sched, audit, max_steps=10, save_every=2, losses=[])
    accelerator.end_training()
    assert sorted(os.listdir(checkpoints)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert set(os.listdir(os.path.join(checkpoints, "checkpoint_1"))) == CERTIFIED
    records = Ledger(project).snapshot().records
    assert {c: records[c]["step_range"] for c in records} == {"main@2": [1, 2], "main@8": [3, 8], "main@10": [9, 10]}
    assert _verdicts(project) == {"main@2": "verified", "main@8": "verified", "main@10": "verified"}


def test_only_the_directory_of_this_runs_failed_save_is_ever_removed(tmp_path):
    project = str(tmp_path / "proj")
    accelerator, *_ = build(project, total_limit=None)
    stranger = os.path.join(project, "checkpoints", "checkpoint_0")
    os.makedirs(stranger)
    with open(os.path.join(stranger, "notes.txt"), "w") as f:
        f.write("someone's")  # of unknown origin: nothing says it may go
    accelerator.save_state()
    with open(os.path.join(stranger, "notes.txt")) as f:
        assert f.read() == "someone's"
    report = verify_state_dir(stranger)
    assert report.ok and "notes.txt" in report.files  # listed in the manifest, as a hook's file would be

    # A save that fails in a directory it did not create does not make that directory its own.
    foreign = os.path.join(project, "checkpoints", "checkpoint_1")
    os.makedirs(foreign)
    torch.save({"w": torch.ones(1)}, os.path.join(foreign, "theirs.bin"))  # refused: a pickle
    with pytest.raises(Exception, match="theirs.bin"):
        accelerator.save_state()
    assert "theirs.bin" in os.listdir(foreign)
    # the number is taken again: the directory is still not this run's, and the files the first attempt
    # wrote there are not written over; the refusal says what to do (not the writer's overwrite=True)
    with pytest.raises(
        CheckpointExistsError, match="this save did not write; certckpt never writes over it: save into"
    ):
        accelerator.save_state()
    assert "theirs.bin" in os.listdir(foreign)
    assert accelerator.certckpt.failed is None


def test_what_a_killed_save_of_this_run_left_is_removed_by_the_next_process(tmp_path, monkeypatch, caplog):
    project = str(tmp_path / "proj")
    accelerator, *_ = build(project, total_limit=None)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed between the files and the manifest")

    with monkeypatch.context() as m:
        m.setattr(accelerator_module, "write_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            accelerator.save_state()
    left = os.path.join(project, "checkpoints", "checkpoint_0")
    assert os.listdir(left) and MANIFEST_NAME not in os.listdir(left)
    again, *_ = build(project, total_limit=None)  # a new process: it knows nothing of the last one's save
    with caplog.at_level("WARNING", logger="certckpt"):
        again.save_state()
    assert f"removing {left}, left uncommitted by an earlier save of this run" in caplog.text
    assert verify_state_dir(left).ok and _verdicts(project) == {"main@0": "verified"}


def test_a_committed_directory_is_never_cleared_or_written_over(project_copy):

    accelerator, *_ = build(project_copy, total_limit=None, resume=True)  # latest-good: checkpoint_2
    accelerator.project_configuration.iteration = 1  # names a committed checkpoint's directory
    target = os.path.join(project_copy, "checkpoints", "checkpoint_1")
    before = {f: os.path.getmtime(os.path.join(target, f)) for f in os.listdir(target)}
    with pytest.raises(CheckpointExistsError, match="main@4 is committed there"):
        accelerator.save_state()
    os.remove(os.path.join(target, MANIFEST_NAME))  # damaged: its record still points there
    del before[MANIFEST_NAME]
    with pytest.raises(CheckpointExistsError, match="main@4 is committed there"):
        accelerator.save_state()
    assert {f: os.path.getmtime(os.path.join(target, f)) for f in os.listdir(target)} == before


def test_a_fresh_run_into_a_used_store_is_refused(project_copy):
    accelerator, *_ = build(project_copy, total_limit=None)
    with pytest.raises(ConfigurationError, match="resume with accelerator.load_state"):
        accelerator.save_state()


def test_the_audit_refuses_one_process(tmp_path):
    accelerator, model, opt, *_ = build(str(tmp_path / "proj"), total_limit=None)
    with pytest.raises(AuditSetupError, match="compares processes"):
        AcceleratorAudit(accelerator, model, opt, loss_fn=lambda m, b: m(b).sum())


def test_the_private_accelerator_parts_the_subclass_relies_on_are_still_there(tmp_path):
    """accelerate 1.15 internals read by CertifiedAccelerator (docs/integrations.md, Limits)."""
    accelerator, *_ = build(str(tmp_path / "proj"), total_limit=None)
    for name in (
        "_models",
        "_optimizers",
        "_schedulers",
        "_dataloaders",
        "_custom_objects",
        "_save_model_state_pre_hook",
        "_load_model_state_pre_hook",
    ):
        assert hasattr(accelerator, name), name
    from accelerate import Accelerator

    saving, loading = inspect.signature(Accelerator.save_state), inspect.signature(Accelerator.load_state)
    assert list(saving.parameters)[:3] == ["self", "output_dir", "safe_serialization"]
    assert list(loading.parameters)[:3] == ["self", "input_dir", "load_kwargs"]
    assert "device_placement" in inspect.signature(Accelerator.prepare).parameters


def test_a_missing_extra_is_one_error_in_one_frame_of_certckpt():
    r = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['accelerate'] = None; import certckpt.integrations.accelerate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    frames = [ln for ln in r.stderr.splitlines() if ln.startswith('  File "')]
    assert r.returncode == 1 and len(frames) == 2, r.stderr
    assert r.stderr.splitlines()[-1].endswith("pip install 'certckpt[accelerate]'"), r.stderr


# --- 3 gloo ranks: the audits in the user's own loop ---------------------------------------------


def _ranks(args):
    return run_ranks(accelerate_cases.train, 3, args, timeout=300)


@pytest.mark.slow
def test_three_ranks_catch_a_fault_name_rank_1_keep_latest_good_and_resume_bit_identically(tmp_path):
    # 2 micro-batches per step (accelerator.accumulate), clipping, checkpoints every 5 steps with
    # total_limit=1, audits every 10: a persistent backward fault on rank 1 from step 13 is caught by
    # the replay audit at step 20; main@10 (latest-good) outlives the rotation at step 15.
    reference = _ranks({"project": str(tmp_path / "ref"), "max_steps": 20})
    assert [r["step"] for r in reference] == [20] * 3 and len({r["weights"] for r in reference}) == 1
    assert _verdicts(str(tmp_path / "ref"))["main@20"] == "trusted"

    project = str(tmp_path / "proj")
    fault = {"kind": "backward", "rank": 1, "step": 13, "persistent": True}
    got = _ranks({"project": project, "max_steps": 20, "faults": [fault]})
    assert [(g["kind"], g["step"], g["suspects"]) for g in got] == [("replay", 20, [1])] * 3
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]
    verdicts = _verdicts(project)
    assert (verdicts["main@5"], verdicts["main@10"], verdicts["main@15"]) == ("trusted", "trusted", "suspect")
    r = _cli("latest-good", project, "--dir")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(project, "checkpoints", "checkpoint_1")
    assert _cli("verify", os.path.join(project, "checkpoints", "checkpoint_1")).exit_code == 0
    assert "step 20 on main: replay failed, suspect rank(s) [1]" in _cli("status", project).output

    resumed = _ranks({"project": project, "max_steps": 20, "resume": True})
    assert [(g["start"], g["step"], g["branch"], g["parent"]) for g in resumed] == [(10, 20, "main-r1", "main@10")] * 3
    assert {g["weights"] for g in resumed} == {reference[0]["weights"]}  # bit-identical to the run never faulted
    steps_11_to_20 = reference[0]["losses"][10 * ACCUMULATION :]
    assert resumed[0]["losses"] == steps_11_to_20
    verdicts = _verdicts(project)
    assert verdicts["main-r1@15"] == "trusted" and verdicts["main-r1@20"] == "trusted"
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_4"]  # latest-good released


@pytest.mark.slow
def test_async_saves_on_three_ranks_are_trusted_suspect_and_rotated_as_the_synchronous_ones(tmp_path):
    # The first test's faulted run with async_save: each commit runs behind training, with the
    # consensus fingerprints taken at its step, so the verdicts and the rotation are the same.
    project = str(tmp_path / "proj")
    fault = {"kind": "backward", "rank": 1, "step": 13, "persistent": True}
    got = _ranks({"project": project, "max_steps": 20, "faults": [fault], "async_save": True})
    assert [(g["kind"], g["step"], g["suspects"]) for g in got] == [("replay", 20, [1])] * 3
    verdicts = _verdicts(project)
    assert (verdicts["main@5"], verdicts["main@10"], verdicts["main@15"]) == ("trusted", "trusted", "suspect")
    assert sorted(os.listdir(os.path.join(project, "checkpoints"))) == ["checkpoint_1", "checkpoint_2"]
    r = _cli("latest-good", project, "--dir")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(project, "checkpoints", "checkpoint_1")


@pytest.mark.slow
def test_audit_loss_carries_the_averaging_and_every_replay_matches_bit_for_bit(tmp_path):
    # audit.loss scales the gradient by 1/world (the hook multiplies nothing): the replay, which
    # scales its loss the same way, must reproduce training exactly at every step (audit_every=1,
    # deterministic mode: a differing bit would fail the audit), and the optimizer must get the
    # average a run without the audit computes (within rounding; a sum would be 3x it)
    got = run_ranks(accelerate_cases.averaging, 3, {"project": str(tmp_path)}, timeout=300)
    for g in got:
        assert g["steps"] == 3 and g["last_clean_audit"] == 3 and g["hook_average"] is None
        assert g["max_rel"] < 1e-5, g


@pytest.mark.slow
def test_a_nan_gradient_on_rank_1_is_caught_before_its_update_on_every_rank(tmp_path):
    # step 3 is no audit step: the flags exchanged after the backward (CertifiedAccelerator.backward
    # starts the exchange, the optimizer's pre-hook reads it) name rank 1 on every rank
    fault = {"kind": "non-finite", "rank": 1, "step": 3}
    got = _ranks({"project": str(tmp_path / "p"), "max_steps": 6, "save_every": 100, "faults": [fault]})
    assert [(g["kind"], g["step"], g["suspects"]) for g in got] == [("nonfinite-pre", 3, [1])] * 3
    assert len({g["weights"] for g in got}) == 1  # contained: no rank applied the NaN update


@pytest.mark.slow
def test_certckpt_run_around_accelerate_launch_exits_86_on_a_detection(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "3"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port()), accelerate_cases.__file__]
    cmd = [console_script("certckpt"), "run", "--", *launch, "--project", "proj", "--fault-at", "8"]
    cmd += ["--max-steps", "12"]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert r.returncode == 86, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "incident inc-main-10-replay" in last and "suspect rank(s) [1]" in last, last
    assert _verdicts(str(tmp_path / "proj")) == {"main@5": "trusted"}


def test_batches_are_a_function_of_rank_step_and_micro_batch():
    assert torch.equal(batch_for(1, 3, 0)[0], batch_for(1, 3, 0)[0])
    assert not torch.equal(batch_for(1, 3, 0)[0], batch_for(2, 3, 0)[0])
