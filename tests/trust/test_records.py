"""Ledger records as types: parsed once, refused with their reason, kinds and outcomes as enums."""

from __future__ import annotations

import json

from certckpt.errors import CorruptCheckpointError, TruncatedCheckpointError
from certckpt.format.verify import ProblemKind, verify
from certckpt.trust.facts import KIND_BIT
from certckpt.trust.records import (
    CommitRecord,
    DrillRecord,
    EventKind,
    Outcome,
    PlacementRecord,
    check_family,
    parse_record,
    why_invalid,
)

COMMIT = {
    "ckpt_id": "main@10",
    "run": "r1",
    "branch": "main",
    "step": 10,
    "url": "step10.safetensors",
    "parent": None,
    "consensus_fp": "ab",
    "state_fp": "cd",
    "header_digest": "ef",
    "committed_at": 5,
}


def test_a_commit_record_is_parsed_once_into_its_fields_and_keeps_what_was_stored():
    rec = parse_record("checkpoints", "main@10.json", dict(COMMIT))
    assert isinstance(rec, CommitRecord)
    assert (rec.ckpt_id, rec.branch, rec.step, rec.url, rec.header_digest) == (
        "main@10",
        "main",
        10,
        "step10.safetensors",
        "ef",
    )
    assert rec.committed_at == 5.0 and isinstance(rec.committed_at, float)
    assert rec.raw == COMMIT and rec["url"] == "step10.safetensors" and rec.get("run") == "r1"  # the stored view


def test_a_record_that_fails_becomes_its_reason_as_before():
    assert parse_record("checkpoints", "x.json", dict(COMMIT)) == "names main@10 but is stored as x.json"
    assert parse_record("checkpoints", "main@10.json", {**COMMIT, "url": "../x"}) == (
        "names its file '../x', a path that climbs out of the store"
    )
    assert parse_record("checkpoints", "main@10.json", [1]) == "not a JSON object (list)"
    assert why_invalid("checkpoints", "main@10.json", dict(COMMIT)) is None
    # an integer no float holds is refused with the reason a non-number gets, never a traceback
    huge = json.loads(json.dumps({**COMMIT, "committed_at": 10**400}))
    assert parse_record("checkpoints", "main@10.json", huge) == "its commit time is not a number"


def test_drills_and_placements_are_typed():
    d = parse_record("drills", "0001-ab.json", {"ckpt_id": "main@10", "step": 10, "outcome": "pass"})
    assert isinstance(d, DrillRecord) and d.drill_id == "0001-ab" and d.outcome == "pass"
    assert parse_record("drills", "x.json", {"ckpt_id": "main@10", "step": -1}) == "step is not a non-negative int"
    p = parse_record("placements", "m.json", {"branch": "m", "start_step": 0, "devices": {"0": "gpu-1"}})
    assert isinstance(p, PlacementRecord) and dict(p.devices) == {"0": "gpu-1"} and p.fleet is None


def test_kinds_and_outcomes_compare_equal_to_the_stored_strings():
    assert EventKind.NONFINITE_PRE == "nonfinite-pre" and Outcome.PASS == "pass" and f"{Outcome.FAIL}" == "fail"
    assert {"replay": 1}[EventKind.REPLAY] == 1 and str(EventKind.CONSENSUS) == "consensus"
    assert check_family("nonfinite-pre") == check_family("nonfinite-post") == EventKind.NONFINITE
    assert check_family("replay") == "replay" and check_family("anything") == "anything"
    # the certifier's per-kind bits come from the same fold
    assert KIND_BIT["nonfinite-pre"] == KIND_BIT["nonfinite-post"] == KIND_BIT["nonfinite"]


def test_truncation_is_its_own_error_type_and_problem_kind(tmp_path):
    assert issubclass(TruncatedCheckpointError, CorruptCheckpointError)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x10\x00\x00")  # fewer bytes than the header's length field
    report = verify(str(short))
    assert [p.kind for p in report.problems] == [ProblemKind.TRUNCATED] and "truncated" in report.problems[0].message
