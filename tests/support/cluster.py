"""A real 3-primary Redis Cluster on free ports, started once per test session that asks for it.

Import the fixture into a test module with ``from tests.support.cluster import redis_cluster``
(pytest finds fixtures imported into a module); every module importing it shares the one cluster.
Needs ``redis-server`` and ``redis-cli`` on PATH; skips otherwise.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (the cluster bus)


@dataclass(frozen=True)
class ClusterInfo:
    """Where the test cluster listens."""

    ports: tuple[int, ...]
    log_dir: Path

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL (any node works as the seed)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def client(self) -> redis.RedisCluster:
        """A cluster client (bytes responses)."""
        return redis.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def node_of_slot(self, slot: int) -> int:
        """The port of the primary that serves ``slot``."""
        raw = redis.Redis(port=self.ports[0]).execute_command("CLUSTER", "SLOTS")
        for start, end, primary, *_ in raw:
            if int(start) <= slot <= int(end):
                return int(primary[1])
        raise LookupError(slot)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def cluster_ports(n: int) -> list[int]:
    """``n`` ports whose cluster-bus ports (+10000) are free too, both below the ephemeral
    range: a port checked free there could be taken as the local port of some client's
    connection before ``redis-server`` binds it ("Address already in use")."""
    rng = random.Random()
    top = min(45000, _ephemeral_low() - BUS_OFFSET - 1)
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randint(10000, max(10000 + 4 * n, top))
        if p in ports or p + BUS_OFFSET in ports:
            continue
        if _bindable(p) and _bindable(p + BUS_OFFSET):
            ports.append(p)
    return ports


def _wait(check: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(what)


def start_cluster(tmp: Path, primaries: int = 3) -> tuple[ClusterInfo, list[subprocess.Popen]]:
    """Start ``primaries`` cluster-enabled servers, join them, wait for ``cluster_state:ok``."""
    ports = cluster_ports(primaries)
    procs = []
    for p in ports:
        log = open(tmp / f"redis-{p}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    "redis-server",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(tmp / f"nodes-{p}.conf"),
                    "--cluster-node-timeout",
                    "5000",
                    "--port",
                    str(p),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(tmp),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for p in ports:
            _wait(lambda p=p: redis.Redis(port=p).ping(), 10, f"redis-server on {p}")
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def ok() -> bool:
            for p in ports:
                info = redis.Redis(port=p).execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
            return True

        _wait(ok, 30, "cluster_state:ok")
    except BaseException:
        stop_cluster(procs)
        raise
    return ClusterInfo(tuple(ports), tmp), procs


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    """Terminate the cluster's servers."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class _Shared:
    """The one running cluster of this process and how many fixture copies use it."""

    info: ClusterInfo | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    users: int = 0


_SHARED = _Shared()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    """A 3-primary Redis Cluster shared by the session's cluster tests.

    Every module that imports this fixture gets its own session-scoped copy of it (pytest keys a
    fixture by the module it is found in), so the copies share one cluster, started by the first
    and stopped when the last is torn down (at the end of the session)."""
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    if _SHARED.info is None:
        _SHARED.info, _SHARED.procs = start_cluster(tmp_path_factory.mktemp("cluster"))
    info = _SHARED.info
    _SHARED.users += 1
    try:
        yield info
    finally:
        _SHARED.users -= 1
        if not _SHARED.users:
            procs, _SHARED.info, _SHARED.procs = _SHARED.procs, None, []
            stop_cluster(procs)
