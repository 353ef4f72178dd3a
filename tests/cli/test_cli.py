"""The certckpt CLI: exit codes, JSON, no torch import on the fast paths, the demo."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import certckpt
from certckpt_cli.main import main


def _ckpt(tmp_path, name="c.safetensors"):
    p = tmp_path / name
    certckpt.save({"w": torch.randn(10, 10), "b": torch.zeros(10)}, p, step=3, run="cli")
    return p


def test_verify_ok_and_json(tmp_path):
    p = _ckpt(tmp_path)
    r = CliRunner().invoke(main, ["verify", str(p)])
    assert r.exit_code == 0 and r.output.startswith("OK") and "step 3" in r.output
    r = CliRunner().invoke(main, ["verify", str(p), "--json", "--deep"])
    doc = json.loads(r.output)
    assert r.exit_code == 0 and doc["ok"] and doc["deep"] and doc["step"] == 3 and doc["tensors"] == 2


def test_verify_failure_is_exit_1_with_one_line_per_problem(tmp_path):
    p = _ckpt(tmp_path)
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x10
    p.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(p)])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert lines[0].startswith("FAILED") and "xxh3 digest mismatch" in lines[1] and "`w`" in lines[1]
    assert "Traceback" not in r.output


def test_unverifiable_is_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "missing.safetensors")])
    assert r.exit_code == 2 and "not found" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["verify", "s3x://bucket/key"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["verify"])
    assert r.exit_code == 2  # click usage error


def test_inspect_table_and_json(tmp_path):
    p = _ckpt(tmp_path)
    r = CliRunner().invoke(main, ["inspect", str(p)])
    assert r.exit_code == 0 and "F32" in r.output and "10x10" in r.output
    assert [line.split() for line in r.output.splitlines() if line.strip().startswith("run ")] == [["run", "cli"]]
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(p), "--json"]).output)
    assert doc["step"] == 3 and {t["name"] for t in doc["tensors"]} == {"w", "b"}
    assert doc["tensors"][0]["fp"] == certckpt.inspect(p).record.tensors[doc["tensors"][0]["name"]]["fp"]


NO_TORCH = """
import sys
from certckpt_cli.main import main
try:
    main([{args}], standalone_mode=True)
except SystemExit as e:
    code = e.code
assert "torch" not in sys.modules, "torch was imported"
print("exit", code)
"""


def test_fast_paths_do_not_import_torch(tmp_path):
    p = _ckpt(tmp_path)
    for args in (f"'verify', {str(p)!r}", f"'inspect', {str(p)!r}", "'--help'"):
        out = subprocess.run(
            [sys.executable, "-c", NO_TORCH.format(args=args)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and "exit 0" in out.stdout, out.stderr


def test_console_script_runs(tmp_path):
    p = _ckpt(tmp_path)
    from tests.support.helpers import console_script

    out = subprocess.run([console_script("certckpt"), "verify", str(p)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("OK")


def test_progress_reports_large_files_on_a_terminal(monkeypatch, capsys):
    from certckpt_cli.common import Progress

    prog = Progress("verifying x")
    prog.enabled = True  # as when stderr is a terminal
    total = 3 << 30
    for done in (0, total // 2, total):
        prog(done, total)
    err = capsys.readouterr().err
    assert "  0%" in err and " 50%" in err and "100%" in err and "3.2 GB" in err
    small = Progress("verifying y")
    small.enabled = True
    small(10, 100)  # small files: silent
    assert capsys.readouterr().err == ""


def test_public_front_door_is_complete_and_light():
    code = (
        "import sys, certckpt\n"
        "light = [certckpt.verify, certckpt.inspect, certckpt.Ledger, "
        "certckpt.certify_store, certckpt.find_latest_good]\n"
        "assert 'torch' not in sys.modules\n"
        "assert all(hasattr(certckpt, n) for n in certckpt.__all__)\n"
        "assert callable(certckpt.fingerprint) and callable(certckpt.save) and certckpt.Auditor.__name__ == 'Auditor'\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
def test_verify_deep_shows_progress_on_a_terminal_from_256_mb(tmp_path):
    import pty

    import torch

    import certckpt
    from tests.support.helpers import console_script

    path = str(tmp_path / "deep.safetensors")
    certckpt.save({"w": torch.zeros(300 * 2**20 // 4)}, path)
    pid, fd = pty.fork()
    if pid == 0:  # the child: certckpt with a terminal on stdout and stderr
        os.execv(console_script("certckpt"), ["certckpt", "verify", "--deep", path])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0 and "100% of 314.6 MB" in text and "fingerprints recomputed" in text


def test_inspect_escapes_names_and_exits_1_where_verify_would(tmp_path):
    import struct

    p = tmp_path / "odd.safetensors"
    certckpt.save({"evil\nname\x1b[31m": torch.ones(2)}, p)
    out = CliRunner().invoke(main, ["inspect", str(p)])
    assert out.exit_code == 0 and "evil\\nname\\x1b[31m" in out.output and "\x1b" not in out.output
    # the header changed after writing (a space of padding turned into another byte): verify says 1
    data = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    doc = json.loads(bytes(data[8 : 8 + n]))
    doc["__metadata__"]["format"] = "pT"
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (n - len(body))
    assert len(body) == n
    q = tmp_path / "edited.safetensors"
    q.write_bytes(bytes(data[:8]) + body + bytes(data[8 + n :]))
    assert CliRunner().invoke(main, ["verify", str(q)]).exit_code == 1
    out = CliRunner().invoke(main, ["inspect", str(q)])
    assert out.exit_code == 1 and "header digest mismatch" in out.output


def test_the_command_turns_certckpt_log_lines_on_for_the_ranks_it_starts(tmp_path):
    """`certckpt ...` sets CERTCKPT_LOG=info for what it starts, unless it is set; a process that
    imports certckpt with it set prints the audit and resume lines on stderr."""
    import subprocess
    import sys

    code = (
        "import certckpt.log, logging; "
        "logging.getLogger('certckpt.resume').info('resumed from main@10: new checkpoints go on branch main-r1')"
    )
    env = {k: v for k, v in os.environ.items() if k != "CERTCKPT_LOG"}
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert quiet.stderr == ""  # a library is silent until asked
    from tests.support.helpers import console_script

    launched = subprocess.run(  # what `certckpt run -- LAUNCHER` hands the ranks
        [console_script("certckpt"), "run", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launched.returncode == 0, launched.stderr
    assert "certckpt: resumed from main@10: new checkpoints go on branch main-r1\n" in launched.stderr
    env["CERTCKPT_LOG"] = "warning"  # the user's setting wins
    lowered = subprocess.run(
        [console_script("certckpt"), "run", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "resumed from" not in lowered.stderr
