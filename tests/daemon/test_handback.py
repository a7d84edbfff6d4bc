"""The hand-back on drain: the script (idle time, delivery count, ownership), and in-process workers
(a stopping worker gives back what it did not start; a serving one takes it at once, far before
its periodic reclaim, and forgets the drained consumer; ``handback=False`` drains everything)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from tests.support.daemon import collect, enqueue, wait_until
from worker import keys, streams
from worker.config import RedisSettings
from worker.daemon import Worker
from worker.daemon.config import WorkerConfig
from worker.observability.metrics import WorkerMetrics
from worker.scorer.noop import NoopScorer
from worker.streams.handback import HANDBACK_IDLE_MS

pytestmark = pytest.mark.redis
JOBS = 20  # one job a batch of 200 ms: 4 s of work for the worker that reads them all


def _pending(client: redis.Redis, stream: str, consumer: str | None = None) -> dict[str, Any]:
    rows = client.xpending_range(stream, "g", "-", "+", 100, consumername=consumer)
    return {r["message_id"].decode(): r for r in rows}


@pytest.mark.timeout(20)
def test_hand_back_makes_entries_claimable_without_counting_a_delivery(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    ids = [client.xadd(stream, {"payload": b"x"}).decode() for _ in range(4)]
    client.xreadgroup("g", "a", {stream: ">"}, count=3)  # a holds ids[0:3], delivered once
    client.xreadgroup("g", "b", {stream: ">"}, count=1)  # b holds ids[3]
    # ids[3] belongs to b: left alone
    assert streams.hand_back(client, stream, "g", "a", [ids[0], ids[1], ids[3]]) == ids[:2]
    rows = _pending(client, stream)
    for i in ids[:2]:
        assert rows[i]["consumer"] == b"a"
        assert rows[i]["time_since_delivered"] >= HANDBACK_IDLE_MS - 1000
        assert rows[i]["times_delivered"] == 0  # the delivery that never ran, taken back
    assert rows[ids[2]]["times_delivered"] == 1 and rows[ids[2]]["time_since_delivered"] < 5000
    assert rows[ids[3]]["consumer"] == b"b"
    assert client.hget(keys.handback_key(stream), "a") == b"1"
    assert 0 < client.pttl(keys.handback_key(stream)) <= 24 * 3600 * 1000
    # Another consumer's reclaim (claim idle 30 s) takes exactly the handed-back two at once,
    # with the delivery count they had before the hand-back.
    claimed, _ = streams.reclaim_idle(
        client, stream, "g", "c", min_idle_ms=30000, count=10, use_autoclaim=True, isolate_after=2
    )
    assert sorted(e.id for e in claimed) == sorted(ids[:2])
    assert all(e.deliveries == 1 for e in claimed)
    assert streams.handback_marks(client, [stream]) == {stream: {"a": 1}}
    # a still holds ids[2]: not forgotten; once it holds nothing it is
    assert streams.forget_givers(client, stream, "g", ["a"]) == []
    client.xack(stream, "g", ids[2])
    assert streams.forget_givers(client, stream, "g", ["a"]) == ["a"]
    assert b"a" not in {c["name"] for c in client.xinfo_consumers(stream, "g")}
    assert client.hget(keys.handback_key(stream), "a") is None


def _worker(redis_url: str, stream: str, consumer: str, *, handback: bool) -> Worker:
    """A no-op worker: one 8-token job a batch, 200 ms a batch, claim idle 60 s (its periodic
    reclaim runs at its start, then 30 s later: never again inside a test)."""
    config = WorkerConfig(
        streams=(stream,), group="g", consumer=consumer, metrics_port=None, block_ms=50,
        max_wait_ms=5, max_batch_tokens=8, claim_idle_ms=60000, handback=handback,
    )  # fmt: skip
    scorer = NoopScorer(vocab_size=100, delay_ms=200)
    return Worker(
        config, RedisSettings(url=redis_url), scorer, metrics=WorkerMetrics(CollectorRegistry())
    )


def _start(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def _drain_one(
    redis_url: str, key_prefix: str, *, handback: bool
) -> tuple[Worker, Worker | None, dict[str, Any]]:
    """Worker a reads all ``JOBS`` jobs and is stopped in its first batch; worker b, already looking
    for hand-backs, serves alongside. Returns both and what was seen."""
    client = redis.Redis.from_url(redis_url)
    stream = keys.job_streams(key_prefix)[0]
    reply = keys.reply_stream(stream, "c")
    client.xgroup_create(stream, "g", id="0", mkstream=True)
    ids = [f"j{i}" for i in range(JOBS)]
    for job_id in ids:  # 8 tokens a job, 8 a batch: one job a batch
        enqueue(client, stream, job_id, reply, [{"tokens": list(range(1, 9)), "prompt_len": 1}])
    a = _worker(redis_url, stream, "a", handback=handback)
    ta = _start(a)
    wait_until(lambda: a.pipeline.started_s is not None, 10, what="a's first batch")
    b = _worker(redis_url, stream, "b", handback=handback)
    tb = _start(b)
    wait_until(
        lambda: b.health.started and (b.handback.watch.looks > 0 or not handback),
        10,
        what="b serving",
    )
    done_before = a.jobs_done
    a.request_stop("test")
    t0 = time.monotonic()
    ta.join(15)
    assert not ta.is_alive()
    exit_s = time.monotonic() - t0
    results, _ = collect(client, reply, ids, timeout=25)
    answered_s = time.monotonic() - t0
    b.request_stop("test")
    tb.join(15)
    by = {job_id: r.info["worker"] for job_id, r in results.items()}
    consumers = {c["name"].decode() for c in client.xinfo_consumers(stream, "g")}
    return a, b, {"exit_s": exit_s, "answered_s": answered_s, "by": by, "consumers": consumers,
                  "done_before": done_before}  # fmt: skip


@pytest.mark.timeout(60)
def test_stopping_worker_hands_back_and_the_other_takes_them_at_once(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    a, b, seen = _drain_one(redis_url, key_prefix, handback=True)
    done_by_a = sum(1 for w in seen["by"].values() if w == "a")
    # after the stop: the computing batch, one more that started before the hand-back ran, and
    # one finished but not yet written when the stop came
    assert done_by_a <= seen["done_before"] + 3
    assert a.handback.given == JOBS - done_by_a > 0
    assert a.metrics.registry.get_sample_value("scoring_entries_handed_back_total") == (
        a.handback.given
    )
    assert sum(1 for w in seen["by"].values() if w == "b") == JOBS - done_by_a
    reclaimed = b.metrics.registry.get_sample_value("scoring_entries_reclaimed_total")
    assert reclaimed == a.handback.given
    # b's periodic reclaim is 30 s away: only the hand-back watch explains the pickup
    assert seen["answered_s"] < 15
    assert "a" not in seen["consumers"]  # the drained consumer was forgotten


@pytest.mark.timeout(60)
def test_without_handback_the_stopping_worker_drains_its_whole_backlog(
    redis_url: str, key_prefix: str, cleanup_keys: None
) -> None:
    a, _b, seen = _drain_one(redis_url, key_prefix, handback=False)
    assert a.handback.given == 0
    assert all(w == "a" for w in seen["by"].values())  # it read them all and answered them


def test_the_handback_key_shares_the_streams_slot() -> None:
    for stream in ("scoring:{q}:jobs", "scoring:{q:3}:jobs", "plain-jobs", "a:b:jobs"):
        assert keys.same_slot(stream, keys.handback_key(stream)), stream
    assert keys.handback_key("scoring:{q}:jobs") == "scoring:{q}:handback"
