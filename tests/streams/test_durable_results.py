"""Durable result writes (``--durable-replicas``): on the two-step path (reply stream on another
Cluster node than its job) the worker acks only after ``WAIT`` saw a replica take the result; on a
shortfall the entry stays pending and the result is written again. Against the replicated test
cluster (3 primaries with a replica each); a stopped replica (SIGSTOP) acknowledges nothing."""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.crc import key_slot

from tests.support.daemon import WorkerProc, metric, wait_until
from tests.support.failover import FailoverCluster
from worker import keys, streams
from worker.client import ScoringClient
from worker.errors import ConfigError
from worker.streams.durable import Durability

pytestmark = [pytest.mark.redis, pytest.mark.cluster]
GROUP = keys.DEFAULT_GROUP
SEQS = [{"tokens": [1, 2, 3, 4], "prompt_len": 2}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverCluster]:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server/redis-cli not on PATH")
    with FailoverCluster(Path(tmp_path_factory.mktemp("durable"))) as c:
        yield c


@pytest.fixture
def cc(cluster: FailoverCluster) -> Iterator[redis.RedisCluster]:
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    yield client
    client.close()


def _primary(cc: redis.RedisCluster, key: str) -> int:
    return int(cc.get_node_from_key(key).port)


def _keys(cc: redis.RedisCluster, prefix: str, same_node: bool) -> tuple[str, str]:
    """A job stream and a reply stream on the same primary (one slot) or on two primaries."""
    job = f"{prefix}{{j}}:jobs"
    if same_node:
        return job, f"{prefix}{{j}}:replies"
    for n in range(100):
        reply = f"{prefix}{{r{n}}}:replies"
        if _primary(cc, reply) != _primary(cc, job):
            return job, reply
    raise AssertionError("no reply key on another primary")


def _pending_entry(cc: redis.RedisCluster, job: str) -> streams.Delivery:
    """One job entry read by consumer ``c`` (pending), to be answered to nowhere yet."""
    cc.xgroup_create(job, GROUP, id="0", mkstream=True)
    cc.xadd(job, {b"payload": b"job"})
    [[_, [(entry_id, _)]]] = cc.xreadgroup(GROUP, "c", {job: ">"}, count=1)
    return streams.Delivery(job, entry_id.decode(), None, b"result")


def _pending(cc: redis.RedisCluster, job: str) -> int:
    return int(cc.xpending(job, GROUP)["pending"])


def _on_replica(cluster: FailoverCluster, primary: int, key: str) -> int:
    with redis.Redis(port=cluster.replica_of(primary)) as r:
        r.execute_command("READONLY")
        return int(r.xlen(key))


@contextlib.contextmanager
def _stopped(cluster: FailoverCluster, port: int) -> Iterator[None]:
    proc = cluster.procs[port]
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.timeout(120)
def test_two_step_write_acks_only_what_a_replica_acknowledged(
    cluster: FailoverCluster, cc: redis.RedisCluster, key_prefix: str
) -> None:
    job, reply = _keys(cc, key_prefix, same_node=False)
    d = _pending_entry(cc, job)
    d.reply_to = reply
    durable = Durability(replicas=1, timeout_ms=300)
    reply_node = _primary(cc, reply)
    shortfalls: list[str] = []
    with _stopped(cluster, cluster.replica_of(reply_node)):  # the reply node's replica is mute
        failures = streams.write_results(
            cc,
            GROUP,
            [d],
            maxlen=100,
            consumer="c",
            reply_ttl_s=60,
            durability=durable,
            shortfalls=shortfalls,
        )
        assert [(f.entry_id, err.split()[0]) for f, err in failures] == [(d.entry_id, "NOREPLICAS")]
        assert streams.is_transient(failures[0][1])  # the daemon keeps it held and retries
        assert shortfalls == ["two_step"]
        assert _pending(cc, job) == 1  # written on the primary, not acked
        assert cc.xlen(reply) == 1 and cc.ttl(reply) > 0

    def retried() -> bool:  # what the daemon does after its backoff: write again, WAIT, ack
        return not streams.write_results(
            cc, GROUP, [d], maxlen=100, consumer="c", durability=durable, shortfalls=shortfalls
        )

    wait_until(retried, 30, interval=0.2, what="a replicated write")
    assert _pending(cc, job) == 0  # acked after a WAIT that counted the replica
    assert cc.xlen(reply) >= 2  # the first copy and the rewrite (duplicates: the client drops)
    assert _on_replica(cluster, reply_node, reply) == cc.xlen(reply)


@pytest.mark.timeout(120)
def test_two_step_write_without_the_option_acks_at_once(
    cluster: FailoverCluster, cc: redis.RedisCluster, key_prefix: str
) -> None:
    job, reply = _keys(cc, key_prefix, same_node=False)
    d = _pending_entry(cc, job)
    d.reply_to = reply
    with _stopped(cluster, cluster.replica_of(_primary(cc, reply))):
        assert not streams.write_results(cc, GROUP, [d], maxlen=100, consumer="c")
        assert _pending(cc, job) == 0  # acked with its result on no replica: the gap it closes


@pytest.mark.timeout(120)
def test_one_script_write_waits_after_the_script_only_when_asked(
    cluster: FailoverCluster, cc: redis.RedisCluster, key_prefix: str
) -> None:
    job, reply = _keys(cc, key_prefix, same_node=True)
    node = _primary(cc, job)
    for after_scripts, expected in ((False, []), (True, ["one_script"])):
        d = _pending_entry(cc, job)
        d.reply_to = reply
        shortfalls: list[str] = []
        with _stopped(cluster, cluster.replica_of(node)):
            failures = streams.write_results(
                cc,
                GROUP,
                [d],
                maxlen=100,
                consumer="c",
                shortfalls=shortfalls,
                durability=Durability(1, 300, after_scripts=after_scripts),
            )
        assert not failures and _pending(cc, job) == 0  # atomic: acked with its result
        assert shortfalls == expected
        cc.delete(job)
    d = _pending_entry(cc, job)
    d.reply_to = reply
    shortfalls = []
    wait_until(lambda: _on_replica(cluster, node, job) > 0, 30, what="the replica to catch up")
    assert not streams.write_results(
        cc,
        GROUP,
        [d],
        maxlen=100,
        consumer="c",
        shortfalls=shortfalls,
        durability=Durability(1, 2000, after_scripts=True),
    )
    assert shortfalls == [] and _on_replica(cluster, node, reply) == cc.xlen(reply)


def test_durability_validates_its_settings() -> None:
    assert not Durability().enabled and Durability(1).enabled
    with pytest.raises(ConfigError):
        Durability(replicas=-1)
    with pytest.raises(ConfigError):
        Durability(replicas=1, timeout_ms=0)  # WAIT n 0 blocks forever


def _split_queue(cc: redis.RedisCluster, base: str) -> str:
    """A 2-partition queue whose partition 1 lives on another primary than partition 0 (where
    the client's reply stream lives): partition 1's results take the two-step path."""
    for n in range(200):
        queue = f"{base}-{n}"
        s0, s1 = keys.job_streams(queue, 2)
        if _primary(cc, s0) != _primary(cc, s1):
            assert key_slot(s0.encode()) != key_slot(s1.encode())
            return queue
    raise AssertionError("no queue name spreads over two primaries")


@pytest.mark.timeout(180)
def test_worker_with_durable_replicas_answers_and_holds_what_is_not_replicated(
    cluster: FailoverCluster, cc: redis.RedisCluster, key_prefix: str, tmp_path: Path
) -> None:
    queue = _split_queue(cc, key_prefix)
    s0, s1 = keys.job_streams(queue, 2)

    def worker(name: str, replicas: int) -> WorkerProc:
        return WorkerProc(
            ["--scorer", "noop", "--redis-url", cluster.url, "--queue", queue, "--partitions",
             "2", "--consumer", name, "--metrics-port", "0", "--block-ms", "100",
             "--durable-replicas", str(replicas), "--durable-timeout-ms", "300",
             "--drain-timeout-s", "3", "--claim-idle-ms", "60000"],
            tmp_path / f"{name}.log",
        ).wait_ready()  # fmt: skip

    # One replica per primary: WAIT 1 is met, every job is answered and acked.
    w = worker("durable-1", 1)
    try:
        with ScoringClient(cluster.url, queue=queue, partitions=2) as client:
            handles = [client.submit(SEQS, job_id=f"a{i}") for i in range(12)]
            assert {h.stream for h in handles} == {s0, s1}
            for h in handles:
                assert client.result(h, timeout=30).job_id == h.job_id
        wait_until(lambda: _pending(cc, s1) == 0, 10, what="partition 1 acked")
        url = w.metrics_url
        assert metric(url, "scoring_durable_shortfalls_total", '{write="two_step"}') == 0
    finally:
        w.signal(signal.SIGTERM)
        w.proc.wait(30)
    # WAIT 2 is never met: results still reach the producer, but partition 1's entries are not
    # acked (they stay pending, held by the worker, and are written again), partition 0's are.
    # A shortfall holds the worker's loop (it retries that write, like a NOREPLICAS refusal),
    # so the jobs are queued before it starts and come in its first batch.
    with ScoringClient(cluster.url, queue=queue, partitions=2) as client:
        handles = [client.submit(SEQS, job_id=f"b{i}") for i in range(8)]
        held = sum(h.stream == s1 for h in handles)
        assert 0 < held < len(handles)
        w = worker("durable-2", 2)
        try:
            for h in handles:
                assert client.result(h, timeout=30).job_id == h.job_id
            url = w.metrics_url
            wait_until(
                lambda: metric(url, "scoring_durable_shortfalls_total", '{write="two_step"}') >= 2,
                30,
                what="shortfalls counted",
            )
            assert _pending(cc, s1) == held and _pending(cc, s0) == 0
            assert w.proc.poll() is None  # the worker keeps going
        finally:
            w.signal(signal.SIGTERM)
            w.proc.wait(30)
    assert _pending(cc, s1) == held  # never acked without a replica
