"""Issue 45, "Warm latest-good in under half a second": a command imports what it needs to answer.
`certckpt latest-good --no-verify` and `status` read the ledger and certify; the file format's
verifier, the coverage measure and the thread pool stay out until a command verifies bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import helpers

ROOT = str(helpers.ROOT)
NOT_NEEDED = (
    "certckpt.format.companions",
    "certckpt.format.verify",
    "certckpt.format.sharded.check",
    "certckpt.format.header",
    "certckpt.format.datahash",
    "certckpt.trust.coverage",
    "concurrent.futures",
    "torch",
    "fsspec",
)


def _modules(code: str, tmp_path) -> set[str]:
    run = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=ROOT, CERTCKPT_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_warm_latest_good_imports_only_what_it_needs_to_answer(tmp_path):
    from certckpt.trust.ledger import Ledger

    store = tmp_path / "run"
    store.mkdir()
    Ledger(str(store), signing_key=None).commit_checkpoint(branch="main", step=5, location=str(store / "m5"))
    for argv in (["latest-good", str(store), "--no-verify"], ["status", str(store)]):
        code = f"from certckpt_cli.main import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
        loaded = _modules(code, tmp_path)
        assert "certckpt.trust.runstore" in loaded  # it did answer
        assert not loaded & set(NOT_NEEDED), (argv[0], sorted(loaded & set(NOT_NEEDED)))


def test_warm_latest_good_still_verifies_bytes_when_asked(tmp_path):
    from certckpt.trust.runstore import check_file

    (tmp_path / "x.safetensors").write_bytes(b"not a checkpoint")
    problem = check_file(str(tmp_path / "x.safetensors"), None)
    assert problem is not None and "x.safetensors" in problem


def test_warm_latest_good_bench_reads_importtime():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_startup import importtime_ms
    finally:
        sys.path.pop(0)
    stderr = (
        "import time: self [us] | cumulative | imported package\n"
        "import time:       100 |        100 |   _io\n"
        "import time:      2000 |       5000 | certckpt.trust.runstore\n"
        "import time:      1000 |       3000 | click\n"
    )
    total, own, top = importtime_ms(stderr)
    assert (total, own, top[0]) == (8.0, 5.0, ("certckpt.trust.runstore", 5.0))
