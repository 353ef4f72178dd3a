"""A multi-node SeaweedFS on 127.0.0.1 for the fault tests: one master, three volume servers, a filer and
the S3 gateway, each its own ``weed`` process (so one can be killed alone), every file written twice
(replication ``001``: a second copy on another volume server of the rack, so one server can be lost);
and a TCP proxy in front of the gateway that tells the test when the Nth request of a kind arrives,
holds it until the test says go, and delays or cuts connections on command.

``weed`` ignores SIGTERM while it retries a peer: every process is stopped with SIGKILL (its data is
on disk; the tests restart the gateway on the same port and the same filer).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tests.support.helpers import console_script

_METHOD = re.compile(rb"(GET|PUT|HEAD|POST|DELETE) (/[^ ]*) HTTP/1\.1\r\n")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _log_tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def _wait_http(url: str, proc: subprocess.Popen, *, log: str, seconds: float = 60) -> None:
    """Until ``url`` answers (any HTTP status), or ``proc`` exits, or ``seconds`` pass (the error
    carries the end of the process's log: why ``weed`` gave up)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited ({proc.returncode}) before {url} answered; its log ends:\n{_log_tail(log)}"
                ) from None
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer in {seconds:.0f} s; its log ends:\n{_log_tail(log)}")


@dataclass(kw_only=True)
class Cluster:
    """The processes of one cluster, by role (``master``, ``volume0``..``volume2``, ``filer``, ``s3``)."""

    directory: str
    access_key: str
    secret_key: str
    ports: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (http, grpc)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3'][0]}"

    def _addr(self, role: str) -> str:
        http, grpc = self.ports[role]
        return f"127.0.0.1:{http}.{grpc}"

    def _args(self, role: str) -> list[str]:
        http, grpc = self.ports[role]
        common = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={http}", f"-port.grpc={grpc}"]
        d = os.path.join(self.directory, role)
        os.makedirs(d, exist_ok=True)
        if role == "master":
            # small volumes, none preallocated (a test bucket takes well under 1 MB of disk)
            return ["master", *common, f"-mdir={d}", "-peers=none", "-defaultReplication=001", "-volumeSizeLimitMB=64"]
        if role.startswith("volume"):
            return ["volume", *common, f"-dir={d}", "-max=0", f"-master={self._addr('master')}", "-preStopSeconds=0"]
        if role == "filer":
            return ["filer", *common, f"-master={self._addr('master')}", "-defaultReplicaPlacement=001"]
        conf = os.path.join(self.directory, "s3.json")
        # no Iceberg or Lance server: they bind fixed default ports (8181, 9101), so a gateway restarted
        # while another SeaweedFS of the suite runs (the other xdist worker's) died at start-up
        return ["s3", *common, f"-filer={self._addr('filer')}", f"-config={conf}", "-port.iceberg=0", "-port.lance=0"]

    def start(self, role: str) -> None:
        log_path = os.path.join(self.directory, f"{role}.log")
        log = open(log_path, "ab")  # noqa: SIM115 - the process owns it
        env = dict(os.environ, TMPDIR=os.path.join(self.directory, "run"))
        self.procs[role] = subprocess.Popen(
            [console_script("weed"), *self._args(role)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.path.join(self.directory, role),
            env=env,
        )
        log.close()
        url = f"http://127.0.0.1:{self.ports[role][0]}/"
        if role == "master":
            url += "cluster/status"
        elif role.startswith("volume"):
            url += "status"
        _wait_http(url, self.procs[role], log=log_path)

    def kill(self, role: str) -> None:
        """SIGKILL: what a crashed node does (nothing flushed, nothing said goodbye)."""
        proc = self.procs.pop(role, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    def stop(self) -> None:
        for role in list(self.procs)[::-1]:
            self.kill(role)
        # weed makes its gRPC unix sockets in /tmp whatever TMPDIR says, named by port: this cluster's
        for http, grpc in self.ports.values():
            for port in (http, grpc):
                for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(sock)


def start_cluster(directory: str, *, access_key: str, secret_key: str) -> Cluster:
    """Start every process of the cluster (about 5 s here); ``stop()`` kills them all."""
    os.makedirs(os.path.join(directory, "run"), exist_ok=True)
    roles = ["master", "volume0", "volume1", "volume2", "filer", "s3"]
    ports = _free_ports(2 * len(roles))
    cluster = Cluster(
        directory=directory,
        access_key=access_key,
        secret_key=secret_key,
        ports={r: (ports[2 * i], ports[2 * i + 1]) for i, r in enumerate(roles)},
    )
    with open(os.path.join(directory, "s3.json"), "w") as f:
        ident = {"name": "certckpt", "credentials": [{"accessKey": access_key, "secretKey": secret_key}]}
        json.dump({"identities": [ident | {"actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    try:
        for role in roles:
            cluster.start(role)
        _wait_volumes(cluster, 3)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_volumes(cluster: Cluster, n: int, *, seconds: float = 30) -> None:
    """Until the master knows ``n`` volume servers (their first heartbeat)."""
    url = f"http://127.0.0.1:{cluster.ports['master'][0]}/dir/status"
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
        if text.count('"Url"') >= n:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the master saw fewer than {n} volume servers in {seconds:.0f} s")


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target_port``.

    ``arm(method, n, path=...)``: when the ``n``-th request of ``method`` (counted from the arming;
    with ``path``, of those whose path holds that text) arrives,
    ``hit`` is set and that request is held (not forwarded) until ``release()``: the test does its
    damage in between, tied to the request, never to a clock. ``cut_next(k)``: the next ``k``
    connections are closed as soon as they send anything (a dropped connection). ``delay``: seconds
    each chunk from the server waits before it is passed on (a slow gateway).
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.hit = threading.Event()
        self._go = threading.Event()
        self._armed: tuple[bytes, int, str] | None = None
        self._cut = 0
        self.delay = 0.0
        self.requests: list[tuple[str, str]] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, method: str, n: int, *, path: str = "") -> None:
        with self.lock:
            self.hit.clear()
            self._go.clear()
            self._armed = (method.encode(), n, path)

    def release(self) -> None:
        self._go.set()

    def cut_next(self, k: int) -> None:
        with self.lock:
            self._cut = k

    def close(self) -> None:
        self._closed = True
        self._go.set()
        self.server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self.lock:
            cut, self._cut = self._cut > 0, max(0, self._cut - 1)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=30)
        except OSError:
            client.close()  # the gateway is down: the client sees a refused or reset connection
            return
        try:
            self._pump(client, upstream, cut=cut)
        finally:
            for s in (client, upstream):
                s.close()

    def _pump(self, client: socket.socket, upstream: socket.socket, *, cut: bool) -> None:
        socks = [client, upstream]
        while True:
            ready, _, _ = select.select(socks, [], [], 60)
            if not ready:
                return
            for s in ready:
                data = s.recv(65536)
                if not data:
                    return
                if s is client:
                    if cut:
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        return  # a reset, as a dropped connection or a dying gateway gives
                    self._requests_in(data)
                    upstream.sendall(data)
                else:
                    if self.delay:
                        time.sleep(self.delay)
                    client.sendall(data)

    def _requests_in(self, data: bytes) -> None:
        for m in _METHOD.finditer(data):
            method, path = m.group(1), m.group(2).decode(errors="replace")
            with self.lock:
                self.requests.append((method.decode(), path))
                armed = self._armed
                if armed and armed[0] == method and armed[2] in path:
                    self._armed = (armed[0], armed[1] - 1, armed[2]) if armed[1] > 1 else None
                    held = armed[1] == 1
                else:
                    held = False
            if held:
                self.hit.set()
                self._go.wait(120)
