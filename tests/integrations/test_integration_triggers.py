"""Triggered replays under the Accelerate, Lightning and Trainer integrations (issue 46).

Their DDP runs hand no gradient over (``hand_over_grads=False``: the loops zero the gradients
themselves), so a triggered replay compares each bucket's sum of squares, which the communication
hook took before the all-reduce, with the neighbour's replay laid out as the bucket. One launched
world of 3 gloo ranks runs every family in turn (``tests/support/sentinel_cases.integrations_world``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Trainer's model is built from a config

from certckpt.detect.launch import run_ranks
from tests.support import sentinel_cases

NEEDS = {
    "accelerate": ["accelerate"],
    "lightning": ["pytorch_lightning"],
    "transformers": ["transformers", "accelerate"],
}
PRESENT = [f for f, mods in NEEDS.items() if all(importlib.util.find_spec(m) is not None for m in mods)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not PRESENT:
        pytest.skip("none of accelerate, pytorch_lightning, transformers is installed")
    where = str(tmp_path_factory.mktemp("triggers"))
    return run_ranks(sentinel_cases.integrations_world, 3, {"families": PRESENT, "dir": where}, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(NEEDS))
def test_a_large_one_time_fault_between_audits_is_replayed_at_its_step_and_rank_1_named(world, family):
    if family not in PRESENT:
        pytest.skip(f"{family} is not installed")
    print(f"{family}: {world[0][family + '_seconds']:.1f} s on rank 0")
    fault, clean = world[0][family]["fault"], world[0][family]["clean"]
    # the sentinels run although no local gradient survives the all-reduce
    assert (fault["off"], fault["hand_over"]) == (None, False)
    # a backward fault scaling rank 1's largest local gradient element by 1e3 at step 13 (audits every
    # 10 steps, 2 micro-batches a step): flagged and replayed at that step, the buckets' sums of
    # squares differ, arbitration names rank 1; no trigger and no detection before it
    assert fault["caught"] == {
        "kind": "replay",
        "step": 13,
        "suspects": [1],
        "flagged": [1],
        "compared": "sum of squares per bucket",
    }
    assert fault["triggered"] == 1
    assert all(w[family]["fault"]["caught"] == fault["caught"] for w in world)  # every rank raised the same
    # a clean run whose every step is flagged (min_interval=4): the replays at steps 1 and 5 (before
    # and after DDP rebuilt its buckets) pass, and nothing is detected
    assert (clean["caught"], clean["triggered"]) == (None, 2)
