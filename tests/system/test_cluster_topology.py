"""Workers and clients survive topology changes: several seed nodes, the last known topology
tried before the seeds, and every connection or cluster error while (re)connecting retried with
backoff and counted, never fatal (a 3-primary cluster with a replica each; kill -9 of a primary)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.failover import FailoverCluster
from worker import connections
from worker.config import RedisSettings
from worker.daemon.config import WorkerConfig
from worker.daemon.link import RedisLink
from worker.errors import ConfigError
from worker.observability.health import HealthState
from worker.observability.metrics import WorkerMetrics
from worker.processes.local import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.redis]


def test_seed_nodes_from_url_and_flags() -> None:
    s = RedisSettings(url="redis+cluster://:pw@h1:7000,h2:7001", seed_nodes=("h3:7002",))
    assert s.cluster_nodes == [("h1", 7000), ("h2", 7001), ("h3", 7002)]
    assert s.plain_url == "redis://:pw@h1:7000"
    assert s.redacted_url == "redis+cluster://:***@h1:7000,h2:7001"
    with pytest.raises(ConfigError):
        RedisSettings(url="redis://h1:1,h2:2")  # several seeds need a cluster
    with pytest.raises(ConfigError):
        RedisSettings(url="redis+cluster://h1:x")


def test_cluster_node_flag_is_repeatable_and_reaches_settings() -> None:
    from worker.cli import build_parser
    from worker.commands._options import redis_settings

    args = build_parser("info").parse_args(
        ["info", "--redis-url", "redis+cluster://a:1", "--cluster-node", "b:2",
         "--cluster-node", "c:3"]
    )  # fmt: skip
    assert redis_settings(args).cluster_nodes == [("a", 1), ("b", 2), ("c", 3)]


def test_link_retries_a_cluster_it_cannot_reach_and_counts_it() -> None:
    """``RedisClusterException`` (no reachable seed) is not a ``ConnectionError``: the link
    must still back off and retry, not end the worker."""
    registry = CollectorRegistry()
    metrics, health, waits = WorkerMetrics(registry), HealthState(), []
    settings = RedisSettings(url=f"redis+cluster://127.0.0.1:{free_port()}")
    link = RedisLink(
        lambda: connections.connect(settings),
        WorkerConfig(streams=("s",)),
        health=health,
        metrics=metrics,
        wait=waits.append,
    )
    assert link.connect() is None and link.connect() is None
    assert len(waits) == 2 and waits[1] > waits[0]
    assert registry.get_sample_value("scoring_redis_reconnects_total") == 2
    assert health.redis_ok is False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverCluster]:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    with FailoverCluster(Path(tmp_path_factory.mktemp("failover"))) as c:
        yield c


@pytest.mark.timeout(120)
def test_a_dead_first_seed_and_a_dead_only_seed_after_failover(cluster: FailoverCluster) -> None:
    dead = free_port()
    live = cluster.ports[1]
    client = connections.connect(RedisSettings(url=cluster.seeds_url([dead, live])))
    client.set("k{a}", b"1")
    assert client.get("k{a}") == b"1"
    client.close()

    # one seed, a primary: connect once (the topology is remembered), kill it, fail over
    seed = cluster.primary_ports()[0]
    settings = RedisSettings(url=cluster.seeds_url([seed]))
    first = connections.connect(settings)
    first.close()
    replica = cluster.kill_primary(seed)
    cluster.wait_promoted(replica)
    with pytest.raises(redis.exceptions.RedisClusterException):
        redis.RedisCluster.from_url(f"redis://127.0.0.1:{seed}")  # what a seed-only client does
    again = connections.connect(settings)  # the last known topology first
    assert again.ping()
    again.set("k{b}", b"2")
    assert again.get("k{b}") == b"2"
    again.close()


def test_supervised_children_get_every_cluster_node_flag() -> None:
    from worker.processes.fleet import child_flags

    ns = __import__("argparse").Namespace(cluster_node=["b:2", "c:3"], cluster=False)
    flags = child_flags(ns, {"cluster_node": None, "cluster": False}, frozenset())
    assert flags == ["--cluster-node=b:2", "--cluster-node=c:3"]
