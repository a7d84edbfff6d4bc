"""At-least-once under the failures that are not a dead connection: a server that refuses
writes for a while (memory full), keys that cannot be written at all, and a job that crashes
the worker process with its whole batch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.faults.servers import RedisServer, have_redis_server
from tests.support.daemon import ROOT, collect, enqueue, wait_until
from worker import keys
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer

pytestmark = pytest.mark.skipif(not have_redis_server(), reason="needs redis-server")


@pytest.fixture
def server(tmp_path: Path) -> RedisServer:
    srv = RedisServer(tmp_path / "redis", args=["--maxmemory-policy", "noeviction"]).start()
    yield srv
    srv.stop()


def _worker(url: str, stream: str, **cfg: object) -> Worker:
    config = WorkerConfig(streams=(stream,), consumer="w", metrics_port=None, block_ms=100, **cfg)  # type: ignore[arg-type]
    return Worker(
        config,
        RedisSettings(url=url),
        NoopScorer(delay_ms=800),
        metrics=WorkerMetrics(CollectorRegistry()),
    )


def _owner(client: redis.Redis, stream: str, entry_id: str) -> tuple[str, int] | None:
    rows = client.xpending_range(stream, "scoring", entry_id, entry_id, 1)
    if not rows:
        return None
    return rows[0]["consumer"].decode(), int(rows[0]["time_since_delivered"])


@pytest.mark.timeout(60)
def test_results_refused_for_memory_are_retried_not_dead_lettered(server: RedisServer) -> None:
    """A result write refused with OOM keeps its entry pending and held (lease renewed) and is
    written once the server takes writes again: no dead letter, nothing lost."""
    client = server.admin()
    stream = keys.job_streams("oom")[0]
    reply = keys.reply_stream(stream, "c")
    entry_id = enqueue(client, stream, "j1", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    worker = _worker(server.url, stream, claim_idle_ms=1500, max_jobs=1)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: worker.batch_started_s is not None, 10, what="the batch to start")
        client.config_set("maxmemory", 1)  # every denyoom write is refused from now on
        time.sleep(2.5)  # the batch ends, its result write is refused, retried, refused, ...
        owner = _owner(client, stream, entry_id)
        assert owner is not None and owner[0] == "w", owner  # still held by its worker
        assert owner[1] < 1500, owner  # its lease is renewed meanwhile: nobody steals it
        assert client.xlen(keys.dead_letter_stream(stream)) == 0
        assert not worker.health.readiness()[0]  # not ready while Redis refuses writes
    finally:
        client.config_set("maxmemory", 0)
    thread.join(20)
    assert not thread.is_alive()
    results, dups = collect(client, reply, ["j1"], timeout=5)
    assert results["j1"].ok and dups == 0
    assert client.xpending(stream, "scoring")["pending"] == 0
    assert client.xlen(keys.dead_letter_stream(stream)) == 0


@pytest.mark.timeout(60)
def test_an_entry_that_cannot_be_dead_lettered_stays_pending_and_is_released(
    server: RedisServer,
) -> None:
    """Reply stream and dead-letter stream both unwritable (wrong key type): the entry is not
    acked, its lease is let go so it is retried later, and the worker keeps serving. Once the
    dead-letter key is usable again the entry reaches it."""
    client = server.admin()
    stream = keys.job_streams("wrongtype")[0]
    reply = keys.reply_stream(stream, "c")
    dead = keys.dead_letter_stream(stream)
    client.set(reply, "not a stream")
    client.set(dead, "not a stream either")
    entry_id = enqueue(client, stream, "j1", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    enqueue(
        client,
        stream,
        "j2",
        keys.reply_stream(stream, "ok"),
        [{"tokens": [1, 2, 3], "prompt_len": 1}],
    )
    worker = _worker(server.url, stream, claim_idle_ms=400, max_deliveries=2)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        results, _ = collect(client, keys.reply_stream(stream, "ok"), ["j2"], timeout=10)
        assert results["j2"].ok  # the worker kept serving
        # released: its idle time grows past the claim limit (a held entry's is renewed)
        wait_until(
            lambda: (_owner(client, stream, entry_id) or ("", 0))[1] > 400,
            10,
            what="the entry's lease to lapse",
        )
        errors = worker.metrics.registry.get_sample_value(
            "scoring_loop_errors_total", {"where": "dead_letter"}
        )
        assert errors and errors >= 1
        client.delete(dead)  # the operator fixes the dead-letter key
        wait_until(
            lambda: client.exists(dead) and client.xlen(dead) == 1,
            20,
            what="the entry to reach the dead-letter stream",
        )
        fields = client.xrange(dead)[0][1]
        assert fields[b"id"].decode() == entry_id
        wait_until(
            lambda: client.xpending(stream, "scoring")["pending"] == 0,
            5,
            what="the entry to be acked",
        )
    finally:
        worker.request_stop("test")
        thread.join(20)


@pytest.mark.timeout(120)
def test_a_job_that_crashes_the_worker_does_not_take_its_batch_with_it(
    redis_url: str, key_prefix: str, cleanup_keys: None, tmp_path: Path
) -> None:
    """A job whose batch kills the process (segfault, fatal CUDA error) is redelivered with
    its batch-mates; from the third delivery on each entry runs alone, so the innocent jobs
    are answered and only the poison job is dead-lettered."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    ids = [f"j{i}" for i in range(6)]
    for i, job_id in enumerate(ids):
        tokens = [1, 13 if i == 3 else 2, 3]
        enqueue(client, stream, job_id, reply, [{"tokens": tokens, "prompt_len": 1}])
    crashes = 0
    results: dict[str, object] = {}
    for attempt in range(12):
        log = open(tmp_path / f"w{attempt}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "crash_worker.py"), redis_url, stream,
             f"w{attempt}", "400", "4"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            rc = None
        if rc == 3:
            crashes += 1
            time.sleep(0.5)  # past claim_idle_ms: the next worker reclaims
            continue
        try:
            got, _ = collect(client, reply, ids, timeout=15)
            results.update(got)
            break
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()
    assert set(results) == set(ids), (crashes, sorted(results))
    assert results["j3"].code == "dead_letter"  # type: ignore[attr-defined]
    codes = {i: r.code or "ok" for i, r in results.items()}  # type: ignore[attr-defined]
    assert all(codes[i] == "ok" for i in ids if i != "j3"), f"{crashes} crashes: {codes}"
    assert crashes >= 3
    dead = client.xrange(keys.dead_letter_stream(stream))
    assert len(dead) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("forget", [True, False])
def test_a_clean_stop_leaves_the_group_when_holding_nothing(
    redis_url: str, key_prefix: str, cleanup_keys: None, forget: bool
) -> None:
    """Replaced pods do not pile up as dead consumers: a worker that stops cleanly with
    nothing pending deletes its consumer (unless told to keep it)."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    enqueue(client, stream, "j1", reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    client.xgroup_create(stream, "scoring", id="0")
    client.xgroup_createconsumer(stream, "scoring", "other")  # not ours: never touched
    config = WorkerConfig(
        streams=(stream,),
        consumer="leaver",
        metrics_port=None,
        max_jobs=1,
        block_ms=100,
        forget_consumer=forget,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    assert worker.run() == 0
    names = {c["name"].decode() for c in client.xinfo_consumers(stream, "scoring")}
    assert names == ({"other"} if forget else {"other", "leaver"})
    results, _ = collect(client, reply, ["j1"], timeout=5)
    assert results["j1"].ok


@pytest.mark.timeout(60)
def test_reply_streams_without_a_ttl_get_one(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    """A result written to a reply stream nobody reads any more (its client closed and deleted
    it; a late duplicate recreates it) must not leave a key behind forever; a TTL the client
    keeps refreshing is left alone; ``reply_ttl_s=0`` sets none."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    orphan, kept, dead = (keys.reply_stream(stream, n) for n in ("orphan", "kept", "dead"))
    client.xadd(kept, {"x": "1"})
    client.expire(kept, 100_000)  # what a live client keeps refreshing
    for job_id, reply in (("a", orphan), ("b", kept)):
        enqueue(client, stream, job_id, reply, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    enqueue(client, stream, "c", dead, [{"tokens": [1, 2, 3], "prompt_len": 1}],
            deadline_ms=1)  # fmt: skip  # an error result takes the same path
    config = WorkerConfig(
        streams=(stream,),
        consumer="ttl",
        metrics_port=None,
        max_jobs=3,
        block_ms=100,
        reply_ttl_s=600,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    assert worker.run() == 0
    assert 0 < client.ttl(orphan) <= 600
    assert client.ttl(kept) > 600
    assert 0 < client.ttl(dead) <= 600
    client.delete(orphan)
    enqueue(client, stream, "d", orphan, [{"tokens": [1, 2, 3], "prompt_len": 1}])
    config = WorkerConfig(
        streams=(stream,),
        consumer="ttl",
        metrics_port=None,
        max_jobs=1,
        block_ms=100,
        reply_ttl_s=0,
    )
    worker = Worker(
        config,
        RedisSettings(url=redis_url),
        NoopScorer(),
        metrics=WorkerMetrics(CollectorRegistry()),
    )
    assert worker.run() == 0
    assert client.ttl(orphan) == -1
