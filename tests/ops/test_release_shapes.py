"""Issue 45, item 1: ``certckpt release`` of every checkpoint shape certckpt writes: a single file, a
Trainer ``checkpoint-N/`` (however it is named: the store, the directory, its manifest, its weights),
a Lightning ``.ckpt``, a DCP directory (consolidated) and an Accelerate ``checkpoint_<i>/``. Each
release is checked with OpenSSF ``model_signing``'s own verifier, and with ``from_pretrained`` where
it applies."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import certckpt
from certckpt.errors import ConfigurationError, CorruptCheckpointError
from certckpt.ops.release import make_release, verify_release
from certckpt.ops.release_cert import CERTIFICATE_NAME, SIGNATURE_NAME, generate_release_key
from certckpt_cli.main import main as cli

model_signing = pytest.importorskip("model_signing")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    key, pub = generate_release_key(str(tmp_path_factory.mktemp("keys") / "release"))
    return {"key": key, "pub": pub}


def _signed_by(directory, pub) -> None:
    """OpenSSF model_signing's own verifier (key-based, offline) accepts the release; so does certckpt's."""
    sig = os.path.join(directory, SIGNATURE_NAME)
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(directory, sig)
    assert verify_release(str(directory), public_key=pub, accept="verified").level == "verified"


def _released(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _release_cli(ckpt, keys, out, *extra):
    return CliRunner().invoke(
        cli, ["release", str(ckpt), "--key", keys["key"], "--out", str(out), "--accept", "verified", *extra]
    )


# --- the Hugging Face Trainer -------------------------------------------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    pytest.importorskip("transformers")
    from certckpt.integrations.transformers import CertifiedTrainer
    from tests.support.hf_cases import TokenData, tiny_gpt2, training_args

    out = str(tmp_path_factory.mktemp("hf") / "out")
    trainer = CertifiedTrainer(
        model=tiny_gpt2(), args=training_args(out), train_dataset=TokenData(), processing_class=_tokenizer()
    )
    trainer.train()
    return {"out": out, "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def test_release_of_every_checkpoint_shape_trainer_checkpoint_directory(trainer_run, keys, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    out = trainer_run["out"]
    ckpt = os.path.join(out, "checkpoint-6")
    # the store (its latest-good), the directory, its manifest, its weights: one and the same release
    for i, target in enumerate([out, ckpt, os.path.join(ckpt, "trainer.safetensors"), f"{ckpt}/model.safetensors"]):
        rel = tmp_path / f"r{i}"
        r = _release_cli(target, keys, rel)
        assert r.exit_code == 0 and "released main@6 (verified)" in r.output, r.output
        names = sorted(os.listdir(rel))
        assert "config.json" in names and "tokenizer.json" in names and "model.safetensors" in names, names
        assert not {"trainer_state.json", "training_args.json", "trainer.safetensors", "rng_state.safetensors"} & set(
            names
        ), names
        _signed_by(rel, keys["pub"])
        assert _equal(_released(rel), certckpt.load(f"{ckpt}/model.safetensors"))
    rel = tmp_path / "r1"
    model = GPT2LMHeadModel.from_pretrained(str(rel))  # config.json and the weights, without certckpt
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in trainer_run["weights"].items())
    assert AutoTokenizer.from_pretrained(str(rel))("w3 w7")["input_ids"] == [3, 7]
    env = json.loads((rel / CERTIFICATE_NAME).read_text())
    import base64

    pred = json.loads(base64.b64decode(env["payload"]))["predicate"]
    assert pred["checkpoint"]["released_from"].endswith("checkpoint-6/model.safetensors")
    # --with a file the checkpoint carries: the same bytes are fine, other bytes are refused
    r = _release_cli(ckpt, keys, tmp_path / "w", "--with", os.path.join(ckpt, "config.json"))
    assert r.exit_code == 0, r.output
    other = tmp_path / "config.json"
    other.write_text("{}")
    r = _release_cli(ckpt, keys, tmp_path / "w2", "--with", str(other))
    assert r.exit_code != 0 and "the checkpoint holds another config.json" in r.output, r.output


def test_release_of_every_checkpoint_shape_refuses_a_trainer_directory_changed_after_the_commit(
    trainer_run, keys, tmp_path
):
    import shutil

    out = str(tmp_path / "out")
    shutil.copytree(trainer_run["out"], out)
    config = os.path.join(out, "checkpoint-6", "config.json")
    os.chmod(config, 0o644)
    with open(config, "a") as f:
        f.write(" ")
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint-6/config.json: .*the file changed"):
        make_release(os.path.join(out, "checkpoint-6"), key=keys["key"], out=str(tmp_path / "r"), accept="verified")
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigurationError, match="--part names the file holding the model's tensors"):
        make_release(
            os.path.join(out, "checkpoint-3"), key=keys["key"], out=str(tmp_path / "r"), accept="verified", part="x"
        )


# --- a plain file, a Lightning .ckpt --------------------------------------------------------------


def test_release_of_every_checkpoint_shape_single_file_and_lightning(keys, tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    torch.manual_seed(0)
    weights = torch.nn.Linear(4, 3).state_dict()
    certckpt.save({"model": weights, "optim": {"lr": 0.1}}, str(store / "s5.safetensors"), ledger=str(store), step=5)
    make_release(str(store / "s5.safetensors"), key=keys["key"], out=str(tmp_path / "file"), accept="verified")
    _signed_by(tmp_path / "file", keys["pub"])
    assert _equal(_released(tmp_path / "file"), weights)

    pytest.importorskip("pytorch_lightning")
    from certckpt.integrations.lightning import CertifiedCheckpointIO

    lit = tmp_path / "lit"
    state = {"state_dict": {f"net.{k}": v for k, v in weights.items()}, "hyper_parameters": {"h": 1}, "epoch": 0}
    CertifiedCheckpointIO().save_checkpoint(dict(state, global_step=30), str(lit / "epoch=0-step=30.ckpt"))
    rel = tmp_path / "lit-rel"
    r = _release_cli(lit / "epoch=0-step=30.ckpt", keys, rel)
    assert r.exit_code == 0, r.output
    _signed_by(rel, keys["pub"])
    assert _equal(_released(rel), state["state_dict"])


def test_release_from_an_s3_run_store_its_latest_good_or_a_checkpoint_by_url(s3_bucket, keys, tmp_path):
    store = f"{s3_bucket}/run"
    torch.manual_seed(0)
    weights = {5: torch.nn.Linear(4, 3).state_dict(), 10: torch.nn.Linear(4, 3).state_dict()}
    for step, w in weights.items():
        certckpt.save({"model": w}, f"{store}/s{step}.safetensors", ledger=store, step=step)
    rel = make_release(store, key=keys["key"], out=str(tmp_path / "latest"), accept="verified")
    assert rel.ckpt_id == "main@10" and _equal(_released(tmp_path / "latest"), weights[10])
    _signed_by(tmp_path / "latest", keys["pub"])
    r = _release_cli(f"{store}/s5.safetensors", keys, tmp_path / "s5")  # the store around it, found
    assert r.exit_code == 0, r.output
    _signed_by(tmp_path / "s5", keys["pub"])
    assert _equal(_released(tmp_path / "s5"), weights[5])


# --- a DCP directory ------------------------------------------------------------------------------


def test_release_of_every_checkpoint_shape_dcp_directory_consolidated(keys, tmp_path):
    import torch.distributed.checkpoint as dcp

    from certckpt.dcp import CertifiedWriter

    store = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(state, storage_writer=CertifiedWriter(str(store / "step5"), ledger=str(store), step=5), no_dist=True)
    rel = tmp_path / "rel"
    r = _release_cli(store / "step5", keys, rel)
    assert r.exit_code == 0, r.output
    _signed_by(rel, keys["pub"])
    assert sorted(os.listdir(rel)) == sorted([CERTIFICATE_NAME, SIGNATURE_NAME, "model.safetensors"])
    assert _equal(_released(rel), model.state_dict())  # one file, the model's tensors whole
    again = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    again.load_state_dict(_released(rel), strict=True)


# --- an Accelerate checkpoint_<i>/ ----------------------------------------------------------------


def test_release_of_every_checkpoint_shape_accelerate_directory(keys, tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from certckpt.integrations.accelerate import CertifiedAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        project = str(tmp_path / "proj")
        config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
        accelerator = CertifiedAccelerator(cpu=True, project_config=config)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        accelerator.backward(model(torch.randn(3, 4)).sum())
        opt.step()
        accelerator.save_state()
        want = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    ckpt = os.path.join(project, "checkpoints", "checkpoint_0")
    for i, target in enumerate([project, ckpt]):
        rel = tmp_path / f"rel{i}"
        r = _release_cli(target, keys, rel)
        assert r.exit_code == 0, r.output
        _signed_by(rel, keys["pub"])
        assert sorted(os.listdir(rel)) == sorted([CERTIFICATE_NAME, SIGNATURE_NAME, "model.safetensors"])
        assert _equal(_released(rel), want)
