"""certckpt under a real PyTorch Lightning Trainer: CertifiedCheckpointIO, AuditCallback, load_from_checkpoint.

The single-process tests run the Trainer in this process; the DDP tests run 3 gloo ranks, once
started from outside (as torchrun would) and once by Lightning's own launcher from a user's script.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import certckpt  # noqa: E402
from certckpt.errors import AuditSetupError, ConfigurationError, CorruptCheckpointError, NotACheckpointError  # noqa: E402
from certckpt.integrations.lightning import (  # noqa: E402
    AuditCallback,
    CertifiedCheckpointIO,
    CertifiedLoading,
    load_from_checkpoint,
)
from certckpt.trust.runstore import certify_store, find_latest_good  # noqa: E402
from tests.support import lightning_cases  # noqa: E402
from tests.support.helpers import ROOT  # noqa: E402

AttributeDict = pytest.importorskip("lightning_fabric.utilities.data").AttributeDict


class Lit(pl.LightningModule):
    """A tiny regression model whose hyper-parameters hold a Namespace and an AttributeDict."""

    def __init__(self, args: argparse.Namespace, extra: dict | None = None, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.saved: dict[int, dict] = {}  # what Lightning handed to the checkpoint IO, per step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)}

    def on_save_checkpoint(self, checkpoint):
        # Called last while Lightning builds the dict: a copy of exactly what the IO receives.
        self.saved[checkpoint["global_step"]] = copy.deepcopy(checkpoint)


def _model(lr: float = 0.05) -> Lit:
    torch.manual_seed(0)
    return Lit(argparse.Namespace(depth=2, name="tiny", dims=(6, 16, 3)), AttributeDict(act="tanh", width=16), lr=lr)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].sin()), batch_size=4, shuffle=False)  # 10 steps per epoch


def _trainer(**kw) -> pl.Trainer:
    kw.setdefault("callbacks", [])
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in kw["callbacks"]),
        **kw,
    )


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        warnings.filterwarnings("ignore", module="lightning_fabric")
        yield


def _same(a, b, where="") -> None:
    """Deep equality, types included (a Namespace must come back a Namespace)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        _same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_lightning_checkpoint_round_trips_without_pickle(tmp_path):
    model = _model()
    d = tmp_path / "not" / "yet" / "there"
    callbacks = [
        ModelCheckpoint(dirpath=d, every_n_train_steps=5, save_top_k=-1),
        EarlyStopping(monitor="train_loss", patience=100, check_on_train_epoch_end=True),
    ]
    _trainer(max_steps=10, callbacks=callbacks, plugins=[CertifiedCheckpointIO()]).fit(model, _data())
    path = d / "epoch=0-step=10.ckpt"
    # Lightning's resume passes a callable map_location (TorchCheckpointIO's default is this one).
    loaded = CertifiedCheckpointIO().load_checkpoint(path, map_location=lambda storage, loc: storage)
    _same(loaded, model.saved[10], "checkpoint")  # every key, value and type, as Lightning built it
    hp = loaded["hyper_parameters"]
    assert isinstance(hp["args"], argparse.Namespace) and hp["args"].dims == (6, 16, 3)
    assert isinstance(hp["extra"], AttributeDict) and hp["extra"].width == 16
    assert any(k.startswith("ModelCheckpoint{") for k in loaded["callbacks"])
    assert any(k.startswith("EarlyStopping{") for k in loaded["callbacks"])
    assert loaded["lr_schedulers"][0]["step_size"] == 4 and loaded["optimizer_states"][0]["state"]
    assert loaded["pytorch-lightning_version"] == pl.__version__ and "fit_loop" in loaded["loops"]
    record = certckpt.inspect(str(path)).record
    assert (record.step, record.branch, record.user["epoch"], record.user["global_step"]) == (10, "main", "0", "10")
    assert certckpt.verify(str(path)).ok
    # the file is a safetensors file any reader opens
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert any(k.startswith("state_dict.net.0.weight") for k in f.keys())  # noqa: SIM118
    status = certify_store(str(d), write_certificates=False)
    assert {c: v.label for c, v in status.certification.verdicts.items()} == {
        "main@5": "verified",
        "main@10": "verified",
    }
    # a path in a directory nobody created, and an fsspec URL, through Trainer.save_checkpoint's IO
    io = CertifiedCheckpointIO()
    io.save_checkpoint(model.saved[10], tmp_path / "a" / "b" / "manual.ckpt")
    assert certckpt.verify(str(tmp_path / "a" / "b" / "manual.ckpt")).ok


def test_last_ckpt_rotation_and_resaved_names_keep_a_coherent_ledger(tmp_path):
    rotating, rolling = tmp_path / "rotating", tmp_path / "rolling"
    callbacks = [
        # keeps the newest file only (the older one is removed), and rewrites last.ckpt at every save
        ModelCheckpoint(dirpath=rotating, every_n_train_steps=5, save_top_k=1, save_last=True),
        # one fixed name, written again at every save (every 4 steps: Lightning wants its callbacks distinct)
        ModelCheckpoint(dirpath=rolling, filename="rolling", every_n_train_steps=4, save_top_k=1),
    ]
    model = _model()
    _trainer(max_steps=20, callbacks=callbacks, plugins=[CertifiedCheckpointIO()]).fit(model, _data())

    assert sorted(os.listdir(rotating)) == ["_ledger", "epoch=1-step=20.ckpt", "last.ckpt"]
    status = certify_store(str(rotating), verify_bytes=True, write_certificates=False)
    assert sorted(status.snapshot.retired) == ["main@10", "main@15", "main@5"]  # removed by save_top_k
    assert status.certification.verdicts["main@20"].label == "verified" and not status.problems
    last = str(rotating / "last.ckpt")  # rewritten at each save; a second file of step 20, not committed
    assert certckpt.inspect(last).record.step == 20 and certckpt.verify(last).ok
    assert status.uncommitted == [] and all(r["url"] != "last.ckpt" for r in status.snapshot.records.values())
    _same(certckpt.load(last)["state_dict"], model.saved[20]["state_dict"], "last.ckpt")

    assert sorted(os.listdir(rolling)) == ["_ledger", "rolling.ckpt"]
    status, latest = find_latest_good(str(rolling), accept="verified", write_certificates=False)
    # each save retired the commit of the file it replaced; the newest names the file now
    assert sorted(status.snapshot.retired) == ["main@12", "main@16", "main@4", "main@8"] and latest == "main@20"
    assert status.entry(latest).url == str(rolling / "rolling.ckpt") and not status.problems
    assert certckpt.inspect(str(rolling / "rolling.ckpt")).record.step == 20
    # the CLI reads the same ledger (a file that Lightning rewrote is never reported corrupt)
    from tests.support.helpers import console_script

    cli = subprocess.run(
        [console_script("certckpt"), "latest-good", str(rolling), "--accept", "verified"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and cli.stdout.strip().endswith("rolling.ckpt"), cli.stderr


def test_under_lightnings_async_checkpoint_io_rotation_and_commits_match_the_synchronous_run(tmp_path):
    """Lightning's AsyncCheckpointIO saves on its own thread and rotates on the training thread,
    before the file it lets go (or the newer one) is even written: those removals wait for a later
    commit, so the store ends as a synchronous run leaves it."""
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    d = tmp_path / "rotating"
    callbacks = [ModelCheckpoint(dirpath=d, every_n_train_steps=5, save_top_k=1, save_last=True)]
    model = _model()
    _trainer(max_steps=20, callbacks=callbacks, plugins=[AsyncCheckpointIO(CertifiedCheckpointIO())]).fit(
        model, _data()
    )
    assert sorted(os.listdir(d)) == ["_ledger", "epoch=1-step=20.ckpt", "last.ckpt"]
    status, latest = find_latest_good(str(d), accept="verified", write_certificates=False)
    assert sorted(status.snapshot.retired) == ["main@10", "main@15", "main@5"] and latest == "main@20"
    assert not status.problems and status.uncommitted == []
    _same(certckpt.load(str(d / "epoch=1-step=20.ckpt"))["state_dict"], model.saved[20]["state_dict"], "step 20")


def test_a_file_let_go_between_its_rename_and_its_commit_is_retired_by_a_later_commit(tmp_path):
    """The race behind the async run above, made certain: the save thread has renamed the file into
    place and not yet committed it when the training thread lets it go. Deleted then, the commit
    would name a missing file that is never retired; it waits for the next commit instead."""
    import threading

    written, go = threading.Event(), threading.Event()

    class Paused(CertifiedCheckpointIO):
        def _write(self, *args, **kw):
            result = super()._write(*args, **kw)
            if kw["step"] == 5:  # renamed into place; the commit record is next
                written.set()
                go.wait(30)
            return result

    io, d, model = Paused(), tmp_path / "ckpt", _model()
    checkpoint = {"global_step": 5, "epoch": 0, "state_dict": model.state_dict()}
    saver = threading.Thread(target=io.save_checkpoint, args=(checkpoint, d / "step5.ckpt"))
    saver.start()
    try:
        assert written.wait(30)
        io.remove_checkpoint(d / "step5.ckpt")  # on the training thread, while step 5 is uncommitted
        assert (d / "step5.ckpt").exists()  # not deleted under the commit about to name it
    finally:
        go.set()
        saver.join(30)
    io.save_checkpoint({**checkpoint, "global_step": 10}, d / "step10.ckpt")
    assert sorted(os.listdir(d)) == ["_ledger", "step10.ckpt"]
    status, latest = find_latest_good(str(d), accept="verified", write_certificates=False)
    assert sorted(status.snapshot.retired) == ["main@5"] and latest == "main@10"
    assert not status.problems


def test_a_retirement_record_nothing_seals_never_lets_a_save_write_over_the_file_it_names(tmp_path):
    """A retirement record planted in the ledger (or left unsealed) used to count: the checkpoint it
    names lost its file's name, and the next save under that name wrote over the file with no gate
    asked. It counts for nothing now; the save asks the gate, and the retirement it cannot record
    (the name is taken) keeps the file aside instead of letting it go."""
    d = tmp_path / "ckpt"
    first = {"global_step": 5, "epoch": 0, "state_dict": {"w": torch.ones(3)}}
    CertifiedCheckpointIO().save_checkpoint(first, d / "rolling.ckpt")
    (d / "_ledger" / "retired").mkdir()
    planted = {"ckpt_id": "main@5", "reason": "planted", "policy": "x", "at": 1.0}
    (d / "_ledger" / "retired" / "main@5.json").write_text(json.dumps(planted))
    status = certify_store(str(d), write_certificates=False)
    assert "main@5" not in status.snapshot.retired and status.snapshot.available("main@5")
    assert ("retired/main@5.json", "sealed by no chain entry") in [
        (r, w.split(" (")[0]) for r, w in status.snapshot.invalid
    ]

    with pytest.warns(
        UserWarning, match=r"kept main@5 as .*certckpt-kept-main@5.ckpt: its retirement cannot be recorded"
    ):
        CertifiedCheckpointIO().save_checkpoint({**first, "global_step": 10}, d / "rolling.ckpt")
    status = certify_store(str(d), write_certificates=False)
    kept = status.snapshot.kept["main@5"]  # the file's new name was recorded, sealed, before the new file took the old
    assert kept["replaced"] == str(d / "rolling.ckpt") and certckpt.inspect(str(d / "rolling.ckpt")).record.step == 10
    assert status.certification.verdicts["main@10"].label == "verified"


def test_resume_through_the_plugin_trains_like_an_uninterrupted_run(tmp_path):
    whole = _model()
    _trainer(max_epochs=2).fit(whole, _data())

    d = tmp_path / "ckpt"
    first = _model()
    _trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=d)], plugins=[CertifiedCheckpointIO()]).fit(
        first, _data()
    )
    io = CertifiedCheckpointIO()
    resumed = _model()
    trainer = _trainer(max_epochs=2, callbacks=[ModelCheckpoint(dirpath=d)], plugins=[io])
    trainer.fit(resumed, _data(), ckpt_path=str(d / "epoch=0-step=10.ckpt"))
    assert trainer.global_step == 20
    for a, b in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(a, b)  # optimizer, scheduler and loop state came back: the same bits
    # a resumed run records on a new branch forked from the checkpoint (ids never collide)
    point = io.resume_point
    assert (point.parent, point.step, point.branch, point.level) == ("main@10", 10, "main-r1", "verified")
    status = certify_store(str(d), write_certificates=False)
    assert status.certification.verified_order == ["main-r1@20", "main@10"]
    assert status.snapshot.branch_parents == {"main-r1": "main@10"}
    with pytest.raises(ConfigurationError, match="new branch name"):
        CertifiedCheckpointIO(branch="main-r1").load_checkpoint(d / "epoch=0-step=10.ckpt")
    # a file that names main@10 but is not the one committed (another store's): a new branch without
    # a parent, with a warning, and no weights for an audit to prove
    other = tmp_path / "other.ckpt"
    certckpt.save({"global_step": 10, "state_dict": {"w": torch.ones(2)}}, other, step=10)
    io = CertifiedCheckpointIO(ledger=str(d))
    with pytest.warns(UserWarning, match=r"other.ckpt is not the checkpoint main@10 committed to .*without a parent"):
        io.load_checkpoint(other)
    point = io.resume_point
    assert (io.parent, io.branch, point.consensus_fp, point.level) == (
        None,
        "main-r2",
        None,
        "not committed in this store",
    )


def _certified_fit(tmp_path):
    """A model trained 10 steps and the certified checkpoint of its last step."""
    model = _model()
    d = tmp_path / "ckpt"
    _trainer(max_steps=10, callbacks=[ModelCheckpoint(dirpath=d)], plugins=[CertifiedCheckpointIO()]).fit(
        model, _data()
    )
    return model, d / "epoch=0-step=10.ckpt"


def test_load_from_checkpoint_rebuilds_the_module(tmp_path):
    model, path = _certified_fit(tmp_path)
    back = load_from_checkpoint(Lit, path)
    assert isinstance(back, Lit) and isinstance(back.hparams.args, argparse.Namespace)
    assert back.hparams.args.name == "tiny" and isinstance(back.hparams.extra, AttributeDict)
    for a, b in zip(model.parameters(), back.parameters()):
        assert torch.equal(a, b)
    seen = []
    again = load_from_checkpoint(Lit, str(path), map_location=lambda t, loc: seen.append(loc) or t, lr=0.5)
    assert again.hparams.lr == 0.5 and seen and set(seen) == {"cpu"}  # overrides and a callable map_location


class CertifiedLit(CertifiedLoading, Lit):
    pass


def test_the_mixin_makes_the_class_load_from_checkpoint_take_certified_and_plain_files(tmp_path):
    model, path = _certified_fit(tmp_path)
    with pytest.raises(Exception, match="Weights only load failed"):  # what every Lightning user types, without it
        Lit.load_from_checkpoint(path)
    back = CertifiedLit.load_from_checkpoint(path, lr=0.5)
    assert type(back) is CertifiedLit and back.hparams.lr == 0.5 and back.hparams.args.name == "tiny"
    for a, b in zip(model.parameters(), back.parameters()):
        assert torch.equal(a, b)
    # a plain Lightning checkpoint still loads through Lightning's own loader
    plain = tmp_path / "plain"
    trainer = _trainer(max_steps=2, callbacks=[ModelCheckpoint(dirpath=plain)])
    trainer.fit(_model(), _data())
    (plain_file,) = plain.iterdir()
    assert type(CertifiedLit.load_from_checkpoint(plain_file, weights_only=False)) is CertifiedLit
    # a damaged certified file is refused by certckpt, not handed to torch.load
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        CertifiedLit.load_from_checkpoint(path)


def test_a_torch_save_checkpoint_is_refused_with_the_fix(tmp_path):
    model = _model()
    trainer = _trainer(max_steps=2)  # Lightning's own TorchCheckpointIO: a pickled file
    trainer.fit(model, _data())
    trainer.save_checkpoint(tmp_path / "pickled.ckpt")
    with pytest.raises(NotACheckpointError, match="certckpt certify"):
        CertifiedCheckpointIO().load_checkpoint(tmp_path / "pickled.ckpt")
    with pytest.raises(FileNotFoundError):
        CertifiedCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_checkpoints_on_an_fsspec_url_are_committed_and_replaced(memroot):
    model = _model()
    state = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams), "epoch": 0}
    io = CertifiedCheckpointIO()
    url = f"{memroot}/run/model.ckpt"
    io.save_checkpoint(dict(state, global_step=4), url)
    io.save_checkpoint(dict(state, global_step=8), url)  # Lightning writes the same name again
    back = io.load_checkpoint(url)
    assert back["global_step"] == 8
    status, latest = find_latest_good(f"{memroot}/run", accept="verified", write_certificates=False)
    assert latest == "main@8" and sorted(status.snapshot.retired) == ["main@4"] and not status.problems


def test_audit_callback_refuses_a_run_without_ddp(tmp_path):
    trainer = _trainer(max_steps=2, callbacks=[AuditCallback(ledger=str(tmp_path))])
    with pytest.raises(AuditSetupError, match="strategy='ddp'"):
        trainer.fit(_model(), _data())


# --- 3 gloo ranks ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_audits_leave_accumulation_and_clipping_alone_and_make_checkpoints_trusted(tmp_path):
    from certckpt.detect.launch import run_ranks

    args = {"dir": str(tmp_path / "ckpt"), "async_io": True}  # AsyncCheckpointIO(CertifiedCheckpointIO())
    out = run_ranks(lightning_cases.clean, 3, args, timeout=400)
    for rank, res in enumerate(out):
        # accumulate_grad_batches=2 and gradient_clip_val: the same bits as plain Lightning DDP
        assert res["bit_equal"], rank
        assert (res["step"], res["last_clean_audit"]) == (20, 20)
        assert res["bf16"] == [True, 10]  # bf16-mixed: the same bits, and both audits clean
    st = out[0]["status"]
    # save_top_k=1 removed main@5 and main@15 when Lightning let them go; main@10 was kept then (it
    # was latest-good, main@15 still awaiting its audit) and deleted after main@20 was committed and
    # trusted; last.ckpt is not a commit of its own
    assert out[0]["files"] == ["_ledger", "epoch=3-step=20.ckpt", "last.ckpt"]
    assert st["retired"] == ["main@10", "main@15", "main@5"]
    assert {c: v[0] for c, v in st["verdicts"].items()} == {
        "main@5": "trusted",
        "main@10": "trusted",
        "main@15": "trusted",
        "main@20": "trusted",
    }
    assert st["latest_good"] == "main@20" and st["detections"] == [] and st["incidents"] == []
    assert out[0]["kept_warning"]


@pytest.mark.slow
def test_last_ckpt_never_writes_over_the_latest_good_and_it_survives_a_detection(tmp_path):
    from certckpt.detect.launch import run_ranks

    d = str(tmp_path / "ckpt")
    out = run_ranks(lightning_cases.last_ckpt_keeps_latest_good, 3, {"dir": d}, timeout=400)
    assert [r["caught_at"] for r in out] == [40, 40, 40]
    st = out[0]["status"]
    assert st["detections"] == [["main", 40, "replay", [1], False]]
    # main@20 was last.ckpt when step 30 was saved: moved aside, not written over
    assert st["latest_good"] == "main@20" and st["latest_url"].endswith("certckpt-kept-main@20.ckpt")
    assert out[0]["latest_verifies"]
    assert out[0]["files"] == ["_ledger", "certckpt-kept-main@20.ckpt", "last.ckpt"]
    assert {c: v[0] for c, v in st["verdicts"].items()}["main@30"] == "suspect"
    assert st["retired"] == ["main@10"]  # written over at step 20, before anything was trusted
    (warning,) = out[0]["kept_warning"]
    assert "kept main@20" in warning and "latest-good" in warning


@pytest.mark.slow
def test_the_session_under_the_callback_drives_a_plain_loop_too(tmp_path):
    from certckpt.detect.launch import run_ranks

    out = run_ranks(lightning_cases.session_plain_loop, 3, {"dir": str(tmp_path)}, timeout=300)
    for res in out:
        assert res["clean"] == {"bit_equal": True, "last_clean_audit": 20}
        assert res["fault"] == [10, "replay", [1]]  # planted at step 7 on rank 1, caught by the audit at 10


def _launch(args: list[str], out: str, timeout: float = 400) -> tuple[int, str]:
    """Run the user's script (rank 0; Lightning starts ranks 1 and 2) in its own process group, so
    that a hang can be ended for all three; wait for every rank's report."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, lightning_cases.__file__, *args, out],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(out) if n.startswith("rank")]) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ranks 1 and 2 left over by a failure, if any
        except ProcessLookupError:
            pass
    return proc.returncode, log.decode("utf-8", "replace")


@pytest.mark.slow
def test_a_planted_fault_stops_the_run_names_the_rank_and_latest_good_resumes(tmp_path):
    ckpt, first, second = str(tmp_path / "ckpt"), tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # A persistent backward fault on rank 1 from step 8; audits every 5 steps, checkpoints every 5.
    code, log = _launch([ckpt, "--fault"], str(first))
    ranks = [json.loads((first / f"rank{r}.json").read_text()) for r in range(3)]
    assert code == 86, log[-3000:]
    assert all(r["exit"] == 86 and r["global_step"] == 9 for r in ranks)  # step 10's update never applied
    assert "replay audit failed (rank(s) [1])" in log and "incident inc-main-10-replay" in log

    status, latest = find_latest_good(ckpt, write_certificates=False)
    det = status.certification.detections
    assert [(d.branch, d.step, d.kind, list(d.suspect_ranks), d.interval) for d in det] == [
        ("main", 10, "replay", [1], (5, 10))
    ]
    assert status.snapshot.open_incidents() == ["inc-main-10-replay"]
    assert latest == "main@5"  # before the suspect interval (5, 10]
    latest_url = status.entry(latest).url

    parent_fp = status.entry(latest).consensus_fp
    assert parent_fp
    code, log = _launch([ckpt, "--ckpt-path", latest_url], str(second))
    ranks = [json.loads((second / f"rank{r}.json").read_text()) for r in range(3)]
    assert code == 0, log[-3000:]
    assert all(r["exit"] == 0 and r["global_step"] == 20 for r in ranks)
    # a new branch from latest-good, and the replicas proved they hold its weights before the first step
    assert all(r["resume"] == ["main-r1", "main@5", "trusted", parent_fp] for r in ranks)
    assert all(r["proof"] == [5, parent_fp] for r in ranks)
    status, latest = find_latest_good(ckpt, write_certificates=False)
    verdicts = {c: v.label for c, v in status.certification.verdicts.items()}
    assert verdicts == {
        "main@5": "trusted",
        "main-r1@10": "trusted",
        "main-r1@15": "trusted",
        "main-r1@20": "trusted",
    }
    assert latest == "main-r1@20" and status.snapshot.branch_parents == {"main-r1": "main@5"}

    # The same file, but rank 0's weights changed once loaded (DDP hands them to every replica):
    # every rank refuses to start, naming both fingerprints, and no branch is recorded.
    from certckpt.detect.launch import run_ranks

    out = run_ranks(lightning_cases.altered_resume, 3, {"dir": ckpt, "ckpt": latest_url}, timeout=300)
    assert [(r["global_step"], r["resume"]) for r in out] == [(5, ["main-r2", "main@5"])] * 3
    assert len({r["refused"] for r in out}) == 1
    assert f"but the checkpoint resumed from (main@5) recorded {parent_fp}" in out[0]["refused"]
    assert find_latest_good(ckpt, write_certificates=False)[0].snapshot.branch_parents == {"main-r1": "main@5"}
