"""``certckpt.detect.launch`` takes the rank function itself: ``importable`` names it by its module and
finds the folder the ranks need on their path, ``run_ranks`` starts ranks that import it (every
multi-rank test passes its case function from ``tests.support`` this way)."""

from __future__ import annotations

import json
import pathlib

import pytest

from certckpt.detect.launch import importable, run_ranks
from certckpt.errors import ConfigurationError
from tests.support import ddp_cases
from tests.support.helpers import ROOT


def on_each_rank(args: dict) -> dict:
    """What one rank reports: who it is, what it was given, which module it ran."""
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "got": args["x"], "module": __name__}


def test_importable_names_a_module_level_function_and_the_folder_above_its_package():
    spec, root = importable(on_each_rank)
    assert spec == "tests.detect.test_launch:on_each_rank" and pathlib.Path(root).resolve() == ROOT
    spec, root = importable(ddp_cases.trains_like_plain_ddp)
    assert spec == "tests.support.ddp_cases:trains_like_plain_ddp" and pathlib.Path(root).resolve() == ROOT
    assert importable(json.dumps) == ("json:dumps", None)  # found by every interpreter: no path added

    def nested(args):
        return args

    for fn in (nested, lambda args: args, print):
        with pytest.raises(ConfigurationError, match="module:function"):
            importable(fn)


@pytest.mark.slow
def test_run_ranks_launches_a_function_reference():
    (out,) = run_ranks(on_each_rank, 1, {"x": 7}, timeout=120)
    assert out == {"rank": 0, "world": 1, "got": 7, "module": "tests.detect.test_launch"}
