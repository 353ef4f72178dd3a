"""``certckpt.detect.launch`` takes the rank function itself: ``importable`` names it by its module and
finds the folder the ranks need on their path, ``run_ranks`` starts ranks that import it (every
multi-rank test passes its case function from ``tests.support`` this way)."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

from certckpt.detect.launch import free_port, importable, run_ranks
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


def what_a_rank_sees(args: dict) -> dict:
    """A rank's view of its process: environment, path, working directory, what it imported first."""
    import sys

    import torch.distributed as dist

    if dist.get_rank() == args.get("fail_rank"):
        raise ValueError("planted failure on this rank")
    return {
        "env": os.environ.get("WHAT_A_RANK_SEES"),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "log_env": os.environ.get("CERTCKPT_LOG"),
        "pid": os.getpid(),
        "stdin": os.read(0, 1) == b"",
    }


def waits_to_be_killed(args: dict) -> None:
    pathlib.Path(args["ready"]).write_text("ready")
    time.sleep(600)


@pytest.mark.slow
def test_ranks_forked_by_the_warm_server_see_what_fresh_processes_see(tmp_path, monkeypatch):
    from certckpt.detect.forkserver import ENV, ForkServer, fork_rank
    from certckpt.errors import RanksFailedError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WHAT_A_RANK_SEES", "per-call")
    srv = ForkServer(str(tmp_path / "fs.sock"), env=dict(os.environ, WHAT_A_RANK_SEES="server's"))
    try:
        monkeypatch.setenv(ENV, srv.address)
        warm = run_ranks(what_a_rank_sees, 3, {}, timeout=120)
        monkeypatch.setenv(ENV, "")
        cold = run_ranks(what_a_rank_sees, 3, {}, timeout=120)
        for w, c in zip(warm, cold):
            # the caller's environment and directory, not the server's; `-m`'s path; stdin empty
            assert {k: w[k] for k in ("env", "cwd", "path0", "log_env", "stdin")} == {
                k: c[k] for k in ("env", "cwd", "path0", "log_env", "stdin")
            }
            assert w["env"] == "per-call" and w["stdin"] and w["cwd"] == str(tmp_path)
        assert {w["pid"] for w in warm} != {c["pid"] for c in cold}
        # a failing rank: its traceback reaches the error, as from a plain process
        monkeypatch.setenv(ENV, srv.address)
        with pytest.raises(RanksFailedError, match="planted failure on this rank") as e:
            run_ranks(what_a_rank_sees, 3, {"fail_rank": 1}, timeout=120)
        assert "rank 1 (exit 1)" in str(e.value)
        # a killed rank reports the signal as Popen does
        (tmp_path / "args.json").write_text(json.dumps({"ready": str(tmp_path / "ready")}))
        argv = [
            "tests.detect.test_launch:waits_to_be_killed",
            "0",
            "1",
            str(free_port()),
            str(tmp_path / "args.json"),
            str(tmp_path / "out.json"),
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = fork_rank(srv.address, argv, env=env, cwd=str(tmp_path), log=str(tmp_path / "sleeper.log"))
        while not (tmp_path / "ready").exists():
            assert p.poll() is None, (tmp_path / "sleeper.log").read_text()
            time.sleep(0.02)
        p.kill()
        assert p.wait() == -9
    finally:
        srv.stop()
    # the server gone: ranks start as plain processes
    monkeypatch.setenv(ENV, srv.address)
    assert [o["env"] for o in run_ranks(what_a_rank_sees, 3, {}, timeout=120)] == ["per-call"] * 3
