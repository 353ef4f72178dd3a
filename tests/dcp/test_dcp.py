"""Certified sharded checkpoints (certckpt.dcp): the sharding-independent fingerprint, DCP save/load
through CertifiedWriter/CertifiedReader on local paths, file:// and memory://, verify/inspect of a
directory, non-tensor values without pickle, and (slow) FSDP2 on 4 gloo ranks as 2 x 2 HSDP, loaded
onto 2 ranks and onto 1 process, a flipped bit and a missing shard named, S3 through moto."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import certckpt
from certckpt.dcp import CertifiedReader, CertifiedWriter, inspect_checkpoint, read_manifest, verify_checkpoint
from certckpt.format.leaves import plain_tensor
from certckpt.format.sharded.composition import compose, hex64
from certckpt.format.sharded.shardfp import contribution, sum_plan, tensor_contribution, write_sums
from certckpt.format.tensors import TORCH_TO_ST
from certckpt_cli.main import main
from tests.support import dcp_cases
from tests.support.fpref import CHUNK, M64, SEED_T, SEED_V, splitmix64

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


# --- the sharding-independent fingerprint ---------------------------------------------------------


def _ref_sum(data: bytes) -> int:
    """S of fingerprint v1 (docs/format.md section 4), in pure Python."""
    padded = data + b"\0" * (-len(data) % 4)
    s = 0
    for i in range(len(padded) // 4):
        (w,) = struct.unpack_from("<i", padded, 4 * i)
        m = ((splitmix64((i % CHUNK) ^ SEED_T) | 1) * (splitmix64((i // CHUNK) ^ SEED_V) | 1)) & M64
        s = (s + w * m) & M64
    return s


def _ref_contribution(full: torch.Tensor, box: tuple[slice, ...]) -> int:
    """The rule as specified: S over the full tensor's bytes with every byte outside the shard zeroed."""
    keep = torch.zeros(full.shape, dtype=torch.bool)
    keep[box] = True
    raw = bytearray(full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    e = full.element_size()
    for i, k in enumerate(keep.reshape(-1).tolist()):
        if not k:
            raw[i * e : (i + 1) * e] = b"\0" * e
    return _ref_sum(bytes(raw))


def _rand(shape, dtype, g):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-128 if dtype.is_signed else 0, 127, shape, generator=g).to(dtype)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.int64,
    torch.complex64,
]


def test_known_answers_of_shard_contributions():
    # docs/format.md, "Sharded checkpoints (DCP)": a bf16 [2, 5] tensor split at column 3 (shards
    # whose 2-byte elements share 32-bit words across the cut), and a float32 [6] split at 4.
    x = torch.arange(10, dtype=torch.bfloat16).reshape(2, 5)
    a = tensor_contribution(x[:, :3].contiguous(), offsets=[0, 0], global_shape=[2, 5])
    b = tensor_contribution(x[:, 3:].contiguous(), offsets=[0, 3], global_shape=[2, 5])
    assert (hex64(a), hex64(b)) == ("8c8cf0c2444a7d40", "e62b934a3a0c6580")
    assert hex64(compose([a, b], "BF16", [2, 5])) == certckpt.fingerprint_hex(x) == "01b8e8d0379f32e0"
    assert a == _ref_contribution(x, (slice(None), slice(0, 3)))
    y = torch.arange(6, dtype=torch.float32)
    c = tensor_contribution(y[:4], offsets=[0], global_shape=[6])
    d = tensor_contribution(y[4:], offsets=[4], global_shape=[6])
    assert (hex64(c), hex64(d)) == ("ac485b59a2400000", "0f8ad232ade00000")
    assert hex64(compose([c, d], "F32", [6])) == certckpt.fingerprint_hex(y) == "95660e4ea5e835ae"


def test_contributions_match_the_rule_byte_for_byte():
    # The pure-Python rule (zero every byte outside the shard, sum the words) on small odd shapes of
    # every element size, with shards cut along every dimension.
    g = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    for dtype in (torch.int8, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        for shape in ([7], [3, 5], [2, 3, 5]):
            x = _rand(shape, dtype, g)
            box = tuple(slice(a, rng.randint(a + 1, s)) for s in shape for a in [rng.randint(0, s - 1)])
            shard = x[box].contiguous()
            got = tensor_contribution(shard, offsets=[s.start for s in box], global_shape=shape)
            assert got == _ref_contribution(x, box), (dtype, shape, box)


def test_any_grid_partition_composes_to_the_full_tensor_fingerprint():
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for trial in range(120):
        k = rng.randint(0, 3)
        shape = [rng.randint(1, 9) for _ in range(k)]
        if trial % 30 == 0 and k:
            shape[-1] = 70_001  # runs that cross the fingerprint's 65,536-word chunks
        dtype = DTYPES[trial % len(DTYPES)]
        x = _rand(shape, dtype, g)
        cuts = []
        for s in shape:
            c = sorted({0, s, *(rng.randint(0, s) for _ in range(rng.randint(0, 2)))})
            cuts.append(list(zip(c[:-1], c[1:])))
        raws = []
        for box in itertools.product(*cuts):
            shard = x[tuple(slice(a, b) for a, b in box)] if k else x
            raws.append(tensor_contribution(shard, offsets=[a for a, _ in box], global_shape=shape))
        assert compose(raws, TORCH_TO_ST[dtype], shape) == certckpt.fingerprint(x), (shape, dtype, cuts)


def test_a_shard_fed_in_pieces_adds_up():
    # verify --deep streams a shard in pieces; many short runs take the vectorised path
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    for dtype, shape, dim in [
        (torch.bfloat16, [300, 11], 1),
        (torch.int8, [40, 301, 3], 1),
        (torch.float64, [30, 70, 7], 2),
    ]:
        x = _rand(shape, dtype, g)
        cut = rng.randint(1, shape[dim] - 1)
        box = [slice(None)] * len(shape)
        box[dim] = slice(cut, None)
        shard = x[tuple(box)].contiguous()
        offsets = [0] * len(shape)
        offsets[dim] = cut
        flat, e, pos, total = shard.reshape(-1).view(torch.uint8), shard.element_size(), 0, 0
        while pos < shard.numel():
            take = min(rng.randint(1, shard.numel() // 3), shard.numel() - pos)
            total += contribution(
                flat[pos * e : (pos + take) * e],
                elem_size=e,
                offsets=offsets,
                sizes=list(shard.shape),
                global_shape=shape,
                first_element=pos,
            )
            pos += take
        assert total % 2**64 == tensor_contribution(shard, offsets=offsets, global_shape=shape)


def test_write_sums_give_the_shard_fingerprint_and_its_contribution_in_one_pass():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4 * 65536 + 3, generator=g)  # dim-0 shards at chunk boundaries (one pass) and not
    for lo, hi in [(0, x.numel()), (65536, 3 * 65536), (3 * 65536, x.numel()), (5, 70_000)]:
        shard = x[lo:hi]
        own, placed = write_sums(shard, offsets=[lo], global_shape=list(x.shape))
        assert certckpt.fingerprint(shard) == compose([own], "F32", shard.shape)
        assert placed == tensor_contribution(shard, offsets=[lo], global_shape=list(x.shape))
    y = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    own, placed = write_sums(y[:, 2:].contiguous(), offsets=[0, 2], global_shape=[6, 5])
    assert placed == _ref_contribution(y, (slice(None), slice(2, 5)))


def test_is_partition():
    from certckpt.format.sharded.composition import is_partition

    grid = [((0, 0), (2, 3)), ((2, 0), (2, 3)), ((0, 3), (4, 2))]  # not a product grid: pairwise
    assert is_partition(grid, (4, 5))
    assert is_partition([((0,), (3,)), ((3,), (4,))], (7,)) and is_partition([((), ())], ())
    assert not is_partition([((0,), (4,)), ((3,), (4,))], (8,))  # overlap and a gap, volumes add up
    assert not is_partition([((0,), (3,))], (7,))  # a gap
    assert not is_partition([((0, 0), (2, 2)), ((0, 0), (2, 2))], (2, 4))  # the same box twice


# --- DCP save / load in one process -----------------------------------------------------------------


def _state(seed=0, lr=1e-2):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    m(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": 3 + seed, "tags": ["a", "b"]}}


def _location(kind, tmp_path, memroot):
    return {"path": str(tmp_path / "ck"), "file": f"file://{tmp_path}/ck", "memory": f"{memroot}/ck"}[kind]


@pytest.mark.parametrize("kind", ["path", "file", "memory"])
def test_save_load_round_trip_with_values_as_data(kind, tmp_path, memroot):
    url = _location(kind, tmp_path, memroot)
    state = _state()
    writer = CertifiedWriter(url, run="r1", step=7)
    dcp.save(state, storage_writer=writer, no_dist=True)
    manifest, record = inspect_checkpoint(url)
    assert (record.run, record.step, [f.name for f in manifest.files]) == ("r1", 7, ["shard-00000.safetensors"])
    full = certckpt.fingerprint_state({f"model.{k}": v for k, v in state["model"].items()})
    assert {t.fqn: t.fp for t in manifest.tensors if t.fqn in full} == full
    values = {v.fqn: v.node for v in manifest.values}
    assert values["extra.epoch"] == ["i", "0x3"] and values["optim.param_groups.0.betas"][0] == "t"

    other = _state(seed=1, lr=5.0)
    reader = CertifiedReader(url, check_fingerprints=True)
    dcp.load(other, storage_reader=reader, no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(other["model"][k], v), k
    assert other["extra"] == {"epoch": 3, "tags": ["a", "b"]}
    assert other["optim"]["param_groups"][0]["lr"] == 1e-2
    assert other["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert reader.checked_tensors == len(manifest.tensors)
    assert verify_checkpoint(url).ok and verify_checkpoint(url, deep=True).ok


class _StagingPlanner(DefaultLoadPlanner):
    """Every region is read into one staging buffer and copied to its tensor on commit (as a planner
    bound for another device may do); ``corrupt`` names a tensor the commit changes afterwards."""

    def __init__(self, corrupt: str | None = None) -> None:
        super().__init__()
        self.staging = torch.empty(1 << 18)
        self.corrupt = corrupt

    def resolve_tensor(self, read_item):
        self._target = super().resolve_tensor(read_item)
        return self.staging[: self._target.numel()].view(self._target.shape)

    def commit_tensor(self, read_item, tensor):
        self._target.copy_(tensor)
        if read_item.dest_index.fqn == self.corrupt:
            tensor.view(-1)[7] += 1  # a change after the digest was checked, before the fingerprint


def test_the_fingerprint_check_sees_what_the_planner_holds_even_when_every_region_shares_one_buffer(tmp_path):
    url = str(tmp_path / "ck")
    g = torch.Generator().manual_seed(3)
    state = {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(12)}}
    dcp.save(state, storage_writer=CertifiedWriter(url), no_dist=True)
    # the worker fingerprints each region in the shared buffer before the next region overwrites it
    out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    reader = CertifiedReader(url, check_fingerprints=True)
    dcp.load(out, storage_reader=reader, planner=_StagingPlanner(), no_dist=True)
    assert all(torch.equal(out["model"][k], v) for k, v in state["model"].items()) and reader.checked_tensors == 12
    # a value changed after its digest was checked: every chunk's digest matched, the fingerprint does not
    with pytest.raises(dcp.api.CheckpointException) as e:
        dcp.load(
            out,
            storage_reader=CertifiedReader(url, check_fingerprints=True),
            planner=_StagingPlanner("model.w5"),
            no_dist=True,
        )
    assert "tensor `model.w5`: the loaded state's fingerprint" in str(
        e.value
    ) and "not the values that were saved" in str(e.value)
    dcp.load(out, storage_reader=CertifiedReader(url), planner=_StagingPlanner("model.w5"), no_dist=True)  # unchecked


def test_a_reader_handed_the_manifest_does_not_read_it_again_and_uses_it_for_one_load(tmp_path):
    url = str(tmp_path / "ck")
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}}
    dcp.save(state, storage_writer=CertifiedWriter(url), no_dist=True)
    manifest, _ = read_manifest(url)
    # the file moved away after the caller read it: the reader never opens it, the shards still check
    os.rename(os.path.join(url, "manifest.safetensors"), tmp_path / "elsewhere")
    out = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    reader = CertifiedReader(url, check_fingerprints=True, manifest=manifest)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert all(torch.equal(out["model"][k], v) for k, v in state["model"].items()) and reader.checked_tensors == 2
    # a second load with the same reader reads the file again (and here finds none)
    with pytest.raises(dcp.api.CheckpointException, match="no committed certified checkpoint"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    with pytest.raises(certckpt.errors.ArgumentTypeError, match="manifest must be a Manifest"):
        CertifiedReader(url, manifest={"files": []})


def test_tied_weights_are_stored_once(tmp_path):
    url = str(tmp_path / "ck")
    w = torch.randn(5, 3)
    dcp.save({"model": {"embed": w, "head": w}}, storage_writer=CertifiedWriter(url), no_dist=True)
    manifest, _ = inspect_checkpoint(url)
    assert {t.fqn: t.chunks[0].entry for t in manifest.tensors} == {
        "model.embed": "model.embed",
        "model.head": "model.embed",
    }
    assert verify_checkpoint(url, deep=True).ok
    out = {"model": {"embed": torch.zeros(5, 3), "head": torch.zeros(5, 3)}}
    dcp.load(out, storage_reader=CertifiedReader(url, check_fingerprints=True), no_dist=True)
    assert torch.equal(out["model"]["embed"], w) and torch.equal(out["model"]["head"], w)


def test_shard_files_are_plain_certified_safetensors(tmp_path):
    from safetensors import safe_open

    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    shard = os.path.join(url, "shard-00000.safetensors")
    assert certckpt.verify(shard).ok and certckpt.verify(os.path.join(url, "manifest.safetensors")).ok
    with safe_open(shard, "pt") as f:
        assert "model.0.weight" in f.keys()  # noqa: SIM118 - safe_open has no __contains__ and f.get_tensor("model.0.weight").shape == (16, 8)
    record = certckpt.inspect(shard).record
    chunks = json.loads(record.user["certckpt.dcp.shards"])
    assert chunks["model.0.weight"] == {"fqn": "model.0.weight", "offsets": [0, 0], "shape": [16, 8]}
    # nothing in the directory is a pickle
    for name in os.listdir(url):
        with open(os.path.join(url, name), "rb") as fh:
            head = fh.read(9)
        assert head[8:9] == b"{", name


def test_a_value_that_needs_pickle_is_refused_naming_it(tmp_path):
    state = _state()
    state["extra"]["sched"] = lambda step: step  # what cannot be stored as data
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.save(state, storage_writer=CertifiedWriter(str(tmp_path / "ck")), no_dist=True)
    assert "extra.sched" in str(e.value) and "never pickled" in str(e.value)
    assert not os.path.exists(tmp_path / "ck" / "manifest.safetensors")


def test_a_committed_checkpoint_is_write_once_unless_overwrite(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.save(_state(1), storage_writer=CertifiedWriter(url), no_dist=True)
    assert "committed certified checkpoint already" in str(e.value)
    (tmp_path / "ck" / "shard-00009.safetensors").write_bytes(b"stale")  # of an earlier, larger save
    dcp.save(_state(1), storage_writer=CertifiedWriter(url, overwrite=True), no_dist=True)
    assert sorted(os.listdir(url)) == ["manifest.safetensors", "shard-00000.safetensors"]
    assert verify_checkpoint(url).ok
    assert inspect_checkpoint(url)[0].values[-1].node == ["l", ["a", "b"]]


def test_shard_files_of_an_unfinished_save_are_replaced(tmp_path):
    url = str(tmp_path / "ck")
    os.makedirs(url)
    (tmp_path / "ck" / "shard-00000.safetensors").write_bytes(b"left by a killed save")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    assert verify_checkpoint(url).ok


def test_a_save_stopped_before_its_commit_is_completed_by_running_it_again_and_another_state_is_refused(
    tmp_path, monkeypatch
):
    import certckpt.trust.ledger as ledger_module
    from certckpt.trust.runstore import certify_store, find_latest_good

    store, url = str(tmp_path / "run"), str(tmp_path / "run" / "step5")
    real = ledger_module.put_once

    def no_chain_entry(location, data):  # the commit record lands, its chain entry never does
        if "/chains/" in location:
            raise certckpt.StorageError(f"{location}: connection reset")
        return real(location, data)

    with monkeypatch.context() as m:
        m.setattr(ledger_module, "put_once", no_chain_entry)
        with pytest.raises(dcp.CheckpointException, match="connection reset"):
            dcp.save(_state(), storage_writer=CertifiedWriter(url, ledger=store, run="r1", step=5), no_dist=True)
    files = {n: os.stat(os.path.join(url, n)).st_mtime_ns for n in os.listdir(url)}
    st = certify_store(store, write_certificates=False)
    assert st.snapshot.checkpoints == [] and st.uncommitted == [url]  # a whole directory, committed by nothing
    # another state, or the same state with other fields, is not this save's: refused, nothing written
    refused = r"another state here \(state fingerprint \w+, this save.s \w+\); nothing was written"
    with pytest.raises(dcp.CheckpointException, match=refused):
        dcp.save(_state(1), storage_writer=CertifiedWriter(url, ledger=store, run="r1", step=5), no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="not one this save wrote .*run='r1'"):
        dcp.save(_state(), storage_writer=CertifiedWriter(url, ledger=store, run="r2", step=5), no_dist=True)
    assert {n: os.stat(os.path.join(url, n)).st_mtime_ns for n in os.listdir(url)} == files
    # the same save again: nothing is written, the checkpoint there is committed
    writer = CertifiedWriter(url, ledger=store, run="r1", step=5)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert writer.ckpt_id == "main@5" and writer.manifest == read_manifest(url)[0]
    assert {n: os.stat(os.path.join(url, n)).st_mtime_ns for n in os.listdir(url)} == files
    status, good = find_latest_good(store, accept="verified", write_certificates=False)
    assert good == "main@5" and status.uncommitted == [] and status.snapshot.breaks == []
    # once committed, the same save again changes nothing; another state is still refused
    dcp.save(_state(), storage_writer=CertifiedWriter(url, ledger=store, run="r1", step=5), no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="another state"):
        dcp.save(_state(2), storage_writer=CertifiedWriter(url, ledger=store, run="r1", step=5), no_dist=True)
    assert [c.ckpt_id for c in certify_store(store, write_certificates=False).snapshot.checkpoints] == ["main@5"]


def _flip_at(path, offset, mask=0x04):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))


def _flip(path, offset_from_end=5):
    _flip_at(path, os.path.getsize(path) - offset_from_end)


def test_flipped_bit_missing_and_extra_files_are_named(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    shard = os.path.join(url, "shard-00000.safetensors")
    header = certckpt.inspect(shard).header
    at = os.path.getsize(shard) - 5 - header.data_start
    last = next(e.name for e in header.entries if e.begin <= at < e.end)  # the tensor the flip lands in
    _flip(shard)
    r = verify_checkpoint(url)
    assert not r.ok and [p.kind for p in r.problems] == ["digest"]
    assert "shard-00000.safetensors" in r.problems[0].message and f"`{last}`" in r.problems[0].message
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load(_state(1), storage_reader=CertifiedReader(url), no_dist=True)
    assert "shard-00000.safetensors" in str(e.value) and "xxh3 digest mismatch" in str(e.value)
    assert f"`{last}`" in str(e.value)

    os.unlink(shard)
    (tmp_path / "ck" / "notes.txt").write_text("not a shard")
    r = verify_checkpoint(url)
    kinds = {p.kind: p.message for p in r.problems}
    assert set(kinds) == {"missing", "extra"}
    assert "shard-00000.safetensors (rank 0) is missing" in kinds["missing"] and "notes.txt" in kinds["extra"]
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load(_state(1), storage_reader=CertifiedReader(url), no_dist=True)
    assert "shard-00000.safetensors (rank 0), listed in the manifest, is missing" in str(e.value)


def test_a_shard_from_another_checkpoint_is_caught(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dcp.save(_state(0), storage_writer=CertifiedWriter(a), no_dist=True)
    dcp.save(_state(1), storage_writer=CertifiedWriter(b), no_dist=True)
    os.chmod(os.path.join(a, "shard-00000.safetensors"), 0o644)
    shutil.copyfile(os.path.join(b, "shard-00000.safetensors"), os.path.join(a, "shard-00000.safetensors"))
    r = verify_checkpoint(a)
    assert [p.kind for p in r.problems] == ["mismatch"] and "replaced after the checkpoint was committed" in str(
        r.problems[0].message
    )
    with pytest.raises(dcp.CheckpointException) as e:
        dcp.load(_state(2), storage_reader=CertifiedReader(a), no_dist=True)
    assert "not the shard file the manifest names" in str(e.value)


def test_damaged_manifest_and_uncommitted_directory(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    _flip(os.path.join(url, "manifest.safetensors"), 40)
    r = verify_checkpoint(url)
    assert not r.ok and r.problems[0].kind == "manifest" and "manifest" in r.problems[0].message
    os.unlink(os.path.join(url, "manifest.safetensors"))
    with pytest.raises(certckpt.NotACheckpointError, match="not a committed certified sharded checkpoint"):
        verify_checkpoint(url)
    with pytest.raises(dcp.CheckpointException, match="no committed certified checkpoint here"):
        dcp.load(_state(1), storage_reader=CertifiedReader(url), no_dist=True)


def test_a_directory_that_is_no_sharded_checkpoint_is_exit_2(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x")
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 2 and "neither a checkpoint file nor a sharded checkpoint" in r.output
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "nothing-here")])
    assert r.exit_code == 2 and "not found" in r.output


def test_plain_dcp_directory_is_named_not_unpickled(tmp_path):
    url = str(tmp_path / "plain")
    dcp.save(_state(), checkpoint_id=url, no_dist=True)  # FileSystemWriter: a pickled .metadata
    with pytest.raises(certckpt.NotACheckpointError, match="its .metadata is a pickle"):
        verify_checkpoint(url)


def test_ledger_commit_names_the_directory(tmp_path):
    from certckpt.trust.runstore import certify_store

    store = str(tmp_path / "run")
    writer = CertifiedWriter(f"{store}/step5", ledger=store, run="r1", step=5)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    assert writer.ckpt_id == "main@5"
    manifest_record = certckpt.inspect(f"{store}/step5/manifest.safetensors").record
    assert (manifest_record.branch, manifest_record.step, manifest_record.run) == ("main", 5, "r1")
    status = certify_store(store, write_certificates=False)
    (entry,) = status.snapshot.checkpoints
    assert entry.ckpt_id == "main@5" and entry.url.rstrip("/").endswith("step5")
    assert status.snapshot.header_digest("main@5") == manifest_record.header_digest
    assert status.certification.verdicts["main@5"].label == "verified"
    with pytest.raises(certckpt.ConfigurationError, match="needs step=N"):
        CertifiedWriter(f"{store}/step6", ledger=store)


def test_latest_good_answers_a_sharded_checkpoint_and_falls_back_past_a_damaged_shard(tmp_path):
    from certckpt.trust.runstore import certify_store, find_latest_good

    store = str(tmp_path / "run")
    for step in (5, 10):
        dcp.save(_state(), storage_writer=CertifiedWriter(f"{store}/step{step}", ledger=store, step=step), no_dist=True)
    status, good = find_latest_good(store, accept="verified", write_certificates=False)
    assert good == "main@10" and status.entry(good).url.rstrip("/").endswith("step10")
    shard = next(p for p in os.listdir(f"{store}/step10") if p.startswith("shard-"))
    _flip(f"{store}/step10/{shard}")
    status, good = find_latest_good(store, accept="verified", write_certificates=False)
    assert good == "main@5" and shard in status.problems["main@10"]
    assert certify_store(store, verify_bytes=True, write_certificates=False).problems.keys() == {"main@10"}
    # a sharded checkpoint written without a ledger is listed as uncommitted, like a loose file
    dcp.save(_state(), storage_writer=CertifiedWriter(f"{store}/loose"), no_dist=True)
    assert certify_store(store, write_certificates=False).uncommitted == [f"{store}/loose"]


# --- the command line -------------------------------------------------------------------------------


def test_cli_verify_and_inspect_a_directory(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url, run="r", step=9), no_dist=True)
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 0 and r.output.startswith("OK") and "sharded: 1 files" in r.output and "step 9" in r.output
    r = CliRunner().invoke(main, ["verify", "--deep", "--json", url])
    doc = json.loads(r.output)
    assert r.exit_code == 0 and doc["ok"] and doc["deep"] and doc["sharded"] and doc["step"] == 9
    r = CliRunner().invoke(main, ["inspect", url])
    assert r.exit_code == 0 and "model.0.weight" in r.output and "shard-00000.safetensors" in r.output
    doc = json.loads(CliRunner().invoke(main, ["inspect", "--json", url]).output)
    assert doc["state_fp"] == read_manifest(url)[0].state_fp and "extra.epoch" in doc["values"]

    _flip(os.path.join(url, "shard-00000.safetensors"))
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 1 and "FAILED" in r.output and "shard-00000.safetensors" in r.output
    assert "Traceback" not in r.output
    os.unlink(os.path.join(url, "manifest.safetensors"))
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 2 and "not a committed certified sharded checkpoint" in r.output


def test_cli_verify_of_a_directory_does_not_import_torch(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=CertifiedWriter(url), no_dist=True)
    code = (
        "import sys\n"
        "from certckpt_cli.main import main\n"
        f"try:\n    main(['verify', {url!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


# --- DTensor in certckpt.save ------------------------------------------------------------------------


def test_plain_tensors_pass_through_plain_tensor():
    t = torch.ones(2)
    assert plain_tensor(t) == (t, None)


# --- many ranks: FSDP2 / HSDP on gloo ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    """A 2 x 2 HSDP state (replicate x shard) saved by 4 gloo ranks, synchronously and with async_save."""
    from certckpt.detect.launch import run_ranks

    root = tmp_path_factory.mktemp("hsdp")
    args = {"dir": str(root / "sync"), "async_dir": str(root / "async"), "plain": str(root / "plain.safetensors")}
    out = run_ranks(dcp_cases.hsdp_save, 4, args, timeout=240)
    return {**args, "ranks": out}


def _copy(hsdp, tmp_path):
    dst = str(tmp_path / "ck")
    shutil.copytree(hsdp["dir"], dst)
    for name in os.listdir(dst):
        os.chmod(os.path.join(dst, name), 0o644)
    return dst


@pytest.mark.slow
def test_hsdp_save_records_full_tensor_fingerprints(hsdp):
    ranks = hsdp["ranks"]
    assert ranks[0]["placements"]["0.weight"] == ["R", "S(0)"]  # replicate x shard
    manifest, record = inspect_checkpoint(hsdp["dir"])
    assert record.step == 1 and len(manifest.files) == 4
    sharded = next(t for t in manifest.tensors if t.fqn == "model.0.weight")
    assert sorted(list(c.offsets) for c in sharded.chunks) == [[0, 0], [17, 0]]  # 34 rows over 2 shards
    assert len({c.file for c in sharded.chunks}) == 2
    big = next(t for t in manifest.tensors if t.fqn == "model.big")
    plans = {
        tuple(c.offsets): sum_plan(c.sizes, offsets=c.offsets, global_shape=big.shape, elem_size=4) for c in big.chunks
    }
    assert plans == {(0, 0): "own", (2, 0): "dual"}  # and deep verification recomputes both below
    fps = {t.fqn: t.fp for t in manifest.tensors}
    assert all(r["fps"] == ranks[0]["fps"] for r in ranks)  # full_tensor() on every rank agrees
    assert {k: fps[k] for k in ranks[0]["fps"]} == ranks[0]["fps"]
    assert ranks[0]["live"] == {"state_fp": manifest.state_fp, "disagreements": []}
    assert verify_checkpoint(hsdp["dir"], deep=True).ok
    async_manifest, _ = inspect_checkpoint(hsdp["async_dir"])
    assert async_manifest.state_fp == manifest.state_fp and verify_checkpoint(hsdp["async_dir"]).ok


@pytest.mark.slow
def test_reshard_load_onto_two_fsdp_ranks(hsdp):
    from certckpt.detect.launch import run_ranks

    out = run_ranks(dcp_cases.fsdp_load, 2, {"dir": hsdp["dir"]}, timeout=240)
    manifest, _ = inspect_checkpoint(hsdp["dir"])
    for r in out:
        assert r["fps"] == hsdp["ranks"][0]["fps"]
        assert r["meta"] == {"epoch": 3, "tag": "hsdp"} and r["lr"] == 1e-2
        assert r["checked"] == len(manifest.tensors)  # every tensor compared with the manifest
    assert [r["local_shape"] for r in out] == [[17, 12], [17, 12]]  # 2-way shards of a 4-way save


@pytest.mark.slow
def test_reshard_load_onto_one_process(hsdp):
    from tests.support.dcp_cases import _model

    m = _model(7)
    opt = torch.optim.AdamW(m.parameters(), lr=3.0)
    m(torch.randn(2, 12)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 0, "tag": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=CertifiedReader(hsdp["dir"], check_fingerprints=True), no_dist=True)
    fps = certckpt.fingerprint_state({f"model.{k}": v for k, v in state["model"].items()})
    assert fps == {k: v for k, v in hsdp["ranks"][0]["fps"].items() if k.startswith("model.")}
    assert state["meta"] == {"epoch": 3, "tag": "hsdp"}


@pytest.mark.slow
def test_flipped_bit_in_one_shard_fails_every_rank_naming_it(hsdp, tmp_path):
    from certckpt.detect.launch import run_ranks

    url = _copy(hsdp, tmp_path)
    manifest, _ = inspect_checkpoint(url)
    w = next(t for t in manifest.tensors if t.fqn == "model.0.weight")
    chunk = w.chunks[1]
    name = manifest.files[chunk.file].name
    info = certckpt.inspect(os.path.join(url, name))
    entry = next(e for e in info.header.entries if e.name == chunk.entry)
    _flip_at(os.path.join(url, name), info.header.data_start + entry.begin + 5, 0x20)

    r = verify_checkpoint(url)
    assert [(p.kind, p.tensor) for p in r.problems] == [("digest", "model.0.weight")]
    assert name in r.problems[0].message and f"`{chunk.entry}`" in r.problems[0].message
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 1 and name in r.output
    out = run_ranks(dcp_cases.fsdp_load_error, 2, {"dir": url}, timeout=240)
    for o in out:  # the rank that read the shard names it; the other does not hang in the check
        assert o["error"] and name in o["error"] and "model.0.weight" in o["error"]


@pytest.mark.slow
def test_missing_shard_is_named(hsdp, tmp_path):
    url = _copy(hsdp, tmp_path)
    os.unlink(os.path.join(url, "shard-00002.safetensors"))
    r = verify_checkpoint(url)
    assert [p.kind for p in r.problems] == ["missing"] and "shard-00002.safetensors (rank 2)" in r.problems[0].message
    from tests.support.dcp_cases import _model

    state = {"model": _model(1).state_dict()}
    with pytest.raises(dcp.CheckpointException) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=CertifiedReader(url), no_dist=True)
    assert "shard-00002.safetensors (rank 2), listed in the manifest, is missing" in str(e.value)


@pytest.mark.slow
def test_dtensor_in_certckpt_save_plain_tensor(hsdp):
    d = hsdp["ranks"][0]["dtensor"]
    assert d["replicated_plain"] is True
    assert "DTensor sharded over a device mesh" in d["sharded_problem"] and "certckpt.dcp" in d["sharded_problem"]


@pytest.mark.slow
def test_dtensor_in_certckpt_save_end_to_end(hsdp):
    d = hsdp["ranks"][0]["dtensor"]
    assert d["save_replicated"] == "ok"
    assert "DTensor sharded over a device mesh" in d["save_sharded"] and "certckpt.dcp" in d["save_sharded"]
    assert torch.equal(certckpt.load(hsdp["plain"])["w"], torch.arange(6.0))


@pytest.mark.slow
def test_s3_round_trip(s3_bucket):
    url = f"{s3_bucket}/run/step5"
    state = _state()
    dcp.save(state, storage_writer=CertifiedWriter(url, step=5), no_dist=True)
    assert verify_checkpoint(url, deep=True).ok
    other = _state(seed=1, lr=5.0)
    dcp.load(other, storage_reader=CertifiedReader(url, check_fingerprints=True), no_dist=True)
    assert all(torch.equal(other["model"][k], v) for k, v in state["model"].items())
    r = CliRunner().invoke(main, ["verify", url])
    assert r.exit_code == 0 and "sharded: 1 files" in r.output
