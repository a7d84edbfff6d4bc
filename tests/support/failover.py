"""A Redis Cluster of 3 primaries with a replica each, own ``redis-server`` processes on free
ports, a short ``cluster-node-timeout``, and the kill -9 of a primary followed by the promotion of
its replica (the failover scenario of ``tests/faults`` and the cluster tests of the clients).

Needs ``redis-server`` and ``redis-cli`` on PATH.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.support.cluster import _wait, cluster_ports


class FailoverCluster:
    """``primaries`` primaries, each with one replica; ``kill_primary`` + ``wait_promoted``."""

    def __init__(self, workdir: Path, primaries: int = 3, node_timeout_ms: int = 1000) -> None:
        self.workdir = workdir
        self.primaries = primaries
        self.node_timeout_ms = node_timeout_ms
        self.ports = cluster_ports(primaries * 2)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _spawn(self, port: int) -> None:
        log = open(self.workdir / f"redis-{port}.log", "ab")  # noqa: SIM115 - with the process
        self.procs[port] = subprocess.Popen(
            [
                "redis-server", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms),
                "--cluster-replica-validity-factor", "0",  # a replica always may take over
                "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--dbfilename", f"dump-{port}.rdb", "--save", "", "--appendonly", "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    def start(self) -> FailoverCluster:
        """Start every node, create the cluster, wait until every replica is in sync."""
        for port in self.ports:
            self._spawn(port)
        try:
            for p in self.ports:
                _wait(lambda p=p: redis.Redis(port=p).ping(), 10, f"redis-server on {p}")
            subprocess.run(
                ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", "1", "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )  # fmt: skip
            _wait(self._healthy, 60, "cluster ok with every replica in sync")
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL with the first node as the only seed."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def seeds_url(self, ports: list[int]) -> str:
        """A ``redis+cluster://`` URL listing ``ports`` as seed nodes."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def alive(self) -> list[int]:
        """Ports of the nodes still running."""
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def roles(self) -> dict[int, tuple[str, int | None]]:
        """port -> ("master", None) or ("slave", primary port), as a live node sees it."""
        for port in self.alive():
            try:
                raw = redis.Redis(port=port, socket_timeout=2).execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            by_id: dict[str, int] = {}
            rows = []
            for line in text.strip().splitlines():
                node_id, addr, flags, master, *_ = line.split()
                p = int(addr.split("@")[0].rsplit(":", 1)[1])
                by_id[node_id] = p
                rows.append((p, flags, master))
            out: dict[int, tuple[str, int | None]] = {}
            for p, flags, master in rows:
                if "fail" in flags.split(",") and "master" in flags:
                    out[p] = ("failed", None)
                elif "master" in flags:
                    out[p] = ("master", None)
                else:
                    out[p] = ("slave", by_id.get(master))
            return out
        raise RuntimeError("no live cluster node answered")

    def primary_ports(self) -> list[int]:
        """Ports of the live primaries."""
        return [
            p for p, (role, _) in self.roles().items() if role == "master" and p in self.alive()
        ]

    def replica_of(self, primary: int) -> int:
        """The port of ``primary``'s replica."""
        for p, (role, master) in self.roles().items():
            if role == "slave" and master == primary:
                return p
        raise LookupError(primary)

    def _healthy(self) -> bool:
        for p in self.alive():
            text = redis.Redis(port=p).execute_command("CLUSTER", "INFO").decode()
            if "cluster_state:ok" not in text:
                return False
            info = redis.Redis(port=p).info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return sum(1 for r, _ in self.roles().values() if r == "master") == self.primaries

    def kill_primary(self, port: int) -> int:
        """kill -9 the primary on ``port``; returns the port of the replica that will take over."""
        replica = self.replica_of(port)
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait()
        return replica

    def restart(self, port: int, timeout_s: float = 60.0) -> float:
        """Start the killed node on ``port`` again (same cluster config: it rejoins as the replica
        of the node that took its slots); waits until every replica is in sync; the seconds."""
        t0 = time.monotonic()
        self._spawn(port)
        _wait(lambda: redis.Redis(port=port).ping(), 10, f"redis-server on {port}")
        _wait(self._healthy, timeout_s, "cluster ok with every replica in sync")
        return time.monotonic() - t0

    def wait_promoted(self, replica: int, timeout_s: float = 30.0) -> float:
        """Wait until ``replica`` is a primary and the cluster is ok again; the seconds it took."""
        t0 = time.monotonic()

        def promoted() -> bool:
            info = redis.Redis(port=replica, socket_timeout=2).info("replication")
            if info["role"] != "master":
                return False
            for p in self.alive():
                text = redis.Redis(port=p).execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in text:
                    return False
            return True

        _wait(promoted, timeout_s, f"promotion of {replica}")
        return time.monotonic() - t0

    def stop(self) -> None:
        """Stop every node."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> FailoverCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
