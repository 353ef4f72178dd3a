"""Megatron-Core ``dist_checkpointing`` (issue 44): ``CertifiedSaveStrategy`` / ``CertifiedLoadStrategy``
on 3 gloo ranks, one launch (``tests/support/megatron_cases.py``): saved split 3 ways, re-loaded split 2
ways with a replica and by the strategy ``metadata.json`` names, fingerprints independent of the split,
ShardedObjects and the common state certified (no ``common.pt``), committed to a run store that
``certckpt status`` / ``latest-good --dir`` / ``verify DIR`` answer, promoted whole to a vault and
released; a plain ``torch_dist`` directory and a ``flattened_range`` tensor refused in one line.
Megatron's GPT model needs CUDA to be built: the state dicts are hand-built with Megatron's own
ShardedTensor / ShardedObject API."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

# find_spec, not importorskip: importing megatron.core takes ~6 s here, and only the ranks need it
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (pip install 'certckpt[megatron]')", allow_module_level=True)

import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from safetensors.torch import load_file

import certckpt
from certckpt.dcp import CertifiedReader, inspect_checkpoint
from certckpt.detect.launch import run_ranks
from certckpt.ops.release import verify_release
from certckpt.ops.release_cert import generate_release_key
from certckpt_cli.main import main
from tests.support import megatron_cases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cli(*args):
    return CliRunner().invoke(main, list(args))


def _flip_last_byte(path: str) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.slow
def test_certified_megatron_checkpoints_on_three_ranks(tmp_path):
    store, ckpt, plain = str(tmp_path / "run"), str(tmp_path / "run" / "iter_5"), str(tmp_path / "plain")
    out = run_ranks(megatron_cases.save_and_reload, 3, {"store": store, "ckpt": ckpt, "plain": plain}, timeout=300)

    # every rank got back what was saved, on another split, the saved fingerprints checked
    assert [o["ckpt_id"] for o in out] == ["main@5", None, None]
    for rank, o in enumerate(out):
        assert all(o["equal"].values()), (rank, o["equal"])
        assert (o["rng_seed"], o["iteration"], o["checked"]) == (100 + rank, 5, 3)
        assert o["args"] == {"lr": 3e-4, "tp": 3, "names": ["a", "b"]}
        assert o["default_equal"] and o["plain_megatron_reads"]
        # one open of the manifest per rank and load: the common strategy's read (digest-checked once)
        # is handed to the sharded strategy and the DCP reader, which used to read it again each
        assert (o["manifest_opens"], o["manifest_opens_default"]) == (1, 1), o
        assert o["plain"].startswith("NotACheckpointError: refusing to load: the checkpoint was written by plain")
        assert "never unpickled" in o["plain"] and "CertifiedSaveStrategy" in o["plain"]
        # a flattened_range tensor: one line on every rank, saving and loading, before a file is written
        for what in ("flat_save", "flat_load"):
            assert o[what].startswith(
                "UnsupportedObjectError: ShardedTensor `decoder.qkv.weight` has a flattened_range"
            ), o[what]
            assert "sharding_type='fully_sharded_model_space'" in o[what], o[what]
        assert o["flat_written"] == [], o["flat_written"]

    # nothing pickled: common.pt replaced by common.safetensors; every file a safetensors header or JSON
    names = sorted(os.listdir(ckpt))
    assert names == [
        "common.safetensors",
        "manifest.safetensors",
        "metadata.json",
        *(f"objects-0000{r}.safetensors" for r in range(3)),
        *(f"shard-0000{r}.safetensors" for r in range(3)),
    ]
    for name in names:
        with open(os.path.join(ckpt, name), "rb") as fh:
            head = fh.read(9)
        assert head[:1] == b"{" or head[8:9] == b"{", name

    # the fingerprints of tensors saved in 3 pieces are those of the whole tensors
    full = megatron_cases.full_tensors()
    manifest, record = inspect_checkpoint(ckpt)
    assert {t.fqn: t.fp for t in manifest.tensors} == {k: certckpt.fingerprint_hex(v) for k, v in full.items()}
    assert (record.run, record.step, record.branch) == ("mg", 5, "main")
    # and one process reads them whole, checked against those fingerprints
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    reader = CertifiedReader(ckpt, check_fingerprints=True)
    dcp.load(whole, storage_reader=reader, no_dist=True)
    assert all(torch.equal(whole[k], full[k]) for k in full) and reader.checked_tensors == 3

    # the commands
    r = _cli("verify", ckpt)
    assert r.exit_code == 0 and r.output.startswith("OK") and "sharded: 3 files" in r.output, r.output
    r = _cli("status", store, "--json")
    assert r.exit_code == 0 and [(c["ckpt_id"], c["verdict"]) for c in json.loads(r.output)["checkpoints"]] == [
        ("main@5", "verified")
    ]
    r = _cli("latest-good", store, "--dir", "--accept", "verified")
    assert r.exit_code == 0 and os.path.abspath(r.output.strip()) == os.path.abspath(ckpt), r.output
    r = _cli("verify", plain)
    assert r.exit_code == 2 and "written by plain Megatron-Core" in r.output and "never unpickles" in r.output

    # the vault holds the whole directory (companions too), checked; a damaged companion there is named
    vault = f"file://{tmp_path / 'vault'}"
    r = _cli("vault", "promote", store, vault, "--accept", "verified")
    assert r.exit_code == 0 and "copied, verified" in r.output, r.output
    assert sorted(os.listdir(tmp_path / "vault" / "main@5")) == names
    r = _cli("vault", "ls", vault, "--verify")
    assert r.exit_code == 0 and "main@5" in r.output, r.output
    _flip_last_byte(str(tmp_path / "vault" / "main@5" / "objects-00001.safetensors"))
    r = _cli("vault", "ls", vault, "--verify")
    assert r.exit_code == 1 and "damaged" in r.output and "objects-00001.safetensors" in r.output, r.output
    # a release: the saved global tensors, signed, checked by the release verifier
    key, pub = generate_release_key(str(tmp_path / "release-key"))
    r = _cli("release", ckpt, "--key", key, "--out", str(tmp_path / "rel"), "--accept", "verified")
    assert r.exit_code == 0 and "released main@5 (verified)" in r.output, r.output
    released = load_file(str(tmp_path / "rel" / "model.safetensors"))  # plain safetensors, for any reader
    assert released.keys() == full.keys() and all(torch.equal(released[k], full[k]) for k in full)
    assert verify_release(str(tmp_path / "rel"), public_key=pub, accept="verified").level == "verified"

    # a damaged common state fails the directory, and latest-good no longer names it
    _flip_last_byte(os.path.join(ckpt, "common.safetensors"))
    r = _cli("verify", ckpt)
    assert r.exit_code == 1 and "common.safetensors" in r.output and "digest mismatch" in r.output, r.output
    r = _cli("latest-good", store, "--dir", "--accept", "verified")
    assert r.exit_code != 0 and ckpt not in r.output.splitlines()[0:1], r.output


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_session.sh runs it)")
def test_sharded_tensors_on_a_cuda_gpu_save_and_load_certified(tmp_path):
    store = str(tmp_path / "run")
    (out,) = run_ranks(megatron_cases.gpu_round_trip, 1, {"store": store, "ckpt": f"{store}/iter_7"}, timeout=300)
    assert out == {"ckpt_id": "main@7", "equal": True, "device": "cuda:0", "checked": 3, "fps_as_on_cpu": True}
