"""The Hugging Face Trainer integration (issue 19; issue 18 part 7), with the real transformers 5.x
Trainer on a tiny GPT2 and BERT built from configs (no downloads): certified, pickle-free
checkpoint directories committed to a ledger, verdicts and latest-good, bit-exact resume, refusal
of tampered checkpoints, rollback branches, certified save_pretrained shards, the private Trainer
methods the mixin relies on, and (slow, 3 gloo ranks) the audits catching a planted fault."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from configs: never reach the Hub
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import safetensors
import safetensors.torch
import torch
import transformers
from click.testing import CliRunner

import certckpt
from certckpt.detect.launch import run_ranks
from certckpt.errors import (
    AuditSetupError,
    CheckpointExistsError,
    ConfigurationError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedObjectError,
)
from certckpt.integrations.transformers import (
    MANIFEST_NAME,
    AuditCallback,
    CertifiedTrainer,
    save_function,
    save_pretrained,
    verify_checkpoint,
)
from certckpt.trust.runstore import certify_store
from certckpt_cli.main import main
from tests.support import hf_cases
from tests.support.hf_cases import TokenData, certified_trainer, tiny_bert, tiny_gpt2, training_args

PICKLED = {"optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "training_args.bin"}
EXPECTED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "rng_state.safetensors",
    "trainer.safetensors",
    "trainer_state.json",
    "training_args.json",
}


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def _verdicts(store: str) -> dict[str, str]:
    """``certckpt status STORE --json``: checkpoint id -> verdict."""
    r = _cli("status", store, "--json")
    assert r.exit_code == 0, r.output
    return {c["ckpt_id"]: c["verdict"] for c in json.loads(r.output)["checkpoints"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One certified run: 6 steps, checkpoints at 3 and 6 (copy it before changing it)."""
    out = str(tmp_path_factory.mktemp("hf") / "out")
    trainer = certified_trainer(out)
    trainer.train()
    return {"out": out, "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


@pytest.fixture
def run_copy(trained, tmp_path):
    dst = str(tmp_path / "out")
    shutil.copytree(trained["out"], dst)
    return dst


def test_checkpoint_directory_holds_certified_files_and_json_only(trained):
    ckpt = os.path.join(trained["out"], "checkpoint-3")
    assert set(os.listdir(ckpt)) == EXPECTED  # no optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin
    for name in os.listdir(ckpt):
        if name.endswith(".safetensors"):
            report = certckpt.verify(os.path.join(ckpt, name))
            assert report.ok and report.info.record.step == 3, name
    report = verify_checkpoint(ckpt)
    assert report.ok and report.step == 3 and set(report.files) == EXPECTED - {MANIFEST_NAME}
    state = certckpt.load(os.path.join(ckpt, MANIFEST_NAME))
    assert state["optimizer"]["state"] and state["scheduler"]["last_epoch"] == 3 and state["scaler"] is None
    with open(os.path.join(ckpt, "training_args.json")) as f:
        args = json.load(f)  # TrainingArguments as data
    assert args["output_dir"] == trained["out"] and args["save_steps"] == 3
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 3  # the Trainer's own JSON, unchanged
    rng = certckpt.load(os.path.join(ckpt, "rng_state.safetensors"))
    assert set(rng) == {"python", "numpy", "cpu"} and rng["numpy"][0] == "MT19937"


def test_status_gives_verdicts_and_latest_good_answers(trained):
    out = trained["out"]
    r = _cli("status", out)
    assert r.exit_code == 0 and "newest verified (no audit evidence): main@6" in r.output, r.output
    assert _verdicts(out) == {"main@3": "verified", "main@6": "verified"}
    assert _cli("latest-good", out).exit_code == 1  # nothing is trusted without audits
    r = _cli("latest-good", out, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "checkpoint-6", MANIFEST_NAME)


def test_checkpoint_loads_with_from_pretrained_and_safetensors(trained):
    ckpt = os.path.join(trained["out"], "checkpoint-6")
    model = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in trained["weights"].items())
    with safetensors.safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        assert "transformer.wte.weight" in set(f.keys())


def test_resumed_training_equals_uninterrupted_training(run_copy, tmp_path):
    # The same run, interrupted after its checkpoint at step 3 and resumed from latest-good:
    # optimizer, scheduler, RNG states (dropout is on) and the data position all come back.
    out = str(tmp_path / "interrupted")
    certified_trainer(out, stop=3).train()
    assert sorted(os.listdir(out)) == ["_ledger", "checkpoint-3"]
    resumed = certified_trainer(out)
    resumed.train(resume_from_checkpoint=True)  # latest-good: main@3
    full = certified_trainer(str(tmp_path / "full"))
    full.train()
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.state.global_step == 6 and (resumed.certckpt.branch, resumed.certckpt.parent) == (
        "main-r1",
        "main@3",
    )
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (full, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 6  # steps 1-3 come from trainer_state.json
    assert _verdicts(out) == {"main@3": "verified", "main-r1@6": "verified"}
    assert os.path.isfile(os.path.join(out, "main-r1", "checkpoint-6", MANIFEST_NAME))


def _flip_data_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize(
    "target, words",
    [
        ("model.safetensors", ["model.safetensors", "digest mismatch"]),
        (MANIFEST_NAME, [MANIFEST_NAME, "digest mismatch"]),
        ("trainer_state.json", ["trainer_state.json", "xxh3 digest differs"]),
        ("rng_state.safetensors", ["rng_state.safetensors", "another certified file"]),
        ("config.json", ["config.json", "missing"]),
        ("pytorch_model.bin", ["pytorch_model.bin", "not listed by the checkpoint's manifest"]),
    ],
)
def test_a_tampered_checkpoint_is_refused_on_resume(run_copy, target, words):
    ckpt = os.path.join(run_copy, "checkpoint-3")
    path = os.path.join(ckpt, target)
    if target == "trainer_state.json":  # the step it resumes at, edited in place (same size)
        with open(path) as f:
            text = f.read()
        assert '"global_step": 3' in text
        with open(path, "w") as f:
            f.write(text.replace('"global_step": 3', '"global_step": 2'))
    elif target == "rng_state.safetensors":  # a certified file, but not the one saved with this checkpoint
        os.chmod(path, 0o644)
        shutil.copyfile(os.path.join(run_copy, "checkpoint-6", target), path)
    elif target == "config.json":
        os.remove(path)
    elif target == "pytorch_model.bin":  # weights no record lists, dropped in beside the certified ones
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    else:
        _flip_data_byte(path)
    trainer = certified_trainer(run_copy)
    with pytest.raises(CorruptCheckpointError) as e:
        trainer.train(resume_from_checkpoint=ckpt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"refusing to resume from {ckpt}")
    assert all(w in msg for w in words), msg
    assert trainer.state.global_step == 0  # nothing was loaded, nothing trained


@pytest.mark.slow  # a signed training run (~10 s)
def test_a_keyed_resume_refuses_weights_forged_to_keep_every_xxh3(tmp_path, monkeypatch):
    """A signed run, and weights rewritten by someone with write access and no key: an xxh3 second
    preimage keeps the file's header (its digests and signature) byte for byte. Without keys the
    checkpoint still verifies; with the keys the resume refuses it on the signed BLAKE3."""
    pytest.importorskip("cryptography")
    from certckpt.format.signing import generate_key
    from tests.support.xxh3_forge import forge

    priv, pub = generate_key(tmp_path / "key")
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", str(priv))
    out = str(tmp_path / "out")
    certified_trainer(out, stop=3).train()
    ckpt = os.path.join(out, "checkpoint-3")
    weights = os.path.join(ckpt, "model.safetensors")
    info = certckpt.inspect(weights)
    e = max(info.header.entries, key=lambda e: e.nbytes)
    os.chmod(weights, 0o644)
    with open(weights, "r+b") as f:
        f.seek(info.header.data_start + e.begin)
        data = f.read(e.nbytes)
        f.seek(info.header.data_start + e.begin)
        f.write(forge(data))
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY")
    assert verify_checkpoint(ckpt).ok  # every xxh3 digest and the header still hold
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", str(pub))
    trainer = certified_trainer(out)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors.*BLAKE3 differs from the one signed"):
        trainer.train(resume_from_checkpoint=ckpt)
    assert trainer.state.global_step == 0


def test_resume_from_latest_good_skips_a_checkpoint_with_a_damaged_file(tmp_path, caplog):
    # `certckpt latest-good` re-verifies the committed manifest only; resuming checks every file of
    # the directory and falls back to the next good checkpoint (a rollback: a new branch).
    out = str(tmp_path / "out")
    certified_trainer(out).train()
    _flip_data_byte(os.path.join(out, "checkpoint-6", "model.safetensors"))
    trainer = certified_trainer(out)
    with caplog.at_level("WARNING", logger="certckpt.integrations.transformers.trainer"):
        trainer.train(resume_from_checkpoint=True)
    assert "not resuming from main@6" in caplog.text and "digest mismatch" in caplog.text
    assert (trainer.certckpt.branch, trainer.certckpt.parent, trainer.state.global_step) == ("main-r1", "main@3", 6)


def test_resume_from_checkpoint_true_on_a_first_run_trains_from_scratch(tmp_path):
    # the README's one line serves the first run and every restart
    out = str(tmp_path / "first")
    trainer = certified_trainer(out)
    trainer.train(resume_from_checkpoint=True)
    assert (trainer.certckpt.branch, trainer.certckpt.parent, trainer.state.global_step) == ("main", None, 6)
    assert _verdicts(out) == {"main@3": "verified", "main@6": "verified"}


def test_a_plain_trainer_checkpoint_is_refused_with_its_pickles_named(tmp_path):
    out = str(tmp_path / "plain")
    transformers.Trainer(model=tiny_gpt2(), args=training_args(out, max_steps=3), train_dataset=TokenData()).train()
    with pytest.raises(NotACheckpointError, match=r"written by the plain Trainer \(optimizer.pt, scheduler.pt"):
        certified_trainer(str(tmp_path / "other")).train(resume_from_checkpoint=os.path.join(out, "checkpoint-3"))


def test_a_fresh_run_into_a_used_store_is_refused(run_copy):
    with pytest.raises(ConfigurationError, match=r"holds checkpoints of branch 'main' already \(newest main@6\)"):
        certified_trainer(run_copy).train()


def _crashes_at_step_3(out: str):
    """A certified Trainer whose process dies at step 3's save, after the weights and RNG files are
    written and before the manifest: what a killed job leaves."""
    from certckpt.integrations.transformers import CertifiedTrainer

    class Crashes(CertifiedTrainer):
        def _save_rng_state(self, output_dir):
            super()._save_rng_state(output_dir)
            raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        Crashes(model=tiny_gpt2(), args=training_args(out), train_dataset=TokenData()).train()
    left = os.path.join(out, "checkpoint-3")
    assert os.path.isfile(os.path.join(left, "model.safetensors"))
    assert not os.path.exists(os.path.join(left, MANIFEST_NAME))
    return left


def _contents(directory: str) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def test_what_a_crashed_save_of_this_run_left_is_removed_and_the_step_saved_again(tmp_path, caplog):
    out = str(tmp_path / "out")
    left = _crashes_at_step_3(out)
    trainer = certified_trainer(out)  # the same run (its name is the output directory's), from scratch
    with caplog.at_level("WARNING", logger="certckpt"):
        trainer.train()
    assert f"removing {left}, left uncommitted by an earlier save of this run" in caplog.text
    assert set(os.listdir(left)) == EXPECTED and verify_checkpoint(left).ok
    assert _verdicts(out) == {"main@3": "verified", "main@6": "verified"}


def _plain_checkpoint(out: str) -> str:
    transformers.Trainer(model=tiny_gpt2(), args=training_args(out, max_steps=3), train_dataset=TokenData()).train()
    return os.path.join(out, "checkpoint-3")


def _committed_elsewhere(out: str, trained: dict) -> str:
    """checkpoint-3 of a committed run copied beside no ledger (a lost one, or another store's)."""
    os.makedirs(out)
    shutil.copytree(os.path.join(trained["out"], "checkpoint-3"), os.path.join(out, "checkpoint-3"))
    return os.path.join(out, "checkpoint-3")


@pytest.mark.parametrize(
    "make, run, words",
    [
        (lambda out, trained: _plain_checkpoint(out), None, "it holds optimizer.pt, a pickle, which certckpt never"),
        (_committed_elsewhere, None, "a manifest, which may be committed to a ledger other than this one"),
        (lambda out, trained: _crashes_at_step_3(out), "other", "written by run 'out' at step 3 (not 'other' at 3)"),
    ],
    ids=["plain-trainer", "manifest-no-record", "another-run"],
)
def test_a_directory_this_run_did_not_leave_is_refused_before_training_and_left_untouched(
    trained, tmp_path, make, run, words
):
    out = str(tmp_path / "out")
    target = make(out, trained)
    before = _contents(target)
    trainer = certified_trainer(out, trainer_kwargs={"run": run} if run else None)
    with pytest.raises(CheckpointExistsError, match=r"checkpoint-3: not a leftover of this run's own save at step 3 "):
        trainer.train()
    with pytest.raises(CheckpointExistsError, match=re.escape(words)):
        certified_trainer(out, trainer_kwargs={"run": run} if run else None).train()
    assert trainer.state.global_step == 0  # refused before the first step
    assert _contents(target) == before
    assert not os.path.exists(os.path.join(out, "_ledger", "records"))  # nothing committed


def test_a_committed_checkpoint_in_the_way_is_refused_whatever_its_branch(run_copy):
    # a save of another branch whose directory is main@6's (the ledger holds no record of that branch
    # at step 6: the check by id alone took the directory for a leftover and removed it)
    trainer = certified_trainer(run_copy)
    trainer.certckpt.branch = "other"
    with pytest.raises(CheckpointExistsError, match=r"checkpoint-6: .*\(main@6 is committed there\)"):
        trainer._certckpt_clear(os.path.join(run_copy, "checkpoint-6"), 6)
    assert verify_checkpoint(os.path.join(run_copy, "checkpoint-6")).ok


def test_resuming_from_an_older_checkpoint_starts_a_branch_that_supersedes_the_rest(tmp_path):
    run_copy = str(tmp_path / "out")
    certified_trainer(run_copy).train()
    trainer = certified_trainer(run_copy)
    trainer.train(resume_from_checkpoint=os.path.join(run_copy, "checkpoint-3"))
    run = trainer.certckpt
    assert (run.branch, run.parent) == ("main-r1", "main@3")
    assert os.path.isfile(os.path.join(run_copy, "main-r1", "checkpoint-6", MANIFEST_NAME))  # main's stays
    assert verify_checkpoint(os.path.join(run_copy, "checkpoint-6")).ok
    # main@6 was awaiting evidence that will never come: superseded by the fork at main@3
    assert _verdicts(run_copy) == {"main@3": "verified", "main@6": "suspect", "main-r1@6": "verified"}
    assert "superseded" in _cli("status", run_copy).output
    with open(os.path.join(run_copy, "_ledger", "branches", "main-r1.json")) as f:
        assert json.load(f)["parent"] == "main@3"
    again = certified_trainer(run_copy, trainer_kwargs={"branch": "main-r1"})
    with pytest.raises(ConfigurationError, match="branch 'main-r1' exists"):
        again.train(resume_from_checkpoint=True)


def test_checkpoints_the_trainer_rotates_away_are_retired(tmp_path):
    out = str(tmp_path / "rot")
    certified_trainer(out, save_steps=2, save_total_limit=1).train()
    assert sorted(os.listdir(out)) == ["_ledger", "checkpoint-6"]
    assert sorted(os.listdir(os.path.join(out, "_ledger", "retired"))) == ["main@2.json", "main@4.json"]
    r = _cli("latest-good", out, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "checkpoint-6", MANIFEST_NAME)


@pytest.mark.parametrize("tamper", [False, True], ids=["intact", "tampered"])
def test_load_best_model_at_end_verifies_the_best_checkpoint(tmp_path, tamper):
    from transformers import TrainerCallback

    class TamperBest(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # after the last save and evaluation
            if tamper and state.global_step == args.max_steps:
                _flip_data_byte(os.path.join(state.best_model_checkpoint, "model.safetensors"))

    out = str(tmp_path / "best")
    best = dict(eval_strategy="steps", eval_steps=3, load_best_model_at_end=True, metric_for_best_model="loss")
    trainer = certified_trainer(out, callbacks=[TamperBest()], trainer_kwargs={"eval_dataset": TokenData(8)}, **best)
    if tamper:
        with pytest.raises(CorruptCheckpointError, match="model.safetensors.*digest mismatch"):
            trainer.train()
        return
    trainer.train()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(trainer.state.best_model_checkpoint).state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in trainer.model.state_dict().items() if k in loaded)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path)


def test_async_checkpoints_equal_the_synchronous_ones_and_rotate_alike(trained, tmp_path):
    out = str(tmp_path / "async")
    trainer = certified_trainer(out, trainer_kwargs={"async_save": True})
    trainer.train()
    assert not trainer.certckpt.pipeline.in_flight  # train() returns once the last one is committed
    for step in (3, 6):
        a, s = os.path.join(out, f"checkpoint-{step}"), os.path.join(trained["out"], f"checkpoint-{step}")
        assert set(os.listdir(a)) == EXPECTED and verify_checkpoint(a).ok
        got, want = _tensors(os.path.join(a, "model.safetensors")), _tensors(os.path.join(s, "model.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        ga, gs = (certckpt.load(os.path.join(d, MANIFEST_NAME))["optimizer"]["state"] for d in (a, s))
        assert all(torch.equal(ga[i]["exp_avg"], gs[i]["exp_avg"]) for i in gs)  # copied at its step
    assert _verdicts(out) == {"main@3": "verified", "main@6": "verified"}
    weights = os.path.getsize(os.path.join(out, "checkpoint-6", "model.safetensors"))
    assert 0.9 * weights < trainer.certckpt.pipeline.staging_bytes <= weights  # the shard's snapshot, reused

    rot = str(tmp_path / "rot")
    certified_trainer(rot, save_steps=2, save_total_limit=1, trainer_kwargs={"async_save": True}).train()
    assert sorted(os.listdir(rot)) == ["_ledger", "checkpoint-6"]
    assert sorted(os.listdir(os.path.join(rot, "_ledger", "retired"))) == ["main@2.json", "main@4.json"]


def test_an_async_checkpoint_that_fails_in_the_background_is_raised_at_the_next_one(tmp_path):
    from certckpt.errors import AsyncSaveError
    from certckpt.integrations.transformers import CertifiedTrainer

    class PlantsAPickle(CertifiedTrainer):
        def _save_rng_state(self, output_dir):
            super()._save_rng_state(output_dir)
            if self.state.global_step == 3:  # the background manifest writer refuses the directory
                torch.save({"w": torch.ones(1)}, os.path.join(output_dir, "optimizer.pt"))

    out = str(tmp_path / "fails")
    trainer = PlantsAPickle(model=tiny_gpt2(), args=training_args(out), train_dataset=TokenData(), async_save=True)
    with pytest.raises(AsyncSaveError, match=r"checkpoint-3: the asynchronous checkpoint failed .*a pickled file"):
        trainer.train()
    assert trainer.state.global_step == 6  # training went on until the next checkpoint asked for it
    assert not os.path.exists(os.path.join(out, "checkpoint-3", MANIFEST_NAME))
    assert not os.path.exists(os.path.join(out, "checkpoint-6"))  # not started: the failure came first
    assert _cli("status", out).output.strip() == "no committed checkpoints"


@pytest.mark.parametrize(
    "name, words",
    [("extra.pt", "a pickled file"), ("extra.safetensors", "without a certckpt record")],
)
def test_a_pickle_or_an_uncertified_file_in_the_directory_is_never_committed(tmp_path, name, words):
    from certckpt.integrations.transformers.checkpoint import write_manifest

    d = tmp_path / "checkpoint-1"
    d.mkdir()
    certckpt.save({"w": torch.ones(2)}, str(d / "model.safetensors"))
    if name.endswith(".pt"):
        torch.save({"w": torch.ones(2)}, d / name)  # what the plain Trainer would have written
    else:
        safetensors.torch.save_file({"w": torch.ones(2)}, str(d / name))
    with pytest.raises(UnsupportedObjectError, match=words):
        write_manifest(str(d), {}, step=1, run="r", branch="main", parent=None)
    assert not (d / MANIFEST_NAME).exists()


def test_save_model_writes_certified_weights_and_arguments_as_json(trained, tmp_path):
    trainer = certified_trainer(str(tmp_path / "unused"))
    final = str(tmp_path / "final")
    trainer.save_model(final)
    names = set(os.listdir(final))
    assert "training_args.json" in names and not names & PICKLED
    assert certckpt.verify(os.path.join(final, "model.safetensors")).ok
    trainer.save_model(final)  # a plain save replaces its files, as the Trainer's does


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_bert], ids=["gpt2", "bert"])
@pytest.mark.parametrize("shard", [None, "40KB"], ids=["one-file", "sharded"])
def test_save_pretrained_writes_certified_shards_from_pretrained_loads(build, shard, tmp_path):
    model = build()
    d = str(tmp_path / "m")
    written = save_pretrained(model, d, **({"max_shard_size": shard} if shard else {}))
    weights = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    assert weights and sorted(os.path.basename(p) for p in written) == weights
    assert (len(weights) > 1) == (shard is not None)
    for n in weights:
        assert certckpt.verify(os.path.join(d, n)).ok
    again = type(model).from_pretrained(d)
    a, b = model.state_dict(), again.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_save_function_has_the_shard_writer_signature(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_function({"w": torch.ones(3)}, path, metadata={"format": "pt"})
    assert certckpt.verify(path).ok
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata()["format"] == "pt"
    with pytest.raises(UnsupportedObjectError, match=r"metadata keys \['quant_method'\]"):
        save_function({"w": torch.ones(3)}, str(tmp_path / "q.safetensors"), metadata={"quant_method": "x"})


def test_transformers_5_ignores_save_function_which_is_why_save_pretrained_exists(tmp_path):
    # Pins issue 18's finding on this transformers release: save_function= lands in **kwargs.
    d = str(tmp_path / "plain")
    tiny_gpt2().save_pretrained(d, save_function=save_function)
    with pytest.raises(NotACheckpointError):
        certckpt.verify(os.path.join(d, "model.safetensors"))


def test_the_private_trainer_methods_the_mixin_overrides_are_still_there():
    # The mixin overrides these private methods of transformers.Trainer (5.x); a release that renames
    # one or changes its parameters must fail here, not silently write plain files.
    expected = {
        "_save": ["self", "output_dir", "state_dict"],
        "_save_checkpoint": ["self", "model", "trial"],
        "_save_optimizer_and_scheduler": ["self", "output_dir"],
        "_save_scaler": ["self", "output_dir"],
        "_save_rng_state": ["self", "output_dir"],
        "_load_optimizer_and_scheduler": ["self", "checkpoint"],
        "_load_scaler": ["self", "checkpoint"],
        "_load_rng_state": ["self", "checkpoint"],
        "_load_best_model": ["self"],
        "_get_output_dir": ["self", "trial"],
        "_finalize_training": ["self", "trial", "num_train_samples", "start_time"],
        "training_step": ["self", "model", "inputs", "num_items_in_batch"],
        "compute_loss": ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
    }
    for name, params in expected.items():
        assert list(inspect.signature(getattr(transformers.Trainer, name)).parameters) == params, name
    src = inspect.getsource(transformers.Trainer._save_checkpoint)
    for call in ("self.save_model(", "self._save_optimizer_and_scheduler(", "self._save_rng_state(", "save_to_json("):
        assert call in src, call
    assert callable(transformers.modeling_utils.safe_save_file)  # the shard writer save_pretrained calls


def test_audit_callback_needs_the_certified_trainer_and_ddp(tmp_path):
    plain = transformers.Trainer(
        model=tiny_gpt2(),
        args=training_args(str(tmp_path / "a"), max_steps=1),
        train_dataset=TokenData(),
        callbacks=[AuditCallback()],
    )
    with pytest.raises(AuditSetupError, match="needs CertifiedTrainer"):
        plain.train()
    with pytest.raises(AuditSetupError, match="run the Trainer under DDP"):
        certified_trainer(str(tmp_path / "b"), callbacks=[AuditCallback()], max_steps=1).train()


def test_unsupported_setups_are_refused_at_construction(tmp_path):
    with pytest.raises(ConfigurationError, match="branch"):
        CertifiedTrainer(model=tiny_gpt2(), args=training_args(str(tmp_path / "x")), branch="a/b")


# --- 3 gloo ranks: the audits under the Trainer's DDP ------------------------------------------


def _ranks(args, timeout=240):
    return run_ranks(hf_cases.audited_run, 3, args, timeout=timeout)


@pytest.mark.slow
def test_ddp_audits_catch_a_planted_fault_and_resume_from_latest_good_on_a_branch(tmp_path):
    out = str(tmp_path / "ddp")
    # A persistent backward fault on rank 1 from step 5: the replay audit at step 6 names rank 1.
    fault = {"kind": "backward", "rank": 1, "step": 5, "persistent": True}
    got = _ranks({"out": out, "faults": [fault]})
    assert [(g["kind"], g["step"], g["suspects"], g["contained"]) for g in got] == [("replay", 6, [1], False)] * 3
    assert len({g["incident"] for g in got}) == 1
    assert sorted(os.listdir(os.path.join(out, "checkpoint-4"))) == sorted(
        EXPECTED - {"rng_state.safetensors"} | {f"rng_state_{r}.safetensors" for r in range(3)}
    )
    assert _verdicts(out) == {"main@2": "trusted", "main@4": "trusted"}
    assert "step 6 on main: replay failed, suspect rank(s) [1]" in _cli("status", out).output
    assert _cli("latest-good", out).output.strip() == os.path.join(out, "checkpoint-4", MANIFEST_NAME)
    assert os.listdir(os.path.join(out, "_ledger", "incidents"))

    # Resume from latest-good without the fault: a new branch from main@4, audited and trusted; the
    # replicas proved they hold main@4's weights before the first step.
    parent_fp = certify_store(out, write_certificates=False).entry("main@4").consensus_fp
    assert parent_fp
    got = _ranks({"out": out, "resume": True})
    assert [(g.get("kind"), g["global_step"], g["branch"], g["parent"], g["proof"]) for g in got] == [
        (None, 8, "main-r1", "main@4", [4, parent_fp])
    ] * 3
    assert _verdicts(out) == {"main@2": "trusted", "main@4": "trusted", "main-r1@6": "trusted", "main-r1@8": "trusted"}
    assert _cli("latest-good", out).output.strip() == os.path.join(out, "main-r1", "checkpoint-8", MANIFEST_NAME)

    # main@4 again, but rank 0's weights changed once loaded (DDP hands them to every replica): every
    # rank refuses before the first step, naming both fingerprints; nothing new is committed.
    got = _ranks({"out": out, "resume": "main@4", "alter": True})
    assert [(g["global_step"], g["branch"], g["parent"]) for g in got] == [(4, "main-r2", "main@4")] * 3
    assert len({g["refused"] for g in got}) == 1
    assert f"but the checkpoint resumed from (the parent) recorded {parent_fp}" in got[0]["refused"]
    assert _verdicts(out) == {"main@2": "trusted", "main@4": "trusted", "main-r1@6": "trusted", "main-r1@8": "trusted"}


@pytest.mark.slow
def test_save_total_limit_never_deletes_the_latest_good_and_it_survives_a_detection(tmp_path):
    out = str(tmp_path / "rot")
    # save_total_limit=1, checkpoints every 2 steps, audits every 4, a persistent fault from step 5:
    # checkpoint-4 (latest-good) would be deleted when checkpoint-6 is saved, before the audit at 8.
    # Saved in the background (async_save): the commits, the rotation and the detection's stop all
    # happen with a checkpoint in flight, and end as the synchronous path ends.
    fault = {"kind": "backward", "rank": 1, "step": 5, "persistent": True}
    args = {"out": out, "faults": [fault], "audit_every": 4, "save_total_limit": 1, "max_steps": 10}
    got = _ranks(args | {"async_save": True})
    assert [(g["kind"], g["step"], g["suspects"]) for g in got] == [("replay", 8, [1])] * 3
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-6"]
    assert _verdicts(out)["main@4"] == "trusted" and _verdicts(out)["main@6"] == "suspect"
    r = _cli("latest-good", out)
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "checkpoint-4", MANIFEST_NAME)
    assert _cli("verify", os.path.join(out, "checkpoint-4")).exit_code == 0
    assert sorted(os.listdir(os.path.join(out, "_ledger", "retired"))) == ["main@2.json"]


@pytest.mark.slow
def test_the_end_of_training_cleanup_keeps_the_best_and_the_latest_good(tmp_path):
    # save_total_limit=1 with a best model: the plain Trainer deletes every checkpoint but the best at
    # the end of training. The "best" here is the highest eval loss (an early checkpoint), latest-good
    # the newest audited one: both stay.
    out = str(tmp_path / "best")
    got = _ranks({"out": out, "audit_every": 4, "save_total_limit": 1, "max_steps": 8, "best": "highest-loss"})
    assert [g.get("kind") for g in got] == [None] * 3
    r = _cli("latest-good", out)
    assert r.exit_code == 0 and r.output.strip() == os.path.join(out, "checkpoint-8", MANIFEST_NAME)
    kept = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert "checkpoint-8" in kept and len(kept) == 2, kept  # the best (an earlier one) and latest-good
    assert _cli("verify", os.path.join(out, "checkpoint-8")).exit_code == 0


@pytest.mark.slow
def test_ddp_consensus_names_a_rank_whose_weights_diverge_with_accumulation(tmp_path):
    # Two micro-batches per step (the replay at step 2 accumulates them as training does); a one-time
    # fault in rank 2's stored weights after step 3's update: the consensus of step 3 names it.
    out = str(tmp_path / "ddp")
    fault = {"kind": "post-optimizer", "rank": 2, "step": 3}
    args = {"out": out, "faults": [fault], "ga": 2, "consensus_every": 1, "max_steps": 4, "save_steps": 2}
    got = _ranks(args)
    assert [(g["kind"], g["step"], g["suspects"], g["contained"]) for g in got] == [("consensus", 3, [2], False)] * 3
    assert _verdicts(out) == {"main@2": "trusted"}  # audited at 2; nothing committed after the fault


@pytest.mark.slow
def test_batchnorm_statistics_are_in_the_consensus_and_a_corrupted_one_is_named(tmp_path):
    # DDP broadcasts rank 0's buffers at every forward: the session seals them on rank 0 and compares
    # every replica's, so the checkpoints' fingerprints cover them too.
    clean = str(tmp_path / "clean")
    got = run_ranks(hf_cases.batchnorm_run, 3, {"out": clean}, timeout=240)
    assert all("kind" not in g and "bn.running_mean" in g["buffers"] for g in got)
    assert _verdicts(clean) == {"main@3": "trusted", "main@6": "trusted"}
    # rank 0 (the broadcast source) gets a value of its running statistics changed outside a forward
    bad = str(tmp_path / "bad")
    fault = {"kind": "buffer", "rank": 0, "step": 3}
    got = run_ranks(hf_cases.batchnorm_run, 3, {"out": bad, "faults": [fault]}, timeout=240)
    assert [(g["kind"], g["step"], g["suspects"]) for g in got] == [("consensus", 3, [0])] * 3
