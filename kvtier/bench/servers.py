"""Real servers on loopback for tests and benchmarks: redis-server (standalone and a
3-master cluster) and moto's S3 server. Loopback only; each process is killed on stop()."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


class ServerMissing(RuntimeError):
    """A server binary is not installed."""


def free_port(also_bus: bool = False) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port > 55000 and also_bus:
            continue
        if not also_bus or _is_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def require_redis() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise ServerMissing(
            "redis-server is not installed (apt-get install -y redis-server)"
        )
    return path


class RedisServer:
    """One redis-server process on a loopback port; `stop()`/`start()` for fault tests."""

    def __init__(
        self, workdir: Path, port: int | None = None, cluster: bool = False
    ) -> None:
        self.binary = require_redis()
        self.port = port or free_port(also_bus=cluster)
        self.workdir = workdir
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
        ]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
            ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait(lambda: self._ping(), "redis-server did not answer PING")
        return self

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _wait(self, ok, message: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.05)
        raise RuntimeError(f"{message} on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_cluster(workdir: Path, masters: int = 3) -> list[RedisServer]:
    nodes = [RedisServer(workdir, cluster=True).start() for _ in range(masters)]
    cli = shutil.which("redis-cli")
    if cli is None:
        for n in nodes:
            n.stop()
        raise ServerMissing(
            "redis-cli is not installed (it ships with redis-server / redis-tools)"
        )
    subprocess.run(
        [
            cli,
            "--cluster",
            "create",
            *[f"127.0.0.1:{n.port}" for n in nodes],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
    )

    def ready() -> bool:
        for n in nodes:  # every node must agree, or the first writes bounce
            out = subprocess.run(
                [cli, "-p", str(n.port), "cluster", "info"],
                capture_output=True,
                text=True,
            )
            if (
                "cluster_state:ok" not in out.stdout
                or "cluster_slots_ok:16384" not in out.stdout
            ):
                return False
        return True

    nodes[0]._wait(ready, "redis cluster did not reach cluster_state:ok", timeout=30)
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=nodes[0].port)
    nodes[0]._wait(
        lambda: _writes_everywhere(client),
        "redis cluster did not accept writes",
        timeout=30,
    )
    client.close()
    return nodes


def _writes_everywhere(client) -> bool:
    try:
        for i in range(64):  # keys spread over every master's slots
            client.set(f"kvtier-probe-{i}", b"1")
            client.delete(f"kvtier-probe-{i}")
        return True
    except Exception:
        return False


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.port = free_port()
        import logging

        logging.getLogger("werkzeug").setLevel(
            logging.ERROR
        )  # one access-log line per request otherwise
        self.server = ThreadedMotoServer(
            ip_address="127.0.0.1", port=self.port, verbose=False
        )
        self.server.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()


class BlackHole:
    """A loopback port that accepts connections and never answers (a hung server)."""

    def __init__(self) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never read or answered

    def stop(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()
