"""A real SeaweedFS (master, volume server, filer and S3 gateway) on 127.0.0.1 for the suite,
started through the users' own script, ``scripts/local-s3.sh`` (one command line for both).

The script prints the variables to export only once the gateway answers; reading its output up to
that line is the wait (it gives up and exits after 60 s, which ends the read too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from tests.support.helpers import console_script

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "local-s3.sh")


@dataclass(kw_only=True)
class SeaweedServer:
    """A started SeaweedFS: its S3 endpoint, the one identity it accepts, its directory."""

    endpoint: str
    env: dict[str, str]  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION
    directory: str
    proc: subprocess.Popen = field(repr=False)

    def stop(self) -> None:
        """SIGTERM to the script, which stops weed (TERM, then KILL after 2 s) and removes its
        sockets; the whole process group is killed if the script itself does not end."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def start_seaweed(directory: str, *, access_key: str, secret_key: str) -> SeaweedServer:
    """Start SeaweedFS with its data in ``directory``; returns once its S3 gateway answers.

    Raises:
        RuntimeError: the binary is missing or the server did not start (with the script's words).
    """
    env = dict(os.environ, WEED=console_script("weed"), PYTHON=sys.executable)
    proc = subprocess.Popen(
        ["bash", SCRIPT, "--dir", directory, "--access-key", access_key, "--secret-key", secret_key],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: killed whole if the script hangs
    )
    assert proc.stdout is not None and proc.stderr is not None
    exports: dict[str, str] = {}
    for line in proc.stdout:  # the script writes these lines once the gateway answers
        if line.startswith("export "):
            k, _, v = line[len("export ") :].strip().partition("=")
            exports[k] = v
            if k == "AWS_DEFAULT_REGION":
                break
    if "AWS_DEFAULT_REGION" not in exports:
        proc.wait(timeout=30)
        raise RuntimeError(f"SeaweedFS did not start: {proc.stderr.read().strip()}")
    # the pipes stay open (closed pipes would kill the script with SIGPIPE at its next word, leaving
    # weed running); it writes nothing more unless it fails
    return SeaweedServer(endpoint=exports["AWS_ENDPOINT_URL"], env=exports, directory=directory, proc=proc)
