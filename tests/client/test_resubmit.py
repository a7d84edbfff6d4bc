"""Producer-side at-least-once: resubmission of overdue jobs (same id, bounded) and durable
submit (``WAIT`` for replicas), against the machine's Redis and a cluster with replicas; a job
lost before any worker read it is recovered by resubmission, and is lost without it."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.client import Responder
from tests.support.failover import FailoverCluster
from worker import keys
from worker.aio_client import AsyncScoringClient
from worker.client import ScoringClient, ScoringTimeout
from worker.client.resubmit import Resubmitter
from worker.errors import ConfigError

SEQS = [{"tokens": [1, 2, 3, 4], "prompt_len": 2}]
pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("cleanup_keys")]


def test_resubmitter_is_bounded_and_waits_its_interval() -> None:
    r = Resubmitter(after_s=1.0, max_submits=3)
    r.track("a", "job-a", now=0.0)
    assert r.due(["a"], now=0.5) == [] and r.next_due(["a"]) == 1.0
    assert r.due(["a"], now=1.0) == [("a", "job-a")]
    assert r.due(["a"], now=1.5) == []
    assert r.due(["a"], now=2.0) == [("a", "job-a")]
    assert r.due(["a"], now=9.0) == [] and len(r) == 0  # three XADDs in all
    assert r.resubmits == 2
    assert not Resubmitter(None, 3).enabled and not Resubmitter(1.0, 1).enabled
    with pytest.raises(ConfigError):
        Resubmitter(0.0, 3)


def _group(url: str, streams: list[str]) -> None:
    with redis.Redis.from_url(url) as admin:
        for stream in streams:
            admin.xgroup_create(stream, keys.DEFAULT_GROUP, id="0", mkstream=True)


def _lose(url: str, handle) -> None:  # type: ignore[no-untyped-def]
    """Delete the job's entry before any worker read it (what a failover can do to an XADD
    the old primary acknowledged but never replicated)."""
    with redis.Redis.from_url(url) as admin:
        assert admin.xdel(handle.stream, handle.entry_id) == 1


@pytest.mark.timeout(60)
def test_lost_job_is_lost_without_resubmission(redis_url: str, key_prefix: str) -> None:
    streams = keys.job_streams(key_prefix)
    with ScoringClient(redis_url, queue=key_prefix) as client:
        _group(redis_url, streams)  # the group exists; nothing reads yet
        handle = client.submit(SEQS)
        _lose(redis_url, handle)
        with Responder(redis_url, streams), pytest.raises(ScoringTimeout):
            client.result(handle, timeout=2.0)
        assert client.resubmits == 0


@pytest.mark.timeout(60)
def test_lost_job_is_recovered_by_resubmission(redis_url: str, key_prefix: str) -> None:
    streams = keys.job_streams(key_prefix)
    with ScoringClient(redis_url, queue=key_prefix, resubmit_after_s=0.5, max_submits=3) as client:
        _group(redis_url, streams)  # the group exists; nothing reads yet
        handle = client.submit(SEQS)
        _lose(redis_url, handle)
        with Responder(redis_url, streams) as worker:
            result = client.result(handle, timeout=10.0)
        assert result.job_id == handle.job_id
        assert [round(x, 2) for x in result.seqs[0].logps] == [-0.03, -0.04]
        assert client.resubmits == 1
        assert [j.id for j in worker.seen_jobs] == [handle.job_id]  # the same id came back


@pytest.mark.timeout(60)
def test_async_client_recovers_a_lost_job(redis_url: str, key_prefix: str) -> None:
    streams = keys.job_streams(key_prefix)

    async def main() -> tuple[str, str, int]:
        async with AsyncScoringClient(redis_url, queue=key_prefix, resubmit_after_s=0.5) as client:
            _group(redis_url, streams)  # the group exists; nothing reads yet
            handle = await client.submit(SEQS)
            _lose(redis_url, handle)
            with Responder(redis_url, streams):
                result = await client.result(handle, timeout=10.0)
            return result.job_id, handle.job_id, client.resubmits

    got, sent, resubmits = asyncio.run(main())
    assert got == sent and resubmits == 1


@pytest.mark.timeout(60)
def test_resubmission_is_bounded_and_a_slow_answer_is_not_duplicated(
    redis_url: str, key_prefix: str
) -> None:
    streams = keys.job_streams(key_prefix)
    with ScoringClient(redis_url, queue=key_prefix, resubmit_after_s=0.2, max_submits=3) as client:
        _group(redis_url, streams)  # the group exists; nothing reads yet
        handle = client.submit(SEQS)
        with pytest.raises(ScoringTimeout):  # no worker: three XADDs, then it stops
            client.result(handle, timeout=1.5)
        with redis.Redis.from_url(redis_url) as admin:
            assert admin.xlen(handle.stream) == 3
        assert client.resubmits == 2
        with Responder(redis_url, streams):  # all three copies answered: the trainer sees one
            assert client.result(handle, timeout=10.0).job_id == handle.job_id
            with pytest.raises(ScoringTimeout):
                client.result(handle, timeout=0.5)


@pytest.mark.timeout(60)
def test_durable_submit_reports_missing_replicas(redis_url: str, key_prefix: str) -> None:
    """The machine's Redis has no replica: WAIT 1 returns 0 after its timeout, counted."""
    streams = keys.job_streams(key_prefix)
    with (
        Responder(redis_url, streams),
        ScoringClient(
            redis_url, queue=key_prefix, durable_replicas=1, durable_timeout_ms=50
        ) as client,
    ):
        assert client.score(SEQS, timeout=10.0)
        assert client.undurable == 1


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverCluster]:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    with FailoverCluster(Path(tmp_path_factory.mktemp("resubmit"))) as c:
        yield c


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_cluster_durable_submit_and_resubmission_recover_a_lost_job(
    cluster: FailoverCluster, key_prefix: str
) -> None:
    streams = keys.job_streams(key_prefix)
    with ScoringClient(
        cluster.url,
        queue=key_prefix,
        resubmit_after_s=0.5,
        durable_replicas=1,
        durable_timeout_ms=2000,
    ) as client:
        node = cluster_node_url(cluster, streams[0])
        _group(node, streams)  # the group exists; nothing reads yet
        handle = client.submit(SEQS)
        assert client.undurable == 0  # the replica acknowledged the XADD
        _lose(node, handle)
        with Responder(node, streams):
            assert client.result(handle, timeout=10.0).job_id == handle.job_id
        assert client.resubmits == 1 and client.undurable == 0


def cluster_node_url(cluster: FailoverCluster, key: str) -> str:
    """The URL of the primary that serves ``key`` (the Responder talks to one node)."""
    c = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        node = c.get_node_from_key(key)
        return f"redis://127.0.0.1:{node.port}"
    finally:
        c.close()


@contextlib.contextmanager
def _replica_stopped(cluster: FailoverCluster, key: str) -> Iterator[int]:
    """SIGSTOP the replica of ``key``'s primary (it acknowledges nothing) until the block ends."""
    node = cluster_node_url(cluster, key)
    replica = cluster.replica_of(int(node.rsplit(":", 1)[1]))
    proc = cluster.procs[replica]
    proc.send_signal(signal.SIGSTOP)
    try:
        yield replica
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_async_cluster_durable_submit_waits_on_the_streams_primary(
    cluster: FailoverCluster, key_prefix: str
) -> None:
    """The asyncio client's durable submit on Redis Cluster: XADD and WAIT share one connection
    to the stream's primary, so the WAIT counts that XADD's replica (a WAIT sent anywhere else
    would count a stopped replica, or another primary's, and see no shortfall)."""
    streams = keys.job_streams(key_prefix)

    async def submit_one(replicas: int) -> tuple[int, str]:
        async with AsyncScoringClient(
            cluster.url, queue=key_prefix, durable_replicas=replicas, durable_timeout_ms=300,
            wait_for_unknown_queue=True,  # no worker here: the XADD's durability is the subject
        ) as client:  # fmt: skip
            handle = await client.submit(SEQS)
            return client.undurable, handle.entry_id

    undurable, entry_id = asyncio.run(submit_one(1))
    assert undurable == 0  # the replica acknowledged the XADD
    node = cluster_node_url(cluster, streams[0])
    replica = cluster.replica_of(int(node.rsplit(":", 1)[1]))
    with redis.Redis(port=replica) as r:  # and it has the entry
        r.execute_command("READONLY")
        assert [i.decode() for i, _ in r.xrange(streams[0])][-1] == entry_id
    with _replica_stopped(cluster, streams[0]):
        assert asyncio.run(submit_one(1))[0] == 1  # WAIT 1 on that node: 0 within 300 ms
    assert asyncio.run(submit_one(2))[0] == 1  # one replica per primary: 2 is never met
