"""Golden and corrupted fixture files (fixtures/v1/, made by fixtures/make_fixtures.py).

The golden file must load to the recorded values and verify; every corrupted variant must be
reported (by ``verify``, ``load`` and the CLI) with a message that names what is wrong; foreign
files must be refused as "not a checkpoint", naming what they are.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import pytest
import torch
from click.testing import CliRunner

import certckpt
from certckpt_cli.main import main as cli_main
from tests.support.helpers import ROOT

FIXTURES = str(ROOT / "fixtures" / "v1")
GOLDEN = os.path.join(FIXTURES, "golden_small.safetensors")

with open(os.path.join(FIXTURES, "golden_small.expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)

# variant -> (Problem.kind, words its message must contain)
CORRUPT = {
    "bitflip_data.safetensors": ("digest", ["digest", "mismatch"]),
    "bitflip_header.safetensors": ("header", ["header", "digest", "mismatch"]),
    "truncated.safetensors": ("truncated", ["truncated"]),
    "hostile_header_length.safetensors": ("malformed", ["header", "length", "exceeds"]),
    "overlapping_offsets.safetensors": ("malformed", ["header", "overlaps"]),
}
# what load's CorruptCheckpointError must say
LOAD_WORDS = {
    "bitflip_data.safetensors": ["digest", "mismatch"],
    "bitflip_header.safetensors": ["header", "digest"],
    "truncated.safetensors": ["truncated"],
    "hostile_header_length.safetensors": ["header", "exceeds"],
    "overlapping_offsets.safetensors": ["overlaps"],
}
FOREIGN = {
    "torch_save.pt": "torch.save",
    "plain.safetensors": "plain safetensors",
}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def decode_path(path: list) -> tuple:
    return tuple(k["int"] if isinstance(k, dict) else k for k in path)


def at(obj, path: tuple):
    for k in path:
        obj = obj[k]
    return obj


def test_fixture_files_exist_and_are_small():
    names = ["golden_small.safetensors", "golden_small.expected.json", *CORRUPT, *FOREIGN]
    for name in names:
        assert os.path.isfile(fixture(name)), f"missing {name}: run python fixtures/make_fixtures.py"
        assert os.path.getsize(fixture(name)) < 64 * 1024, name


# --- golden ----------------------------------------------------------------------------------------


def test_golden_raw_bytes_match_expected():
    with open(GOLDEN, "rb") as f:
        data = f.read()
    assert len(data) == EXPECTED["file_length"]
    info = certckpt.inspect(GOLDEN)
    assert info.record.step == 42
    assert info.record.run == "golden"
    assert info.record.state_fp == EXPECTED["state_fp"]
    entries = {e.name: e for e in info.header.entries}
    assert sorted(entries) == sorted(t["name"] for t in EXPECTED["tensors"])
    for t in EXPECTED["tensors"]:
        e = entries[t["name"]]
        assert e.dtype == t["dtype"]
        assert list(e.shape) == t["shape"]
        assert [e.begin, e.end] == t["data_offsets"]
        assert info.record.tensors[e.name] == {"fp": t["fp"], "xxh3": t["xxh3"]}
        start = info.header.data_start
        assert sha256(data[start + e.begin : start + e.end]) == t["sha256"], e.name


def test_golden_load_values_match_expected():
    obj = certckpt.load(GOLDEN)
    assert set(obj) == {"model", "optim", "extra"}
    for v in EXPECTED["values"]:
        path = decode_path(v["path"])
        t = at(obj, path)
        assert isinstance(t, torch.Tensor), path
        assert str(t.dtype).removeprefix("torch.") == v["dtype"], path
        assert list(t.shape) == v["shape"], path
        assert sha256(raw_bytes(t)) == v["sha256"], path
    # Each stored tensor, as loaded, hashes to its recorded raw bytes.
    by_name = {t["name"]: t["sha256"] for t in EXPECTED["tensors"]}
    assert sha256(raw_bytes(obj["model"]["0.weight"])) == by_name["model.0.weight"]
    assert sha256(raw_bytes(obj["extra"]["bf16"])) == by_name["extra.bf16"]


def test_golden_load_awkward_values():
    obj = certckpt.load(GOLDEN)
    extra = obj["extra"]
    assert extra[0] == "int key zero"
    assert extra[7] == {1: [1, 2.5, None, True, "s"], -3: ("tuple", 0)}
    assert type(extra[7][-3]) is tuple
    assert math.isnan(extra["nan"])
    assert extra["neg_zero"] == 0.0 and math.copysign(1.0, extra["neg_zero"]) == -1.0
    assert extra["big"] == 2**100 and type(extra["big"]) is int
    assert extra["dtype"] is torch.bfloat16
    assert type(extra["size"]) is torch.Size and extra["size"] == torch.Size([2, 3])
    assert extra["bf16"].dtype == torch.bfloat16 and extra["bf16"].shape == (2, 3)
    assert extra["scalar"].dim() == 0 and extra["scalar"].item() == 3.25
    assert extra["empty"].shape == (0, 5)
    # The two views come back sharing one storage.
    a, b = extra["shared_a"], extra["shared_b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert torch.equal(b, a[2:8].view(2, 3))
    a[3] = 100.0
    assert b[0, 1].item() == 100.0


def test_golden_model_and_optimizer_restore():
    obj = certckpt.load(GOLDEN)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(obj["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    opt.load_state_dict(obj["optim"])
    assert set(obj["optim"]["state"]) == {0, 1, 2, 3}
    assert all(s["step"].item() == 1.0 for s in obj["optim"]["state"].values())
    assert obj["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]


@pytest.mark.parametrize("deep", [False, True], ids=["plain", "deep"])
def test_golden_verifies(deep):
    report = certckpt.verify(GOLDEN, deep=deep)
    assert report.ok, report.problems
    assert report.problems == []
    assert report.deep is deep
    assert report.tensors == len(EXPECTED["tensors"])
    assert report.nbytes == EXPECTED["file_length"]
    d = report.to_dict()
    assert d["step"] == 42 and d["run"] == "golden" and d["state_fp"] == EXPECTED["state_fp"]


# --- corrupted variants ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CORRUPT))
@pytest.mark.parametrize("deep", [False, True], ids=["plain", "deep"])
def test_corrupt_variant_reported_by_verify(name, deep):
    kind, words = CORRUPT[name]
    t0 = time.perf_counter()
    report = certckpt.verify(fixture(name), deep=deep)
    assert time.perf_counter() - t0 < 5
    assert report.ok is False
    assert report.problems, name
    matching = [p for p in report.problems if p.kind == kind]
    assert matching, [(p.kind, p.message) for p in report.problems]
    msg = matching[0].message.lower()
    for w in words:
        assert w in msg, (w, matching[0].message)
    for p in report.problems:
        assert "\n" not in p.message  # one line per problem


def test_bitflip_data_names_the_tensor():
    target = EXPECTED["variants"]["bitflip_data.safetensors"]["tensor"]
    report = certckpt.verify(fixture("bitflip_data.safetensors"))
    assert [(p.kind, p.tensor) for p in report.problems] == [("digest", target)]
    assert f"`{target}`" in report.problems[0].message
    deep = certckpt.verify(fixture("bitflip_data.safetensors"), deep=True)
    assert {(p.kind, p.tensor) for p in deep.problems} == {("digest", target), ("fingerprint", target)}


def test_bitflip_header_only_the_header_is_wrong():
    report = certckpt.verify(fixture("bitflip_header.safetensors"))
    assert [p.kind for p in report.problems] == ["header"]
    # The data is intact: every tensor was still checked.
    assert report.tensors == len(EXPECTED["tensors"])


def test_overlapping_offsets_names_the_tensor():
    report = certckpt.verify(fixture("overlapping_offsets.safetensors"))
    assert len(report.problems) == 1
    assert "`b`" in report.problems[0].message


def test_hostile_header_length_is_refused_without_reading():
    t0 = time.perf_counter()
    report = certckpt.verify(fixture("hostile_header_length.safetensors"))
    assert time.perf_counter() - t0 < 1
    assert str(2**63) in report.problems[0].message
    assert report.info is None


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_variant_load_raises(name):
    with pytest.raises(certckpt.CorruptCheckpointError) as ei:
        certckpt.load(fixture(name))
    msg = str(ei.value).lower()
    for w in LOAD_WORDS[name]:
        assert w in msg, (w, str(ei.value))
    assert isinstance(ei.value, ValueError)  # the documented double inheritance


# --- foreign files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FOREIGN))
@pytest.mark.parametrize("how", ["verify", "load", "inspect"])
def test_foreign_file_is_not_a_checkpoint(name, how):
    fn = {"verify": certckpt.verify, "load": certckpt.load, "inspect": certckpt.inspect}[how]
    with pytest.raises(certckpt.NotACheckpointError) as ei:
        fn(fixture(name))
    assert FOREIGN[name] in str(ei.value)
    assert not isinstance(ei.value, certckpt.CorruptCheckpointError)


# --- the CLI ---------------------------------------------------------------------------------------


def run_cli(*args: str):
    result = CliRunner().invoke(cli_main, list(args))
    # Only sys.exit may end a command; anything else is an unexpected exception.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def test_cli_verify_golden():
    result = run_cli("verify", GOLDEN)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK ")
    assert "step 42" in result.stdout and "run golden" in result.stdout


def test_cli_verify_golden_deep_json():
    result = run_cli("verify", "--deep", "--json", GOLDEN)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["deep"] is True and doc["step"] == 42 and doc["problems"] == []


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_cli_verify_corrupt(name):
    result = run_cli("verify", fixture(name))
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("FAILED")
    problems = certckpt.verify(fixture(name)).problems
    assert len(lines) == 1 + len(problems)  # one line per problem
    assert [ln.strip() for ln in lines[1:]] == [p.message for p in problems]
    kind, words = CORRUPT[name]
    text = result.stdout.lower()
    assert all(w in text for w in words), result.stdout


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_cli_verify_corrupt_json(name):
    result = run_cli("verify", "--json", fixture(name))
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    assert CORRUPT[name][0] in {p["kind"] for p in doc["problems"]}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_cli_verify_foreign(name):
    result = run_cli("verify", fixture(name))
    assert result.exit_code == 2, result.output
    assert FOREIGN[name] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_verify_missing_path(tmp_path):
    result = run_cli("verify", str(tmp_path / "nope.safetensors"))
    assert result.exit_code == 2, result.output
    assert "not found" in result.stderr


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_cli_inspect_foreign(name):
    result = run_cli("inspect", fixture(name))
    assert result.exit_code == 2, result.output


def test_cli_inspect_json_golden():
    result = run_cli("inspect", "--json", GOLDEN)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["step"] == 42 and doc["run"] == "golden" and doc["schema"] == 1
    assert doc["state_fp"] == EXPECTED["state_fp"]
    assert [t["name"] for t in doc["tensors"]] == [t["name"] for t in EXPECTED["tensors"]]
    for got, want in zip(doc["tensors"], EXPECTED["tensors"]):
        assert (got["dtype"], got["shape"], got["fp"], got["xxh3"]) == (
            want["dtype"],
            want["shape"],
            want["fp"],
            want["xxh3"],
        )


def test_cli_inspect_golden_table():
    result = run_cli("inspect", GOLDEN)
    assert result.exit_code == 0, result.output
    assert "step" in result.stdout and "42" in result.stdout
    for t in EXPECTED["tensors"]:
        assert t["name"] in result.stdout and t["fp"] in result.stdout


@pytest.mark.parametrize(
    "name", ["truncated.safetensors", "hostile_header_length.safetensors", "overlapping_offsets.safetensors"]
)
def test_cli_inspect_corrupt_header(name):
    result = run_cli("inspect", fixture(name))
    assert result.exit_code == 1, result.output
    assert len(result.stderr.strip().splitlines()) == 1
