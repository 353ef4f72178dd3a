"""Signed checkpoint files: with trusted keys, ``verify`` fails a file that is unsigned, signed by
another key, or forged with every digest recomputed; without keys a signed file is an ordinary
certckpt (and safetensors) file."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

pytest.importorskip("cryptography")

import certckpt
from certckpt.format.header import METADATA_KEY, canonical_json, padded_json
from certckpt.format.record import RECORD_KEY, SIG_KEY, header_digest
from certckpt.format.signing import SigningKey, TrustedKeys, generate_key


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = generate_key(d / "writer")
    other_priv, other_pub = generate_key(d / "attacker")
    return {
        "priv": priv,
        "pub": pub,
        "signing": SigningKey.load(priv),
        "trusted": TrustedKeys.load([pub]),
        "attacker": SigningKey.load(other_priv),
        "attacker_trusted": TrustedKeys.load([other_pub]),
    }


def _state():
    torch.manual_seed(0)
    return {"w": torch.randn(16, 8), "h": torch.randn(7, dtype=torch.float16), "step": 3}


def _split(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(doc, body) -> bytes:
    header = padded_json(doc)
    return struct.pack("<Q", len(header)) + header + body


def _forge(path, *, drop_signature=False) -> bytes:
    """What someone with write access and no key can do: change a tensor's bytes and recompute the
    tensor's digest and the header digest, keeping (or dropping) the signature entry."""
    import xxhash

    doc, body = _split(path)
    body = bytearray(body)
    begin, end = doc["w"]["data_offsets"]
    body[begin] ^= 0x01
    rec = json.loads(doc[METADATA_KEY][RECORD_KEY])
    rec["tensors"]["w"]["xxh3"] = xxhash.xxh3_128_hexdigest(bytes(body[begin:end]))
    if drop_signature:
        del doc[METADATA_KEY][SIG_KEY]
    sig = doc[METADATA_KEY].get(SIG_KEY)
    if sig is not None:  # the digest rule blanks the signature, as docs/format.md says
        blank = {**json.loads(sig), "ed25519": "0" * 88}
        doc[METADATA_KEY][SIG_KEY] = canonical_json(blank)
    rec["header_digest"] = "0" * 32
    doc[METADATA_KEY][RECORD_KEY] = canonical_json(rec)
    rec["header_digest"] = header_digest(padded_json(doc))
    doc[METADATA_KEY][RECORD_KEY] = canonical_json(rec)
    if sig is not None:
        doc[METADATA_KEY][SIG_KEY] = sig
    return _join(doc, bytes(body))


def test_a_signed_file_verifies_with_its_key_and_loads_everywhere(tmp_path, keys):
    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p, signing_key=keys["priv"], step=3)
    assert certckpt.verify(p).ok
    report = certckpt.verify(p, trusted_keys=keys["trusted"])
    assert report.ok, report.problems
    assert certckpt.verify(p, deep=True, trusted_keys=keys["trusted"]).ok
    back = certckpt.load(p)
    assert torch.equal(back["w"], _state()["w"]) and back["step"] == 3
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:  # an ordinary safetensors file
        assert torch.equal(f.get_tensor("w"), _state()["w"])
        assert SIG_KEY in f.metadata()


def test_unsigned_and_foreign_key_files_fail_only_with_trusted_keys(tmp_path, keys):
    unsigned = tmp_path / "u.safetensors"
    certckpt.save(_state(), unsigned)
    assert certckpt.verify(unsigned).ok
    r = certckpt.verify(unsigned, trusted_keys=keys["trusted"])
    assert not r.ok and "unsigned" in r.problems[0].message
    other = tmp_path / "o.safetensors"
    certckpt.save(_state(), other, signing_key=keys["attacker"])
    r = certckpt.verify(other, trusted_keys=keys["trusted"])
    assert not r.ok and "not trusted" in r.problems[0].message
    assert certckpt.verify(other, trusted_keys=keys["attacker_trusted"]).ok


@pytest.mark.parametrize("drop_signature", [False, True])
def test_a_forged_file_with_recomputed_digests_fails_only_with_trusted_keys(tmp_path, keys, drop_signature):
    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p, signing_key=keys["signing"])
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(_forge(p, drop_signature=drop_signature))
    assert certckpt.verify(forged).ok  # the unkeyed digests alone cannot tell (docs/signing.md)
    assert not torch.equal(certckpt.load(forged)["w"], _state()["w"])
    r = certckpt.verify(forged, trusted_keys=keys["trusted"])
    assert not r.ok
    expected = "unsigned" if drop_signature else "bad signature"
    assert expected in r.problems[0].message, r.problems


def _xxh3_forgery(p) -> bytes:
    """The file at ``p`` with tensor ``big``'s bytes replaced by an xxh3 second preimage: the header
    (every digest, the header digest, the signature) is byte for byte the original."""
    from tests.support.xxh3_forge import forge

    info = certckpt.inspect(p)
    e = next(e for e in info.header.entries if e.name == "big")
    raw = p.read_bytes()
    start, end = info.header.data_start + e.begin, info.header.data_start + e.end
    return raw[:start] + forge(raw[start:end]) + raw[end:]


@pytest.mark.parametrize("how", ["argument", "environment", "mmap", "key-file"])
def test_an_xxh3_forgery_keeps_every_unkeyed_digest_and_fails_every_keyed_load(tmp_path, keys, monkeypatch, how):
    from certckpt.errors import CorruptCheckpointError

    p = tmp_path / "ck.safetensors"
    torch.manual_seed(1)
    state = {**_state(), "big": torch.randn(64, 64)}  # 16 KiB: the forgery rewrites its first block
    certckpt.save(state, p, signing_key=keys["signing"])
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(_xxh3_forgery(p))
    assert certckpt.verify(forged).ok  # every xxh3 digest and the header digest still hold
    loaded = certckpt.load(forged, trusted_keys=None)
    assert not torch.equal(loaded["big"], state["big"])  # without keys, forged weights load
    kwargs = {}
    if how == "argument":
        kwargs["trusted_keys"] = keys["trusted"]
    elif how == "environment":
        monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["pub"])
    elif how == "mmap":
        kwargs.update(trusted_keys=keys["trusted"], mmap=True)
    else:
        kwargs["trusted_keys"] = keys["pub"]
    with pytest.raises(CorruptCheckpointError, match="BLAKE3 differs from the one signed"):
        certckpt.load(forged, **kwargs)
    assert torch.equal(certckpt.load(p, **kwargs)["big"], state["big"])  # the real file loads
    r = certckpt.verify(forged, trusted_keys=keys["trusted"])
    assert not r.ok and "BLAKE3 differs" in r.problems[0].message


class _OneWay:
    """A stream that cannot seek back (a pipe): keyed verify hashes xxh3 and the signed digest in
    the one pass it gets."""

    def __init__(self, data: bytes) -> None:
        import io

        self._f = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def seekable(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("stream", "mapped"),
    [(False, True), (False, False), (True, True)],
    ids=["mapped-path", "read-path", "one-way-stream"],
)
def test_keyed_verify_passes_the_signed_file_and_names_damage_forgery_truncation_and_trailing_bytes(
    tmp_path, keys, stream, mapped
):
    """Keyed verify of a seekable file hashes the data once for the signed digest alone (a local file
    through a map unless mmap=False); whatever fails it is read again to name the tensor. Every way
    must give the same verdicts and names."""
    p = tmp_path / "ck.safetensors"
    torch.manual_seed(1)
    state = {**_state(), "big": torch.randn(64, 64)}
    certckpt.save(state, p, signing_key=keys["signing"])
    raw = p.read_bytes()
    info = certckpt.inspect(p)
    big = next(e for e in info.header.entries if e.name == "big")
    flipped = bytearray(raw)
    flipped[info.header.data_start + big.begin + 100] ^= 0x10

    def check(data: bytes):
        q = tmp_path / "q.safetensors"
        q.write_bytes(data)
        return certckpt.verify(_OneWay(data) if stream else q, trusted_keys=keys["trusted"], mmap=mapped)

    ok = check(raw)
    assert ok.ok and ok.tensors == len(info.header.entries), ok.problems
    r = check(bytes(flipped))
    assert not r.ok and [(x.kind, x.tensor) for x in r.problems] == [("digest", "big")], r.problems
    r = check(_xxh3_forgery(p))
    assert not r.ok and [x.kind for x in r.problems] == ["signature"], r.problems
    assert "BLAKE3 differs from the one signed" in r.problems[0].message
    r = check(raw[:-5])
    assert not r.ok and r.problems[0].kind == "truncated", r.problems
    r = check(raw + b"\0")
    assert not r.ok and "trailing bytes" in r.problems[0].message, r.problems


def test_the_mapped_keyed_digest_spans_unaligned_windows_and_stands_aside_for_what_it_cannot_map(
    tmp_path, keys, monkeypatch
):
    """The mapped digest maps one window at a time from an offset rounded down to the mapping
    granularity: with windows of an odd size every window but the first starts mid-page, and the
    digest must still be the signed one, also for a file object holding the checkpoint after other
    bytes. A stream, a file whose size is not the header's, and a SHA-256 signature take the reading
    path (None)."""
    import io

    from certckpt.format import verify as verify_mod
    from certckpt.format.record import signature_problem

    p = tmp_path / "ck.safetensors"
    torch.manual_seed(2)
    state = {**_state(), "big": torch.randn(128, 128)}  # 64 KiB: seven windows of 10,007 bytes
    certckpt.save(state, p, signing_key=keys["signing"])
    info = certckpt.inspect(p)
    problem, signed = signature_problem(info.header, keys["trusted"])
    assert problem is None and signed[0] == "data_blake3"
    monkeypatch.setattr(verify_mod, "_MAP_SLICE", 10_007)
    seen = []

    def mapped(path, field=signed[0], at=info.header.data_start, progress=None):
        with open(path, "rb") as fh:
            fh.seek(at)  # where verify leaves it: at the data region's first byte
            return verify_mod._mapped_digest(fh, info, field, progress)

    got = mapped(p, progress=lambda done, total: seen.append((done, total)))
    assert got == signed[1]
    length = info.header.data_length
    assert len(seen) == -(-length // 10_007) >= 7 and seen[-1] == (length, length)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    with open(p, "rb") as fh:  # the library's verify takes the same windows
        assert certckpt.verify(fh, trusted_keys=keys["trusted"]).ok
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(_xxh3_forgery(p))
    assert mapped(forged) not in (None, signed[1])
    r = certckpt.verify(forged, trusted_keys=keys["trusted"])
    assert [x.kind for x in r.problems] == ["signature"], r.problems

    assert verify_mod._mapped_digest(io.BytesIO(p.read_bytes()), info, signed[0], None) is None
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(p.read_bytes() + b"\0")
    assert mapped(longer) is None
    assert mapped(p, field="data_sha256") is None

    # a caller's file object holding the checkpoint after other bytes: the map starts where the
    # data does in that file, and the prefix is no part of the digest
    prefixed = tmp_path / "prefixed.bin"
    prefixed.write_bytes(b"P" * 12_345 + p.read_bytes())
    assert mapped(prefixed, at=12_345 + info.header.data_start) == signed[1]
    with open(prefixed, "rb") as fh:
        fh.seek(12_345)
        assert certckpt.verify(fh, trusted_keys=keys["trusted"]).ok
    forged_prefixed = tmp_path / "forged-prefixed.bin"
    forged_prefixed.write_bytes(b"P" * 12_345 + forged.read_bytes())
    with open(forged_prefixed, "rb") as fh:
        fh.seek(12_345)
        r = certckpt.verify(fh, trusted_keys=keys["trusted"])
    assert [x.kind for x in r.problems] == ["signature"], r.problems


def test_no_mmap_reaches_every_keyed_verify_a_command_runs_and_verdicts_do_not_change(tmp_path, keys, monkeypatch):
    """`verify --no-mmap` on a directory-shaped checkpoint reads its certified file and its companion
    weights too (CERTCKPT_NO_MMAP, which it sets, is read by every verify); by default both are
    mapped. The forged companion fails either way."""
    from click.testing import CliRunner

    from certckpt.format import verify as verify_mod
    from certckpt_cli.main import main as cli

    d = tmp_path / "checkpoint-3"
    d.mkdir()
    torch.manual_seed(3)
    w = certckpt.save({"big": torch.randn(64, 64)}, d / "model.safetensors", signing_key=keys["signing"])
    files = {"model.safetensors": {"bytes": (d / "model.safetensors").stat().st_size, "header_digest": w.header_digest}}
    meta = {"layout": "test-bundle/1", "files": json.dumps(files, sort_keys=True, separators=(",", ":"))}
    certckpt.save({"optim": torch.ones(2)}, d / "manifest.safetensors", metadata=meta, signing_key=keys["signing"])
    mapped_files = []
    real = verify_mod._mapped_digest
    monkeypatch.setattr(
        verify_mod, "_mapped_digest", lambda fh, *a, **k: mapped_files.append(fh.name) or real(fh, *a, **k)
    )
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", str(keys["priv"]) + ".pub")
    monkeypatch.setenv("CERTCKPT_NO_MMAP", "0")  # restored after the test: the flag sets it in-process

    def run(*extra):
        mapped_files.clear()
        r = CliRunner().invoke(cli, ["verify", *extra, str(d)])
        return r.exit_code, r.output, sorted(os.path.basename(f) for f in mapped_files)

    code, out, mapped = run()
    assert code == 0 and out.startswith("OK"), out
    assert mapped == ["manifest.safetensors", "model.safetensors"]
    code, out, mapped = run("--no-mmap")
    assert code == 0 and out.startswith("OK") and mapped == [], (out, mapped)

    (d / "model.safetensors").write_bytes(_xxh3_forgery(d / "model.safetensors"))
    for extra in ((), ("--no-mmap",)):
        monkeypatch.setenv("CERTCKPT_NO_MMAP", "0")
        code, out, mapped = run(*extra)
        assert code == 1 and "model.safetensors" in out and "BLAKE3 differs from the one signed" in out, out
        assert ("model.safetensors" in mapped) == (not extra)


def test_keyed_verify_of_a_file_that_shrinks_after_it_was_sized_names_the_truncated_tensor(tmp_path, keys):
    """The signed-digest pass ends early when the data stops before the size the header and the stat
    promised (a file cut while it is read): it is read again, and the truncation named."""
    import io

    p = tmp_path / "ck.safetensors"
    torch.manual_seed(1)
    certckpt.save({**_state(), "big": torch.randn(64, 64)}, p, signing_key=keys["signing"])
    raw = p.read_bytes()

    class Shrunk(io.BytesIO):  # reports the full size, holds 5 bytes less
        def seek(self, offset, whence=0):
            pos = super().seek(offset, whence)
            return pos + 5 if whence == 2 else pos

    r = certckpt.verify(Shrunk(raw[:-5]), trusted_keys=keys["trusted"])
    assert not r.ok and [x.kind for x in r.problems] == ["truncated"], r.problems
    assert certckpt.verify(io.BytesIO(raw), trusted_keys=keys["trusted"]).ok  # the control


def test_a_keyed_load_refuses_unsigned_and_foreign_files_and_an_unverified_read(tmp_path, keys):
    from certckpt.errors import ConfigurationError, UntrustedCheckpointError

    unsigned, other = tmp_path / "u.safetensors", tmp_path / "o.safetensors"
    certckpt.save(_state(), unsigned)
    certckpt.save(_state(), other, signing_key=keys["attacker"])
    with pytest.raises(UntrustedCheckpointError, match="unsigned: the file carries no signature.*; not loaded"):
        certckpt.load(unsigned, trusted_keys=keys["trusted"])
    with pytest.raises(UntrustedCheckpointError, match="not trusted; not loaded"):
        certckpt.load(other, trusted_keys=keys["trusted"])
    with pytest.raises(ConfigurationError, match="a keyed load always verifies"):
        certckpt.load(other, trusted_keys=keys["trusted"], verify=False)
    assert certckpt.load(other, trusted_keys=keys["attacker_trusted"])["step"] == 3


def test_every_header_bit_flip_of_a_signed_file_fails_without_keys_too(tmp_path, keys):
    p = tmp_path / "ck.safetensors"
    certckpt.save({"w": torch.ones(2)}, p, signing_key=keys["signing"])
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    q = tmp_path / "flip.safetensors"
    sig_at = data.index(b"ed25519")
    marker = b'ed25519\\":\\"'  # the entry is a JSON string inside the JSON header: quotes escaped
    b64 = range(data.index(marker) + len(marker), data.index(marker) + len(marker) + 88)
    for i in range(sig_at, min(sig_at + 120, 8 + n)):  # the signature entry's bytes, one bit each
        d = bytearray(data)
        d[i] ^= 0x04
        q.write_bytes(bytes(d))
        try:
            ok_plain = certckpt.verify(q).ok
        except certckpt.CertckptError:
            ok_plain = False
        try:
            ok_keyed = certckpt.verify(q, trusted_keys=keys["trusted"]).ok
        except certckpt.CertckptError:
            ok_keyed = False
        assert not ok_keyed, f"byte {i} flipped passed a keyed verify"
        # The header digest blanks the signature itself: a flip inside the base64 passes a plain
        # verify (the bytes that matter are unchanged) and only a keyed one notices.
        if i not in b64:
            assert not ok_plain, f"byte {i} flipped passed a plain verify"


def test_the_environment_key_signs_plain_saves(tmp_path, keys, monkeypatch):
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", str(keys["priv"]))
    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p)
    assert certckpt.verify(p, trusted_keys=keys["trusted"]).ok


def test_a_ledger_save_signs_the_file_and_its_commit_record(tmp_path, keys):
    store = tmp_path / "run"
    store.mkdir()
    certckpt.save(_state(), store / "main@5.safetensors", ledger=str(store), run="r", step=5, signing_key=keys["priv"])
    assert certckpt.verify(store / "main@5.safetensors", trusted_keys=keys["trusted"]).ok
    rec = json.loads((store / "_ledger" / "checkpoints" / "main@5.json").read_text())
    assert rec["sig"]["key"] == keys["signing"].key_id


def _cli(*args, env=None):
    import os
    import subprocess

    from tests.support.helpers import console_script

    return subprocess.run(
        [console_script("certckpt"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        # no key from the environment; the reader's memory in the suite's own directory, never ~/.cache
        env={k: v for k, v in (env or os.environ).items() if not k.startswith("CERTCKPT_")}
        | {"CERTCKPT_STATE_DIR": os.environ["CERTCKPT_STATE_DIR"]},
    )


def test_latest_good_with_trusted_keys_takes_only_signed_files(tmp_path, keys):
    """Signed commit records over an unsigned file are not enough: with --trusted-keys the file must
    carry a trusted signature too, so a file replaced by someone without the key is never the answer."""
    from certckpt.trust.ledger import Ledger

    pub = str(keys["priv"]) + ".pub"
    store = tmp_path / "run"
    store.mkdir()
    led = Ledger(str(store), signing_key=keys["signing"], trusted_keys=None)
    # main@5 signed file; main@10 unsigned file (a writer without the key), both verified
    certckpt.save(_state(), store / "main@5.safetensors", ledger=led, run="r", step=5, signing_key=keys["signing"])
    r = certckpt.save(_state(), store / "main@10.safetensors", run="r", step=10, signing_key=None, overwrite=False)
    led.commit_checkpoint(
        branch="main",
        step=10,
        location=str(store / "main@10.safetensors"),
        run="r",
        header_digest=r.header_digest,
        state_fp=r.state_fp,
    )
    plain = _cli("latest-good", "--accept", "verified", "--json", str(store))
    assert plain.returncode == 0 and json.loads(plain.stdout)["ckpt_id"] == "main@10", plain.stderr
    keyed = _cli("latest-good", "--accept", "verified", "--json", "--trusted-keys", pub, str(store))
    assert keyed.returncode == 0, keyed.stderr
    assert json.loads(keyed.stdout)["ckpt_id"] == "main@5"
    assert "unsigned" in keyed.stdout + keyed.stderr
    bad = _cli("status", "--trusted-keys", str(tmp_path / "nope.pub"), str(store))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--trusted-keys" in bad.stderr


def test_cli_verify_trusted_keys_passes_the_signed_file_and_fails_the_forgery(tmp_path, keys):
    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p, signing_key=keys["signing"])
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(_forge(p))
    pub = str(keys["priv"]) + ".pub"
    assert _cli("verify", str(forged)).returncode == 0  # unkeyed digests hold
    ok = _cli("verify", "--trusted-keys", pub, str(p))
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    bad = _cli("verify", "--trusted-keys", pub, str(forged))
    assert bad.returncode == 1 and "bad signature" in bad.stdout, bad.stdout + bad.stderr
    # an xxh3 forgery keeps the signature: the data's digest fails it, mapped or read
    torch.manual_seed(1)
    certckpt.save({**_state(), "big": torch.randn(64, 64)}, p, signing_key=keys["signing"])
    forged.write_bytes(_xxh3_forgery(p))
    for extra in ((), ("--no-mmap",)):
        ok = _cli("verify", *extra, "--trusted-keys", pub, str(p))
        assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
        bad = _cli("verify", *extra, "--trusted-keys", pub, str(forged))
        assert bad.returncode == 1 and "BLAKE3 differs from the one signed" in bad.stdout, bad.stdout + bad.stderr


AUDITOR_SIGNS = """
import json, os, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from certckpt.detect import Auditor
d, priv = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
torch.manual_seed(0)
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
a = Auditor(DDP(m), opt, loss_fn=lambda mm, b: F.mse_loss(mm(b[0]), b[1]), ledger=d + "/run", audit_every=2,
            signing_key=priv)
for s in range(4):
    a.train_step((torch.randn(3, 4), torch.randn(3, 2)))
a.save({"m": m.state_dict()}, d + "/run/main@4.safetensors")
a.close()
dist.destroy_process_group()
"""


def test_the_auditor_signs_its_checkpoints_and_records(tmp_path, keys):
    import os
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    r = subprocess.run(
        [sys.executable, "-c", AUDITOR_SIGNS, str(tmp_path), str(keys["priv"])],
        capture_output=True,
        text=True,
        timeout=120,
        # no key from the environment; the reader's memory in this test's own directory, never ~/.cache
        env={k: v for k, v in os.environ.items() if not k.startswith("CERTCKPT_")}
        | {"CERTCKPT_STATE_DIR": str(tmp_path / "state")},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert certckpt.verify(tmp_path / "run" / "main@4.safetensors", trusted_keys=keys["trusted"]).ok
    rec = json.loads((tmp_path / "run" / "_ledger" / "checkpoints" / "main@4.json").read_text())
    assert rec["sig"]["key"] == keys["signing"].key_id


def test_vault_restore_with_trusted_keys_refuses_a_forged_held_copy(tmp_path, keys, monkeypatch):
    import os

    from certckpt.errors import CorruptCheckpointError
    from certckpt.vault import promote, restore

    run, vault = tmp_path / "run", tmp_path / "vault"
    run.mkdir()
    torch.manual_seed(2)
    state = {**_state(), "big": torch.randn(64, 64)}
    certckpt.save(state, run / "main@5.safetensors", signing_key=keys["signing"], ledger=str(run), step=5)
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", keys["priv"])
    promote(str(run), str(vault), accept="verified")
    held = vault / "main@5.safetensors"
    forged = _xxh3_forgery(held)
    os.chmod(held, 0o644)  # vault copies are read-only; an attacker with write access changes that
    held.write_bytes(forged)
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["pub"])
    with pytest.raises(CorruptCheckpointError, match="BLAKE3 differs"):
        restore(str(vault), "main@5", str(tmp_path / "out.safetensors"), accept="verified")
    assert not (tmp_path / "out.safetensors").exists()


def test_certified_reader_with_trusted_keys_refuses_an_xxh3_forged_shard(tmp_path, keys, monkeypatch):
    import warnings

    import torch.distributed.checkpoint as dcp

    from certckpt.dcp import CertifiedReader, CertifiedWriter
    from certckpt.format.sharded.layout import shard_name

    torch.manual_seed(3)
    state = {"big": torch.randn(64, 64), "small": torch.randn(4)}
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", keys["priv"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled ... single process"
        dcp.save(state, storage_writer=CertifiedWriter(str(tmp_path / "ck")), no_dist=True)
        shard = tmp_path / "ck" / shard_name(0)
        shard.write_bytes(_xxh3_forgery(shard))

        def load(**kw):
            out = {"big": torch.zeros(64, 64), "small": torch.zeros(4)}
            dcp.load(out, storage_reader=CertifiedReader(str(tmp_path / "ck"), **kw), no_dist=True)
            return out

        assert not torch.equal(load(trusted_keys=None)["big"], state["big"])  # xxh3 alone is fooled
        with pytest.raises(BaseException, match="BLAKE3 differs") as got:  # DCP wraps it (a BaseException)
            load(trusted_keys=keys["trusted"])
        assert "nothing was loaded" in str(got.value)


def test_files_signed_with_sha256_still_verify_and_load_keyed_and_catch_the_forgery(tmp_path, keys, monkeypatch):
    """Files signed before BLAKE3 (or where the blake3 package is missing) carry ``data_sha256``."""
    from certckpt.errors import CorruptCheckpointError

    monkeypatch.setattr("certckpt.format.writer.preferred_digest_field", lambda: "data_sha256")
    p = tmp_path / "ck.safetensors"
    torch.manual_seed(4)
    state = {**_state(), "big": torch.randn(64, 64)}
    certckpt.save(state, p, signing_key=keys["signing"])
    assert "data_sha256" in json.loads(certckpt.inspect(p).header.metadata[SIG_KEY])
    assert certckpt.verify(p, trusted_keys=keys["trusted"]).ok
    assert torch.equal(certckpt.load(p, trusted_keys=keys["trusted"])["big"], state["big"])
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(_xxh3_forgery(p))
    with pytest.raises(CorruptCheckpointError, match="SHA-256 differs from the one signed"):
        certckpt.load(forged, trusted_keys=keys["trusted"])


def test_new_signed_files_carry_a_blake3_digest_of_their_data(tmp_path, keys, monkeypatch):
    """The digest is hashed piecewise beside each tensor's xxh3 (``datahash.CACHE_PIECE``): a tensor
    spanning several pieces and one ending mid-piece must still give BLAKE3 of the whole data region,
    written to a path or streamed to a file object alike."""
    import io

    import blake3

    from certckpt.format import writer
    from certckpt.format.datahash import CACHE_PIECE

    # the writer's inventory records the second it was taken: both saves get the same one, or a
    # second boundary between them would make the headers differ (seen once in CI)
    inventory = writer.writer_inventory
    monkeypatch.setattr(writer, "writer_inventory", lambda devices: {**inventory(devices), "time": "pinned"})
    state = {**_state(), "big": torch.randn(CACHE_PIECE // 4 * 2 + 3)}  # two pieces and 12 bytes
    p = tmp_path / "ck.safetensors"
    certckpt.save(state, p, signing_key=keys["signing"])
    info = certckpt.inspect(p)
    assert info.record.writer["time"] == "pinned"
    sig = json.loads(info.header.metadata[SIG_KEY])
    assert set(sig) == {"key", "data_blake3", "ed25519"}
    assert sig["data_blake3"] == blake3.blake3(p.read_bytes()[info.header.data_start :]).hexdigest()
    streamed = io.BytesIO()
    certckpt.save(state, streamed, signing_key=keys["signing"])
    assert streamed.getvalue() == p.read_bytes()
    assert certckpt.verify(p, trusted_keys=keys["trusted"]).ok
